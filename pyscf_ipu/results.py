"""The outcome of a restricted Kohn-Sham run: :class:`SCFResult`, what every entry point returns
(made by the float64 finalisation, :mod:`pyscf_ipu.finalisation`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from .config import RKSConfig
from .units import HARTREE_TO_EV


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
    density: np.ndarray = field(repr=False)  # (N, N)  float64: the loop's last density, purified (and refined)
    energy_history: np.ndarray = field(repr=False)  # (iterations,)  in-loop energies
    energy_change_history: np.ndarray = field(repr=False)  # (iterations,)  E_k - E_{k-1}, trapezoid rule
    commutator_history: np.ndarray = field(repr=False)  # (iterations,)  max|FDS - SDF|
    refined: int = 0  # float64 iterations after the loop (RKSConfig.refine_commutator)
    refined_commutator: float = float("nan")  # max|FDS - SDF| after them (NaN without a refinement)
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
            "refined": ({"iterations": self.refined, "commutator": self.refined_commutator}
                        if not math.isnan(self.refined_commutator) else None),  # NaN: no refinement
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
