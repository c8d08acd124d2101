"""SCF results, finalised in float64.

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
made). J and K are contracted there too when the loop's integrals are as exact as any the host
holds (device integrals), by the loop's own J-K backend in float64
(:class:`~pyscf_ipu.jk.DeviceContraction`); with host integrals in a float32 loop
(:class:`~pyscf_ipu.jk.HostContraction`) libcint contracts the host's float64 ERIs in
:func:`finalise`, beside the Fock matrix and one small eigensolve. A density-fitted run's K comes
from the device's float32 factor in float32 products with its energy summed in float64
(:class:`~pyscf_ipu.jk.FittedExchange`), and its J from the host's float64 factor (libcint's,
whichever the integral source), by PySCF's own density-fitting code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import jax
import numpy as np
import scipy.linalg
from pyscf import scf as pyscf_scf

from .config import RKSConfig
from .integral_sources import integral_source
from .jk import DeviceContraction, FinalContraction, FittedExchange, HostContraction
from .numint import weighted_points, xc_energy_and_potential
from .padding import pad_to
from .prepare import HostProblem
from .problem import SCFProblem, padded_overlap
from .scf import LoopSettings, SCFTrace
from .units import HARTREE_TO_EV
from .xc.functionals import Functional, get_functional
from .programs import compiled


@dataclass(frozen=True, eq=False)
class SCFResult:
    """The outcome of one restricted Kohn-Sham run. Energies in Hartree unless named otherwise."""

    energy: float
    energy_terms: dict[str, float]
    homo: float
    lumo: float
    converged: bool
    iterations: int
    energy_std_ev: float
    nao: int
    grid_points: int
    electrons_on_grid: float
    mo_energy: np.ndarray = field(repr=False)  # (M,)
    mo_coeff: np.ndarray = field(repr=False)  # (N, M)
    density: np.ndarray = field(repr=False)  # (N, N)  float64: the loop's last density, purified
    energy_history: np.ndarray = field(repr=False)  # (iterations,)  in-loop energies
    energy_change_history: np.ndarray = field(repr=False)  # (iterations,)  E_k - E_{k-1}, trapezoid rule
    commutator_history: np.ndarray = field(repr=False)  # (iterations,)  max|FDS - SDF|
    shapes: tuple[int, int] = (0, 0)  # padded (N, G) the loop was compiled for
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    config: RKSConfig = field(default_factory=RKSConfig)
    jk_profile: dict | None = field(default=None, repr=False)  # the J-K backend's report (ipu)

    @property
    def gap(self) -> float:
        return self.lumo - self.homo

    @property
    def gap_ev(self) -> float:
        return self.gap * HARTREE_TO_EV

    def to_dict(self) -> dict:
        """The JSON-able summary (the CLI's ``--json``)."""
        return {
            "energy_hartree": self.energy,
            "homo_hartree": self.homo,
            "lumo_hartree": self.lumo,
            "gap_hartree": self.gap,
            "gap_ev": self.gap_ev,
            "energy_ev": self.energy * HARTREE_TO_EV,
            "homo_ev": self.homo * HARTREE_TO_EV,
            "lumo_ev": self.lumo * HARTREE_TO_EV,
            "converged": self.converged,
            "iterations": self.iterations,
            "energy_std_ev": self.energy_std_ev,
            "final_commutator": float(self.commutator_history[-1]) if len(self.commutator_history) else None,
            "final_energy_change_hartree": float(self.energy_change_history[-1]) if self.iterations > 1 else None,
            "nao": self.nao,
            "grid_points": self.grid_points,
            "padded_shape": list(self.shapes),
            "electrons_on_grid": self.electrons_on_grid,
            "energy_terms_hartree": self.energy_terms,
            "mo_energy_hartree": self.mo_energy.tolist(),
            "seconds": self.seconds,
            "timings": self.timings,
            "config": asdict(self.config),
        }



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
    """The device's part of the finalisation, in float64, at the loop's padded shapes."""

    density: jax.Array  # (Np, Np)  the loop's last density, purified
    exc: jax.Array  # ()  E_xc at it
    vxc: jax.Array  # (Np, Np)  V_xc at it
    electrons: jax.Array  # ()  the electron count on the grid (NaN without a grid)
    coulomb: jax.Array | None = None  # (Np, Np)  J at it, when the device contracts (else None: the host does)
    exchange: jax.Array | None = None  # (Np, Np)  K at it, likewise
    exchange_trace: jax.Array | None = None  # ()  tr(D K), with K


def final_density(functional: Functional, contraction: FinalContraction, ao, weights, density, overlap, jk
                  ) -> FinalDensity:  # fmt: skip
    """The device's float64 finalisation of one conformer (the kernel of :data:`final_density_program`).

    ``ao`` (4, Gp, Np) and ``weights`` (Gp,) are the loop's own arrays, ``density`` (Np, Np) its
    last density, ``overlap`` the float64 overlap padded to (Np, Np) (unit diagonal on padding) and
    ``jk`` the loop's J-K arrays, from which ``contraction`` forms what it takes of J and K.
    """
    dm = purify(density.astype(overlap.dtype), overlap)
    vj, vk, trace = contraction.final(jk, dm)  # HostContraction: (None, None, None)
    # no grid work for Hartree-Fock, and none past the last weighted point
    exc, vxc, electrons = xc_energy_and_potential(functional, ao, weights, dm, weighted_points(weights))
    return FinalDensity(dm, exc, vxc, electrons, vj, vk, trace)


# Conformers one after another (lax.map), not vmapped: each one's grid blocks then stay cache-sized.
final_density_program = compiled(
    lambda functional, contraction, *arrays: jax.lax.map(lambda member: final_density(functional, contraction, *member),
                                                         arrays),
    static_argnums=(0, 1), name="final_density")


def final_inputs(host: HostProblem, sizes: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """What the float64 finalisation takes from the host besides the loop's arrays: the overlap
    (Np, Np) with a unit diagonal on padded AOs and the grid weights (Gp,), in float64, padded to
    the loop's ``sizes``."""
    npad, gpad = sizes
    return padded_overlap(host.overlap, npad), pad_to(host.grid_weights, (gpad,))


def dispatch_finalisation(config: RKSConfig, settings: LoopSettings, members: list[HostProblem], problems: SCFProblem,
                          sizes: tuple[int, int], trace: SCFTrace) -> FinalDensity:  # fmt: skip
    """Dispatch the device's float64 finalisation of a batch's loop ``trace`` (asynchronous: it
    queues behind the loop): ``members`` and ``problems`` as the loop had them. J and K are
    contracted on the device where its integrals are as exact as the host's, K alone where the loop
    density-fits; else :class:`~pyscf_ipu.jk.HostContraction` leaves them to :func:`finalise`."""
    overlap, weights = (np.stack(a) for a in zip(*(final_inputs(h, sizes) for h in members)))
    if config.density_fitted:
        contraction, jk = FittedExchange(), problems.jk
    elif integral_source(config.integrals).exact_on_device:
        contraction, jk = DeviceContraction(settings.backend), problems.jk
    else:
        contraction, jk = HostContraction(), {}
    with jax.enable_x64(True):  # the float64 host arrays stay float64 on the device
        return final_density_program(settings.functional, contraction, problems.ao, weights, trace.density, overlap, jk)


def fitted_coulomb(host: HostProblem, dm: np.ndarray) -> np.ndarray:
    """J (N, N) in float64 of the symmetric ``dm`` from the host's float64 density-fitted factor, by
    PySCF's own contraction (``df.df_jk.get_jk``)."""
    from pyscf import df

    fitting = df.DF(host.mol)
    fitting.verbose = 0
    fitting._cderi = host.eri_fitted  # (naux, npair): PySCF reads an in-memory factor as it is
    return df.df_jk.get_jk(fitting, dm, hermi=1, with_k=False)[0]


def finalise(
    host: HostProblem,
    trace: SCFTrace,
    final: FinalDensity,
    config: RKSConfig,
    shapes: tuple[int, int],
) -> SCFResult:
    """Energy and orbitals in float64 from the device's :class:`FinalDensity` (of one conformer).

    ``shapes`` are the padded (Np, Gp) of the loop.
    """
    n = host.nao
    dm = np.asarray(final.density, np.float64)[:n, :n]
    ax = get_functional(config.xc).hf_exchange
    if final.coulomb is not None:  # both contracted on the device
        vj, vk = (np.asarray(a, np.float64)[:n, :n] for a in (final.coulomb, final.exchange))
    elif final.exchange is not None:  # density fitting: K on the device, J from the host's float64 factor
        vj, vk = fitted_coulomb(host, dm), np.asarray(final.exchange, np.float64)[:n, :n]
    else:
        vj, vk = pyscf_scf.hf.dot_eri_dm(host.eri_s8, dm, hermi=1)
    exchange_trace = np.sum(dm * vk) if final.exchange_trace is None else final.exchange_trace  # tr(D K)
    exc, vxc, electrons = float(final.exc), np.asarray(final.vxc, np.float64)[:n, :n], float(final.electrons)
    fock = host.hcore + vj - 0.5 * ax * vk + vxc
    terms = {
        "one_electron": float(np.sum(dm * host.hcore)),
        "coulomb": float(0.5 * np.sum(dm * vj)),
        "exact_exchange": float(-0.25 * ax * exchange_trace),
        "xc": float(exc),
        "nuclear_repulsion": host.nuclear_repulsion,
    }
    x = host.orthogonaliser
    mo_energy, vectors = scipy.linalg.eigh(x.T @ fock @ x)
    nocc = host.nocc
    iterations = int(trace.iterations)
    return SCFResult(
        energy=float(sum(terms.values())),
        energy_terms=terms,
        homo=float(mo_energy[nocc - 1]),
        lumo=float(mo_energy[nocc]) if nocc < len(mo_energy) else float("nan"),
        converged=bool(trace.converged),
        iterations=iterations,
        energy_std_ev=float(trace.energy_std_ev),
        nao=n,
        grid_points=host.grid_points,
        electrons_on_grid=float(electrons),
        mo_energy=mo_energy,
        mo_coeff=x @ vectors,
        density=dm,
        energy_history=np.asarray(trace.energies, np.float64)[:iterations],
        energy_change_history=np.asarray(trace.energy_changes, np.float64)[:iterations],
        commutator_history=np.asarray(trace.commutators, np.float64)[:iterations],
        shapes=shapes,
        config=config,
    )
