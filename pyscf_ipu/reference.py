"""PySCF float64 reference runs with the same settings, for ``--check`` and the tests.

The reference is PySCF's own RKS (or RHF for ``hf``) with the same basis, functional (through
libxc) and grid level. Its grid is built the same way ours is, so differences measure our code.
Screening (``eri_threshold``) is not applied to the reference: there the difference shows its cost.
A density-fitted run (``--jk df``) is compared with PySCF's density fitting in the same fitting basis.
A dispersion correction PySCF lacks (ωB97X-D's own) is added to PySCF's energy as this package
computes it (tested against Psi4's), so the comparison is of everything else (:func:`pyscf_runnable`).

PySCF keeps the ERIs (or the density-fitted 3-centre tensor) in memory only while the process's
resident memory plus their size stays under ``max_memory`` (4000 MB by default). Run after our own
SCF in one process, whose freed memory is kept for reuse (:func:`~pyscf_ipu.runtime.reuse_freed_memory`),
the reference would then fall back to direct SCF (or build its fitted tensor on disk, in small blocks)
and take several times as long as alone. Its molecule gets the default budget on top of what the
process already holds, and the SCF and fitting objects made from it inherit that, so it chooses as it
would in a process of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from pyscf import dft, lib, scf

from .pyscf_mole import build_mole
from .molecule import Molecule
from .method import Method
from .resolution import resolve


@dataclass(frozen=True)
class Reference:
    energy: float  # Hartree
    homo: float
    lumo: float
    converged: bool
    cycles: int
    seconds: float
    eris: str  # how PySCF held the ERIs: in memory, recomputed every cycle (direct SCF), or density fitted
    added: str = ""  # what this package added to PySCF's energy (a dispersion correction PySCF lacks), if anything

    @property
    def gap(self) -> float:
        return self.lumo - self.homo


def _how_eris(mf) -> str:
    if getattr(mf, "with_df", None) is not None:
        return "density fitted, " + ("in memory" if isinstance(mf.with_df._cderi, np.ndarray) else "on disk")
    return "in memory" if mf._eri is not None else "recomputed every cycle (direct SCF)"


def pyscf_method(molecule: Molecule, method: Method):
    """PySCF's own counterpart of a run under ``method``, not yet run (default convergence, quiet): RKS
    with the functional through libxc and the grid level (RHF for ``hf``), density fitted in the
    same fitting basis where the run is, with the same dispersion correction. It gets PySCF's
    default memory budget on top of what this process already holds (see the module doc)."""
    config, functional = method.config, method.functional
    mol = build_mole(molecule, config.basis)
    mol.max_memory = lib.current_memory()[0] + mol.max_memory  # MB: the default, beside what we hold
    if functional.pieces:
        mf = dft.RKS(mol)
        mf.xc = functional.libxc_code
        mf.grids.level = config.grid_level
    else:
        mf = scf.RHF(mol)
    mf = method.backend.pyscf_counterpart(mf, config.basis)  # density fitted in the same basis where the run is
    mf = method.dispersion.pyscf_counterpart(mf)
    mf.verbose = 0
    return mf


def pyscf_runnable(molecule: Molecule, method: Method) -> tuple[Method, float]:
    """(what PySCF can run of ``method``, the energy in Hartree to add to PySCF's): ``method`` and 0,
    or, where PySCF lacks the run's dispersion correction, ``method`` without it and the correction's
    energy for ``molecule``."""
    if method.dispersion.in_pyscf:
        return method, 0.0
    added = sum(method.dispersion.energy_terms(molecule, method.functional).values())
    return resolve(method.config.replace(dispersion="none"), method.memory_budget), added


def pyscf_reference(molecule: Molecule, method: Method, conv_tol: float = 1e-11, max_cycle: int = 100) -> Reference:
    """Converge PySCF in float64 (tightly, by default) for ``molecule`` under ``method`` (a dispersion
    correction PySCF lacks added to its energy: :func:`pyscf_runnable`)."""
    runnable, added = pyscf_runnable(molecule, method)
    mf = pyscf_method(molecule, runnable)
    mf.conv_tol = conv_tol
    mf.max_cycle = max_cycle
    start = time.perf_counter()
    energy = mf.kernel() + added
    seconds = time.perf_counter() - start
    nocc = mf.mol.nelectron // 2
    mo_energy = np.asarray(mf.mo_energy)
    return Reference(
        energy=float(energy),
        homo=float(mo_energy[nocc - 1]),
        lumo=float(mo_energy[nocc]) if nocc < len(mo_energy) else float("nan"),
        converged=bool(mf.converged),
        cycles=int(mf.cycles),
        seconds=seconds,
        eris=_how_eris(mf),
        added=f"{method.dispersion.name} dispersion {added:+.10f} Hartree, this package's" if runnable is not method
        else "",
    )
