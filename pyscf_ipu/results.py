"""SCF results, finalised on the host in float64.

The loop may run in float32, where accumulating J and K costs about a meV of total energy. The
energy functional is stationary at self-consistency with respect to orbital rotations, so evaluating
it in float64 at the loop's last density makes the float32 error second order in the density error,
provided the density is a proper one: idempotent (DSD = 2D) with the right electron count. A float32
density is idempotent only to ~1e-6, and that non-idempotency costs first order, tr(F dD), about a
meV. McWeeny purification in float64 restores idempotency to round-off first (measured on a
9-heavy-atom molecule: -1.4 meV before, 1e-5 meV after). Orbital energies come from diagonalising
the float64 Fock matrix of the purified density. The cost is one float64 Fock build (libcint's s8
J/K contraction and one pass over the grid), a few N^3 products and one small eigensolve.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial

import jax
import numpy as np
import scipy.linalg
from pyscf import scf as pyscf_scf

from .config import RKSConfig
from .host import HostProblem
from .numint import electron_count, xc_energy_and_potential
from .padding import pad_to
from .scf import SCFTrace
from .units import HARTREE_TO_EV
from .xc.functionals import Functional


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


@partial(jax.jit, static_argnums=0)
def _xc64(functional: Functional, ao, weights, dm):
    exc, vxc = xc_energy_and_potential(functional, ao, weights, dm)
    return exc, vxc, electron_count(ao, weights, dm)


def finalise(
    host: HostProblem,
    trace: SCFTrace,
    functional: Functional,
    config: RKSConfig,
    shapes: tuple[int, int],
    **extra,
) -> SCFResult:
    """Recompute energy and orbitals in float64 from the loop's last density matrix.

    ``shapes`` are the padded (Np, Gp) of the loop; ``extra`` fills the remaining result fields.
    """
    n = host.nao
    dm = purify(np.asarray(trace.density, np.float64)[:n, :n], host.overlap)
    ax = functional.hf_exchange
    vj, vk = pyscf_scf.hf.dot_eri_dm(host.eri_s8, dm, hermi=1)
    if host.grid_points:
        # Padded to the loop's shapes so that this float64 pass, too, compiles once per bucket.
        npad, gpad = shapes
        weights = pad_to(host.grid_weights, (gpad,))
        with jax.enable_x64(True):  # (outside it, device_put would round the AO values to float32)
            # The padded copy is new and never written again: the device may adopt it without a copy.
            ao = jax.device_put(pad_to(host.ao, (4, gpad, npad)), may_alias=True)
            exc, vxc, electrons = (np.asarray(a) for a in _xc64(functional, ao, weights, pad_to(dm, (npad, npad))))
        vxc = vxc[:n, :n]
    else:
        exc, vxc, electrons = 0.0, np.zeros_like(dm), float("nan")
    fock = host.hcore + vj - 0.5 * ax * vk + vxc
    terms = {
        "one_electron": float(np.sum(dm * host.hcore)),
        "coulomb": float(0.5 * np.sum(dm * vj)),
        "exact_exchange": float(-0.25 * ax * np.sum(dm * vk)),
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
        **extra,
    )
