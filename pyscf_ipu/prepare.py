"""The preparation of a batch of conformers for the SCF loop, on the host, at each molecule's sizes.

Everything the loop needs that is not the loop itself: the one-electron integrals, the
8-fold-symmetric ERI with optional Schwarz screening, the Becke grid (and, with libcint integrals,
the AO values on it), the MINAO initial guess and an orthogonaliser of the overlap matrix. The
integrals and the grid come from the run's :mod:`integral source <pyscf_ipu.integral_sources>`;
the result is one :class:`PreparedProblem` per conformer, of plain numpy arrays. Padding to shared
shapes and the cast to the loop's precision happen later (:mod:`pyscf_ipu.problem`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from pyscf import dft, gto, lib, scf
from pyscf.scf import addons, atom_hf

from .buckets import SizeBucket
from .integral_sources import ao_template
from .integrals.ao_values import AOTables
from .method import Method
from .pyscf_mole import build_mole, element_basis
from .molecule import Molecule
from .packed import PackedERI, s8_aos, s8_size

# Eigenvalues of S below this are treated as linear dependence and projected out (PySCF's lindep).
LINEAR_DEPENDENCE_THRESHOLD = 1e-8


@dataclass(frozen=True, eq=False)
class PreparedProblem:
    """One conformer's inputs to the SCF loop as prepared on the host: numpy arrays in float64 at the
    molecule's own sizes (N AOs, G grid points), but for the ERIs of the JAX integral source, which
    stay in the loop's precision at the size bucket's AOs (read-only; the molecule's are their
    leading part), and for the AO values, which that source leaves to the device (``ao`` None)."""

    molecule: Molecule
    mol: gto.Mole = field(repr=False)
    nocc: int
    overlap: np.ndarray  # (N, N)
    hcore: np.ndarray  # (N, N)  T + V
    eri_s8: np.ndarray  # (N(N+1)/2 * (N(N+1)/2 + 1) / 2,)  screened, PySCF's s8 packing; float64 from
    # libcint, or in the run's precision from the JAX integrals (then read-only)
    eri_kept: int  # non-zero unique integrals after screening
    eri_fitted: np.ndarray  # (naux, N(N+1)/2) float64: the density-fitted ERIs (integral_sources.fitted_eri)
    # where the J-K backend is density fitted; then eri_s8 is empty, else this is (0, 0)
    orthogonaliser: np.ndarray  # (N, M)  X with X^T S X = 1, M <= N
    density_guess: np.ndarray  # (N, N)  MINAO
    grid_coords: np.ndarray  # (G, 3) Bohr
    grid_weights: np.ndarray  # (G,)
    grid_owners: np.ndarray  # (G,) int: the atom whose grid each point belongs to
    ao: np.ndarray | None  # (4, G, N)  values and x/y/z derivatives; None: evaluated on the device (ao_tables)
    nuclear_repulsion: float
    timings: dict[str, float]
    bucket: SizeBucket  # the size bucket whose shapes the problem is padded to

    @property
    def nao(self) -> int:
        return self.overlap.shape[0]

    @property
    def ao_tables(self) -> AOTables:
        """The basis as the device's AO-value kernel takes it (cached per basis and elements)."""
        return ao_template(self.bucket.basis, tuple(self.mol.elements))

    @property
    def eri_nao(self) -> int:
        """The AOs of ``eri_s8``: the molecule's (libcint), or its bucket's (the JAX integrals write
        the bucket's s8 array, of which the molecule's is the leading part; the rest is zero)."""
        return s8_aos(self.eri_s8.shape[0])

    @property
    def grid_points(self) -> int:
        return self.grid_weights.shape[0]

    @property
    def eri(self) -> PackedERI:
        """The molecule's own ERIs as the J-K backends take them (the leading part of a bucket's s8
        array: a view, not a copy)."""
        return PackedERI(self.eri_s8[: s8_size(self.nao)], self.nao, self.eri_kept)


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


@lru_cache(maxsize=None)
def _minao_atom(symbol: str) -> tuple[np.ndarray, list]:
    """Occupations and minimal basis of one all-electron atom in PySCF's MINAO guess.

    For each l = 0..3 the atom's ``ndocc`` doubly occupied shells and its fractionally occupied one
    (``atom_hf.frac_occ``: the spherically averaged ground-state configuration) are taken from
    PySCF's ANO basis, whose l-th entry lists each primitive's exponent and then the coefficients of
    the contractions from the lowest shell up; occupation 2, 2, ..., frac per m component.
    """
    ano = element_basis("ano", symbol)
    occupations, shells = [], []
    for l in range(4):
        ndocc, frac = atom_hf.frac_occ(symbol, l)
        occupations.append(np.repeat([2.0] * ndocc + [frac], 2 * l + 1))
        shells.append([l] + [primitive[: ndocc + 2] for primitive in ano[l][1:]])
    return np.concatenate(occupations), shells


def minao_guess(mol: gto.Mole) -> np.ndarray:
    """PySCF's MINAO initial density (``scf.hf.init_guess_by_minao``, equal to it to round-off).

    The atoms' minimal-basis occupations are projected onto ``mol``'s basis,
    D = P diag(n) P^T with P = S^-1 <mol|minimal>. PySCF's own function re-reads the ANO basis file
    for every element of every molecule; here the per-element part is cached. Molecules with ECPs
    (which change the core occupations) go to PySCF's function.
    """
    if mol.has_ecp():
        return scf.hf.init_guess_by_minao(mol)
    symbols = [mol.atom_pure_symbol(i) for i in range(mol.natm)]
    atoms = {symbol: _minao_atom(symbol) for symbol in set(symbols)}
    minimal = gto.M(
        atom=[(symbol, xyz) for symbol, xyz in zip(symbols, mol.atom_coords())],
        unit="Bohr",
        basis={symbol: shells for symbol, (_, shells) in atoms.items()},
        spin=sum(gto.charge(symbol) for symbol in symbols) % 2,  # neutral atoms: only the parity matters
        verbose=0,
    )
    occupations = np.concatenate([atoms[symbol][0] for symbol in symbols])
    return addons.project_dm_nr2nr(minimal, np.diag(occupations), mol)


def orthogonaliser(overlap: np.ndarray) -> np.ndarray:
    """Canonical orthogonalisation X = U s^-1/2 over eigenvalues s of S above the lindep threshold."""
    s, u = np.linalg.eigh(overlap)
    keep = s > LINEAR_DEPENDENCE_THRESHOLD
    return u[:, keep] / np.sqrt(s[keep])


@dataclass(frozen=True)
class _Integrals:
    """One conformer's integrals and guess as the integral source and PySCF gave them."""

    overlap: np.ndarray  # (N, N)
    hcore: np.ndarray  # (N, N)
    eri: np.ndarray  # s8, or empty where density fitted
    nonzero: int  # non-zero entries of ``eri``
    fitted: np.ndarray  # (naux, npair), or (0, 0) where not density fitted
    grid: tuple | None  # (points, weights, owners) from the JAX source; None: PySCF's on the host
    guess: np.ndarray  # (N, N)  the MINAO density


def prepare(molecules: list[Molecule], method: Method) -> list[PreparedProblem]:
    """PySCF's float64 preparation of ``molecules`` under ``method``: conformers of molecules of one
    size bucket (:class:`SizeBucket`), a batch.

    The one-electron integrals, the ERIs and the grids come from the run's integral source, each in
    one call for the whole batch; the timings share that time out equally. The grid has exactly the
    points and weights of PySCF's RKS grid at ``grid_level`` (PySCF 2.14 prunes nothing by default),
    so our results and PySCF's refer to the same quadrature; only PySCF's spatial sort of the points
    is skipped. A functional without a grid part (Hartree-Fock) gets no grid.
    """
    config = method.config
    mols = [build_mole(molecule, config.basis) for molecule in molecules]  # checks the elements and basis
    bucket = SizeBucket.of(molecules[0], config.basis, config.grid_level, config.occupied_step)
    if any(not bucket.fits(molecule) for molecule in molecules[1:]):
        raise ValueError("a batch needs molecules of one size bucket")
    # the guess first: it needs no integrals, so in the generator it runs while the device still
    # works on the previous batch (the JAX source's calls below wait for that). On one OpenMP thread:
    # its many small PySCF calls, each a parallel region, would otherwise wait for a second thread
    # that the device's loop keeps busy.
    t = time.perf_counter()
    with lib.with_omp_threads(1):
        guesses = [minao_guess(mol) for mol in mols]
    guess_seconds = (time.perf_counter() - t) / len(mols)

    source = method.integrals
    t = time.perf_counter()
    one_electron = source.one_electron(mols, bucket)
    one_electron_seconds = (time.perf_counter() - t) / len(mols)

    t = time.perf_counter()
    if config.density_fitted:  # no N^4 array at all
        fitted = source.fitted_eris(mols, bucket, config)
        eris, counts = [np.zeros(0)] * len(mols), [0] * len(mols)
    else:
        eris, counts = source.eris(mols, bucket, config)
        fitted = [np.zeros((0, 0))] * len(mols)
    eri_seconds = (time.perf_counter() - t) / len(mols)

    t = time.perf_counter()
    grids = source.grids(mols, bucket) if method.needs_grid else [None] * len(mols)
    grid_seconds = (time.perf_counter() - t) / len(mols)
    timings = {"one_electron": one_electron_seconds, "eri": eri_seconds, "grid": grid_seconds, "guess": guess_seconds}
    integrals = [_Integrals(*ints, eri, count, fit, grid, guess) for ints, eri, count, fit, grid, guess
                 in zip(one_electron, eris, counts, fitted, grids, guesses)]  # fmt: skip
    return [_prepare_one(molecule, mol, ints, method, bucket, dict(timings))
            for molecule, mol, ints in zip(molecules, mols, integrals)]


def _prepare_one(molecule: Molecule, mol: gto.Mole, ints: _Integrals, method: Method, bucket: SizeBucket,
                 timings: dict[str, float]) -> PreparedProblem:  # fmt: skip
    """The rest of one conformer's preparation, from its integrals ``ints``: orthogonaliser,
    screening (which counts the non-zero ERIs again), grid. A grid from the JAX integral source
    leaves the AO values to the device (``ao`` None); without one, PySCF builds the grid and
    evaluates the AO values here."""
    config = method.config
    t = time.perf_counter()
    x = orthogonaliser(ints.overlap)
    timings["one_electron"] += time.perf_counter() - t

    t = time.perf_counter()
    nao = mol.nao_nr()
    eri, nonzero = ints.eri, ints.nonzero
    if config.eri_threshold > 0:  # screening zeroes more: count what is left
        n = s8_aos(eri.shape[0])  # the molecule's AOs (libcint) or its bucket's (device)
        eri = schwarz_screen(eri, n * (n + 1) // 2, config.eri_threshold)
        nonzero = int(np.count_nonzero(eri))
    timings["eri"] += time.perf_counter() - t

    t = time.perf_counter()
    if ints.grid is not None:
        (coords, weights, owners), ao = ints.grid, None
    elif method.needs_grid:
        grids = dft.gen_grid.Grids(mol)
        grids.level = config.grid_level
        grids.build(with_non0tab=False, sort_grids=False)
        coords, weights, owners = grids.coords, grids.weights, np.maximum(grids.atm_idx, 0)  # padding: -1
        timings["grid"] = time.perf_counter() - t
        t = time.perf_counter()
        ao = dft.numint.eval_ao(mol, coords, deriv=1)  # (4, G, N)
        timings["ao_values"] = time.perf_counter() - t
    else:
        coords, weights, owners, ao = np.zeros((0, 3)), np.zeros(0), np.zeros(0, int), np.zeros((4, 0, nao))

    return PreparedProblem(
        molecule=molecule,
        mol=mol,
        nocc=molecule.nelectron // 2,
        overlap=ints.overlap,
        hcore=ints.hcore,
        eri_s8=eri,
        eri_kept=nonzero,
        eri_fitted=ints.fitted,
        orthogonaliser=x,
        density_guess=ints.guess,
        grid_coords=np.asarray(coords),
        grid_weights=np.asarray(weights),
        grid_owners=np.asarray(owners),
        ao=None if ao is None else np.asarray(ao),
        nuclear_repulsion=float(mol.energy_nuc()),
        timings=timings,
        bucket=bucket,
    )
