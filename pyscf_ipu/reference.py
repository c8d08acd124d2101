"""PySCF float64 reference runs with the same settings, for ``--check`` and the tests.

The reference is PySCF's own RKS (or RHF for ``hf``) with the same basis, functional (through
libxc) and grid level. Its grid is built the same way ours is, so differences measure our code.
Screening (``eri_threshold``) is not applied to the reference: there the difference shows its cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from pyscf import dft, scf

from .config import RKSConfig
from .mole import build_mole
from .molecule import Molecule
from .xc.functionals import get_functional


@dataclass(frozen=True)
class Reference:
    energy: float  # Hartree
    homo: float
    lumo: float
    converged: bool
    cycles: int
    seconds: float

    @property
    def gap(self) -> float:
        return self.lumo - self.homo


def pyscf_reference(molecule: Molecule, config: RKSConfig, conv_tol: float = 1e-11, max_cycle: int = 100) -> Reference:
    """Converge PySCF in float64 (tightly, by default) for ``molecule`` under ``config``."""
    mol = build_mole(molecule, config.basis)
    functional = get_functional(config.xc)
    if functional.pieces:
        mf = dft.RKS(mol)
        mf.xc = functional.libxc_code
        mf.grids.level = config.grid_level
    else:
        mf = scf.RHF(mol)
    mf.conv_tol = conv_tol
    mf.max_cycle = max_cycle
    mf.verbose = 0
    start = time.perf_counter()
    energy = mf.kernel()
    seconds = time.perf_counter() - start
    nocc = mol.nelectron // 2
    mo_energy = np.asarray(mf.mo_energy)
    return Reference(
        energy=float(energy),
        homo=float(mo_energy[nocc - 1]),
        lumo=float(mo_energy[nocc]) if nocc < len(mo_energy) else float("nan"),
        converged=bool(mf.converged),
        cycles=int(mf.cycles),
        seconds=seconds,
    )
