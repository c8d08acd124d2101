"""Host-side preparation through PySCF (libcint), in float64.

Everything the SCF loop needs that is not the loop itself: the basis, one-electron integrals, the
8-fold-symmetric ERI with optional Schwarz screening, the Becke grid with AO values and gradients on
it, the MINAO initial guess and an orthogonaliser of the overlap matrix. The result is a
:class:`HostProblem` of plain float64 numpy arrays at the molecule's true sizes; padding to shared
shapes and the cast to the device precision happen later (:mod:`pyscf_ipu.problem`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import numpy as np
from pyscf import dft, gto, scf
from pyscf.lib.exceptions import BasisNotFoundError

from .config import RKSConfig
from .molecule import Molecule, MoleculeError

# Eigenvalues of S below this are treated as linear dependence and projected out (PySCF's lindep).
LINEAR_DEPENDENCE_THRESHOLD = 1e-8


@dataclass(frozen=True, eq=False)
class HostProblem:
    """The float64 inputs of one SCF run, at the molecule's true sizes (N AOs, G grid points)."""

    molecule: Molecule
    mol: gto.Mole = field(repr=False)
    nocc: int
    overlap: np.ndarray  # (N, N)
    hcore: np.ndarray  # (N, N)  T + V
    eri_s8: np.ndarray  # (N(N+1)/2 * (N(N+1)/2 + 1) / 2,)  screened, PySCF's s8 packing
    eri_kept: int  # non-zero unique integrals after screening
    orthogonaliser: np.ndarray  # (N, M)  X with X^T S X = 1, M <= N
    density_guess: np.ndarray  # (N, N)  MINAO
    grid_coords: np.ndarray  # (G, 3) Bohr
    grid_weights: np.ndarray  # (G,)
    ao: np.ndarray  # (4, G, N)  values and x/y/z derivatives
    nuclear_repulsion: float
    timings: dict[str, float]

    @property
    def nao(self) -> int:
        return self.overlap.shape[0]

    @property
    def grid_points(self) -> int:
        return self.grid_weights.shape[0]

    @property
    def eri_unique(self) -> int:
        return self.eri_s8.shape[0]


def build_mole(molecule: Molecule, basis: str) -> gto.Mole:
    """A PySCF ``Mole`` for ``molecule`` in ``basis``; an unknown basis or a missing element is a MoleculeError."""
    missing = []
    with warnings.catch_warnings():  # PySCF suggests basis-set-exchange on every miss
        warnings.simplefilter("ignore", UserWarning)
        for symbol in sorted(set(molecule.symbols)):
            try:
                gto.basis.load(basis, symbol)
            except (BasisNotFoundError, KeyError, OSError, RuntimeError):
                missing.append(symbol)
    if missing and _basis_unknown(basis):
        raise MoleculeError(f"unknown basis {basis!r}: use a basis PySCF knows, such as sto-3g, 6-31g or def2-svp")
    if missing:
        raise MoleculeError(f"element(s) {', '.join(missing)} not in basis {basis!r}: choose another basis")
    return gto.M(
        atom=molecule.pyscf_atom(),
        unit="Bohr",
        basis=basis,
        charge=molecule.charge,
        spin=molecule.spin,
        verbose=0,
    )


def _basis_unknown(basis: str) -> bool:
    """True if PySCF has no basis of this name at all (judged by hydrogen and carbon)."""
    for symbol in ("H", "C"):
        try:
            gto.basis.load(basis, symbol)
            return False
        except (BasisNotFoundError, KeyError, OSError, RuntimeError):
            continue
    return True


def schwarz_screen(eri_s8: np.ndarray, npair: int, threshold: float) -> np.ndarray:
    """Zero (ij|kl) where sqrt((ij|ij) (kl|kl)) < threshold; returns a screened copy.

    In the s8 packing, row p = ij of the lower triangle of the (npair, npair) pair matrix starts at
    p(p+1)/2 and holds the columns q = kl <= p, its diagonal (ij|ij) last.
    """
    if threshold <= 0:
        return eri_s8
    starts = np.arange(npair) * (np.arange(npair) + 1) // 2
    bound = np.sqrt(np.abs(eri_s8[starts + np.arange(npair)]))  # (npair,) sqrt((ij|ij))
    screened = eri_s8.copy()
    for p in range(npair):
        row = screened[starts[p] : starts[p] + p + 1]
        row[bound[p] * bound[: p + 1] < threshold] = 0.0
    return screened


def orthogonaliser(overlap: np.ndarray) -> np.ndarray:
    """Canonical orthogonalisation X = U s^-1/2 over eigenvalues s of S above the lindep threshold."""
    s, u = np.linalg.eigh(overlap)
    keep = s > LINEAR_DEPENDENCE_THRESHOLD
    return u[:, keep] / np.sqrt(s[keep])


def prepare(molecule: Molecule, config: RKSConfig, needs_grid: bool = True) -> HostProblem:
    """Run PySCF's float64 preparation for ``molecule`` under ``config``.

    The grid is built exactly as PySCF's RKS builds it on its first cycle (level ``grid_level``,
    then points where the MINAO density is negligible pruned by ``small_rho_cutoff``), so our results
    and PySCF's refer to the same quadrature. ``needs_grid=False`` (Hartree-Fock) skips it.
    """
    timings: dict[str, float] = {}
    t = time.perf_counter()
    mol = build_mole(molecule, config.basis)
    overlap = mol.intor("int1e_ovlp")
    hcore = mol.intor("int1e_kin") + mol.intor("int1e_nuc")
    x = orthogonaliser(overlap)
    timings["one_electron"] = time.perf_counter() - t

    t = time.perf_counter()
    nao = mol.nao_nr()
    eri = schwarz_screen(mol.intor("int2e", aosym="s8"), nao * (nao + 1) // 2, config.eri_threshold)
    eri_kept = int(np.count_nonzero(eri))
    timings["eri"] = time.perf_counter() - t

    t = time.perf_counter()
    dm0 = scf.hf.init_guess_by_minao(mol)
    timings["guess"] = time.perf_counter() - t

    t = time.perf_counter()
    if needs_grid:
        ks = dft.RKS(mol)
        ks.grids.level = config.grid_level
        ks.initialize_grids(mol, dm0)
        coords, weights = ks.grids.coords, ks.grids.weights
        timings["grid"] = time.perf_counter() - t
        t = time.perf_counter()
        ao = dft.numint.eval_ao(mol, coords, deriv=1)  # (4, G, N)
        timings["ao_values"] = time.perf_counter() - t
    else:
        coords, weights, ao = np.zeros((0, 3)), np.zeros(0), np.zeros((4, 0, nao))

    return HostProblem(
        molecule=molecule,
        mol=mol,
        nocc=molecule.nelectron // 2,
        overlap=overlap,
        hcore=hcore,
        eri_s8=eri,
        eri_kept=eri_kept,
        orthogonaliser=x,
        density_guess=dm0,
        grid_coords=np.asarray(coords),
        grid_weights=np.asarray(weights),
        ao=np.asarray(ao),
        nuclear_repulsion=float(mol.energy_nuc()),
        timings=timings,
    )
