"""The float64 finalisation: the loop's last density -> :class:`~pyscf_ipu.results.SCFResult`.

The loop may run in float32, where accumulating J and K costs about a meV of total energy. The
energy functional is stationary at self-consistency with respect to orbital rotations, so evaluating
it in float64 at the loop's last density makes the float32 error second order in the density error,
provided the density is a proper one: idempotent (DSD = 2D) with the right electron count. A float32
density is idempotent only to about 1e-6, which would cost first order, tr(F dD); McWeeny
purification in float64 restores idempotency to round-off first. Orbital energies come from
diagonalising the float64 Fock matrix of the purified density (``docs/decisions/float64-finalisation.md``).

The work is split where its data lives. On the device, queued right behind the loop so that the
host need not wait for it (:func:`dispatch_finalisation`, one program for a whole batch): the
purification and the float64 pass over the grid, which reads the loop's own AO values (in the
loop's precision, promoted to float64 block by block, so no float64 copy of the largest array is
made). J and K of the purified density come from a :class:`FinalContraction`, which does its share
on the device and the rest on the host; the run's J-K backend gives its own
(:func:`final_contraction`):

- exact ERIs computed on the device in float64 but held rounded by a float32 loop: those ERIs,
  contracted there row by row (:class:`~pyscf_ipu.jk.exact.DeviceERIs`);
- the JAX integrals' ERIs held as computed (float32 on a CPU): the loop's own backend over its
  arrays, summed in float64 (:class:`~pyscf_ipu.jk.exact.LoopBackend`);
- libcint's ERIs: PySCF contracts the host's float64 copy (:class:`~pyscf_ipu.jk.exact.LibcintERIs`);
- density fitting: K from the float32 factor in float32 products with its energy summed in float64,
  and J from the float64 factor, both on the device (:class:`~pyscf_ipu.jk.fitted.FittedExchange`).

Where both are formed on the device, so are the Fock matrix, the energy terms and the eigensolve,
and the host only reads the labels out (:func:`finalise`); else the host does those three.

A :class:`Refinement` can continue the SCF in float64 on the device before the labels: DIIS
iterations until max|FDS - SDF| is below its threshold. The labels do not need it (they are
second order in the density's error), but nuclear gradients are first order in it, and a float32
loop stops where its own Fock matrices' rounding does (``docs/decisions/fitted-forces.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from .jk.exact import LoopBackend
from .method import Method
from .assembly import BatchMember
from .numint import weighted_points, xc_energy_and_potential
from .prepare import PreparedProblem
from .problem import FINAL_SHIFT, FinalInputs, PreparedBatch
from .programs import compiled, map_members, members_at_once
from .results import SCFResult
from .scf import SCFTrace, commutator, density_matrix, diis_extrapolate, energy_terms, fock_matrix
from .xc.functionals import Functional


def purify(dm: np.ndarray, overlap: np.ndarray, steps: int = 3) -> np.ndarray:
    """McWeeny purification (R. McWeeny, Rev. Mod. Phys. 32, 335 (1960)) of a closed-shell density.

    With P = D/2, iterate P <- 3 PSP - 2 PSPSP, which converges quadratically to the nearest
    idempotent PSP = P. Three steps take a float32 density (error ~1e-6) to float64 round-off.
    """
    p = 0.5 * dm
    for _ in range(steps):
        ps = p @ overlap
        p = 3.0 * ps @ p - 2.0 * ps @ ps @ p
    return p + p.T  # = 2P, symmetrised


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FinalDensity:
    """The device's part of the finalisation, in float64, at the loop's padded shapes; with the labels
    where J and K were formed on the device too (else those fields are None)."""

    density: jax.Array  # (Np, Np)  the loop's last density, purified (and refined, where asked)
    exc: jax.Array  # ()  E_xc at it
    vxc: jax.Array  # (Np, Np)  V_xc at it
    electrons: jax.Array  # ()  the electron count on the grid (NaN without a grid)
    refined: jax.Array  # () int  float64 iterations of the :class:`Refinement` (0 without one)
    refined_commutator: jax.Array  # ()  max|FDS - SDF| at ``density`` after them (NaN without one)
    coulomb: jax.Array | None = None  # (Np, Np)  J at it, where the contraction forms it on the device
    exchange: jax.Array | None = None  # (Np, Np)  K at it, likewise
    exchange_trace: jax.Array | None = None  # ()  tr(D K), likewise
    energy_terms: dict | None = None  # the total energy's terms (:func:`~pyscf_ipu.scf.energy_terms`)
    mo_energy: jax.Array | None = None  # (Np,)  ascending, the dropped directions' last (FINAL_SHIFT)
    mo_coeff: jax.Array | None = None  # (Np, Np)  their coefficients
    orbitals: jax.Array | None = None  # ()  the orbitals that are not dropped directions


class FinalContraction(Protocol):
    """How the finalisation gets J, K and tr(D K) of the purified density (N, N): a share on the
    device, queued behind the loop, and the rest on the host."""

    forms_jk_on_device: ClassVar[bool]  # whether :meth:`on_device` forms both J and K

    def device_arrays(self, jk, final: FinalInputs):
        """What :meth:`on_device` reads of the loop's J-K arrays ``jk`` and the batch's final inputs
        ``final`` (``{}``: nothing)."""

    def on_device(self, data, dm) -> tuple[jax.Array | None, jax.Array | None, jax.Array | None]:
        """(J, K, tr(D K)) of the padded ``dm``, each None where :meth:`on_host` forms it; traced."""

    def on_host(self, prepared: PreparedProblem, dm: np.ndarray, final: FinalDensity
                ) -> tuple[np.ndarray, np.ndarray, float]:  # fmt: skip
        """(J, K, tr(D K)) of ``dm`` at the molecule's size, in float64, from the device's ``final``."""


def _own(a, n: int) -> np.ndarray:
    """The molecule's (n, n) block of a padded matrix (its AOs first: a host preparation's), in float64."""
    return np.asarray(a, np.float64)[:n, :n]


def final_contraction(method: Method) -> FinalContraction:
    """The run's :class:`FinalContraction`, as its J-K backend gives it (``final_contraction``)."""
    return method.backend.final_contraction(method)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Contracted:
    """A purified density's potentials: J, K, tr(D K), E_xc and V_xc (numpy or JAX arrays alike)."""

    coulomb: object  # (N, N)
    exchange: object  # (N, N)
    exchange_trace: object  # ()
    exc: object  # ()
    vxc: object  # (N, N)


def labels(dm, hcore, potentials: Contracted, orthogonaliser, shift, exchange_factor: float, nuclear_repulsion, eigh):
    """(energy terms, orbital energies, coefficients) from the ``potentials`` of the density ``dm``:
    the loop's own formulas (:func:`~pyscf_ipu.scf.fock_matrix`, :func:`~pyscf_ipu.scf.energy_terms`)
    and one eigensolve ``eigh`` of the Fock matrix in the orthogonal basis ``orthogonaliser``, whose
    dropped directions get ``shift`` on the diagonal (numpy on the host or JAX on the device alike)."""
    p = potentials
    terms = energy_terms(dm, hcore, p.coulomb, p.exchange_trace, p.exc, exchange_factor, nuclear_repulsion)
    fock = fock_matrix(hcore, p.coulomb, p.exchange, p.vxc, exchange_factor)
    mo_energy, vectors = eigh(orthogonaliser.T @ fock @ orthogonaliser + shift)
    return terms, mo_energy, orthogonaliser @ vectors


REFINE_ITERATIONS = 12  # a refinement's most float64 iterations
REFINE_DIIS = 8  # Fock matrices its DIIS keeps


@dataclass(frozen=True)
class Refinement:
    """Float64 SCF iterations from the loop's purified density, before the labels: each builds the
    Fock matrix with ``contraction`` (J and K on the device) and V_xc in float64, extrapolates by
    DIIS (:func:`~pyscf_ipu.scf.diis_extrapolate`) and diagonalises, until max|FDS - SDF| is below
    ``commutator`` or after :data:`REFINE_ITERATIONS`. ``commutator`` 0: none (one float64 pass)."""

    commutator: float
    contraction: FinalContraction

    def device_arrays(self, jk, final: FinalInputs):
        return self.contraction.device_arrays(jk, final) if self.commutator > 0 else {}


def refinement(method: Method) -> Refinement:
    """``method``'s :class:`Refinement`: its J and K by the finalisation's contraction where that forms
    them on the device, else by the loop's own backend over its arrays, summed in float64."""
    contraction = final_contraction(method)
    if not contraction.forms_jk_on_device:
        contraction = LoopBackend(method.backend)
    return Refinement(method.config.refine_threshold, contraction)


def _potentials(functional: Functional, contraction: FinalContraction, ao, final: FinalInputs, jk, dm
                ) -> tuple[Contracted, jax.Array]:  # fmt: skip
    """J, K, tr(D K) (None where the host forms them), E_xc and V_xc of ``dm``, and the electrons on the
    grid; no grid work for Hartree-Fock, and none past the last weighted point."""
    vj, vk, trace = contraction.on_device(jk, dm)
    exc, vxc, electrons = xc_energy_and_potential(functional, ao, final.weights, dm, weighted_points(final.weights))
    return Contracted(vj, vk, trace, exc, vxc), electrons


def dropped_shift(final: FinalInputs) -> jax.Array:
    """(Np, Np): :data:`~pyscf_ipu.problem.FINAL_SHIFT` on the diagonal of the orthogonal basis's dropped
    directions (padded AOs and linear dependencies), zero elsewhere."""
    return jnp.diag(jnp.where(final.kept, 0.0, FINAL_SHIFT))


def refine(functional: Functional, refinement: Refinement, ao, final: FinalInputs, jk, dm):
    """(density, its :func:`_potentials`, its electrons on the grid, iterations, max|FDS - SDF| at it):
    ``refinement``'s float64 iterations from the idempotent ``dm`` (Np, Np); traced."""
    x, shift, n = final.orthogonaliser, dropped_shift(final), dm.shape[0]
    occupation = jnp.where(jnp.arange(n) < final.occupied, 2.0, 0.0).astype(dm.dtype)

    def fock_and_error(dm, potentials):
        p = potentials
        fock = fock_matrix(final.hcore, p.coulomb, p.exchange, p.vxc, functional.exchange_factor)
        return fock, commutator(fock, dm, final.overlap)

    def step(state):
        it, _, _, _, fock, error, focks, errors = state
        slot = it % REFINE_DIIS
        focks, errors = focks.at[slot].set(fock), errors.at[slot].set(error)
        _, vectors = jnp.linalg.eigh(x.T @ diis_extrapolate(focks, errors, jnp.minimum(it + 1, REFINE_DIIS)) @ x + shift)
        dm = density_matrix(x @ vectors, occupation)
        potentials, electrons = _potentials(functional, refinement.contraction, ao, final, jk, dm)
        return (it + 1, dm, potentials, electrons, *fock_and_error(dm, potentials), focks, errors)

    def keep_going(state):
        return (state[0] < REFINE_ITERATIONS) & (jnp.max(jnp.abs(state[5])) >= refinement.commutator)

    potentials, electrons = _potentials(functional, refinement.contraction, ao, final, jk, dm)
    ring = jnp.zeros((REFINE_DIIS, n, n), dm.dtype)
    start = (jnp.zeros((), jnp.int32), dm, potentials, electrons, *fock_and_error(dm, potentials), ring, ring)
    it, dm, potentials, electrons, _, error, _, _ = jax.lax.while_loop(keep_going, step, start)
    return dm, potentials, electrons, it, jnp.max(jnp.abs(error))


def final_density(functional: Functional, contraction: FinalContraction, refinement: Refinement, ao, density,
                  final: FinalInputs, jk, refine_jk) -> FinalDensity:  # fmt: skip
    """The device's float64 finalisation of one conformer (the kernel of :data:`final_density_program`).

    ``ao`` (4, Gp, Np) is the loop's own array, ``density`` (Np, Np) its last density, ``final`` the
    batch's float64 :class:`~pyscf_ipu.problem.FinalInputs`, and ``jk`` and ``refine_jk`` what
    ``contraction`` and ``refinement`` read of the loop's J-K arrays. The density is purified, then
    refined (where ``refinement`` asks); where ``contraction`` forms both J and K here, the labels
    follow here too.
    """
    dm = purify(density.astype(final.overlap.dtype), final.overlap)
    refined, largest = jnp.zeros((), jnp.int32), jnp.full((), jnp.nan, dm.dtype)
    if refinement.commutator > 0:
        dm, potentials, electrons, refined, largest = refine(functional, refinement, ao, final, refine_jk, dm)
        if refinement.contraction != contraction:  # the labels' J and K by their own contraction; V_xc stands
            vj, vk, trace = contraction.on_device(jk, dm)
            potentials = replace(potentials, coulomb=vj, exchange=vk, exchange_trace=trace)
    else:
        potentials, electrons = _potentials(functional, contraction, ao, final, jk, dm)
    p = potentials
    out = FinalDensity(dm, p.exc, p.vxc, electrons, refined, largest, p.coulomb, p.exchange, p.exchange_trace)
    if p.coulomb is None or p.exchange is None:
        return out
    terms, mo_energy, mo_coeff = labels(dm, final.hcore, p, final.orthogonaliser, dropped_shift(final),
                                        functional.exchange_factor, final.nuclear_repulsion,
                                        jnp.linalg.eigh)  # fmt: skip
    return replace(out, energy_terms=terms, mo_energy=mo_energy, mo_coeff=mo_coeff, orbitals=jnp.sum(final.kept))


# Conformers ``at_once`` together (programs.map_members): on a CPU one after another, so that each
# one's grid blocks stay cache-sized
final_density_program = compiled(
    lambda functional, contraction, refinement, at_once, *arrays: map_members(
        lambda member: final_density(functional, contraction, refinement, *member), arrays, at_once),
    static_argnums=(0, 1, 2, 3), name="final_density", quick_compile=True)


def dispatch_finalisation(method: Method, batch: PreparedBatch, trace: SCFTrace) -> FinalDensity:
    """Dispatch the device's float64 finalisation of ``batch``'s loop ``trace`` (asynchronous: it
    queues behind the loop)."""
    contraction, refining = final_contraction(method), refinement(method)
    jk = contraction.device_arrays(batch.problem.jk, batch.final)
    refine_jk = refining.device_arrays(batch.problem.jk, batch.final)
    ao = batch.problem.ao  # (C, 4, Gp, Np)
    at_once = members_at_once(ao.shape[0], 8 * math.prod(ao.shape[1:]))  # a conformer's AO values in float64
    with jax.enable_x64(True):  # the float64 inputs stay float64
        return final_density_program(method.functional, contraction, refining, at_once, ao, trace.density,
                                     batch.final, jk, refine_jk)  # fmt: skip


def finalise(member: BatchMember, trace: SCFTrace, final: FinalDensity, method: Method,
             shapes: tuple[int, int]) -> SCFResult:  # fmt: skip
    """Energy and orbitals in float64 of one conformer from the device's :class:`FinalDensity`, whose
    loop ran at the padded ``shapes`` (Np, Gp): read out where the device formed the labels, else
    formed here from the host's preparation. Matrices at the molecule's size, in its AO order."""
    aos = member.aos
    dm = np.asarray(final.density, np.float64)[np.ix_(aos, aos)]
    if final.mo_energy is not None:
        orbitals = int(final.orbitals)
        terms = {k: float(v) for k, v in final.energy_terms.items()}
        mo_energy, mo_coeff = np.asarray(final.mo_energy)[:orbitals], np.asarray(final.mo_coeff)[aos, :orbitals]
    else:
        prepared = member.host
        ax = method.functional.exchange_factor
        vj, vk, exchange_trace = final_contraction(method).on_host(prepared, dm, final)
        x = prepared.orthogonaliser
        potentials = Contracted(vj, vk, exchange_trace, float(final.exc), _own(final.vxc, member.nao))
        terms, mo_energy, mo_coeff = labels(dm, prepared.hcore, potentials, x, 0.0, ax, prepared.nuclear_repulsion,
                                            scipy.linalg.eigh)  # fmt: skip
        terms = {k: float(v) for k, v in terms.items()}
    terms = {**terms, **method.dispersion.energy_terms(member.molecule, method.functional)}
    nocc = member.nocc
    iterations = int(trace.iterations)
    return SCFResult(
        energy=float(sum(terms.values())),
        energy_terms=terms,
        homo=float(mo_energy[nocc - 1]),
        lumo=float(mo_energy[nocc]) if nocc < len(mo_energy) else float("nan"),
        converged=bool(trace.converged),
        iterations=iterations,
        energy_std_ev=float(trace.energy_std_ev),
        nao=member.nao,
        grid_points=member.grid_points,
        electrons_on_grid=float(final.electrons),
        mo_energy=mo_energy,
        mo_coeff=mo_coeff,
        density=dm,
        refined=int(final.refined),
        refined_commutator=float(final.refined_commutator),
        energy_history=np.asarray(trace.energies, np.float64)[:iterations],
        energy_change_history=np.asarray(trace.energy_changes, np.float64)[:iterations],
        commutator_history=np.asarray(trace.commutators, np.float64)[:iterations],
        shapes=shapes,
        config=method.config,
    )
