"""The host preparation of conformers for the SCF loop: PySCF (libcint) in float64, at each
molecule's own sizes: the reference integral source.

Everything the loop needs that is not the loop itself: the one-electron integrals, the
8-fold-symmetric ERI with optional Schwarz screening (or the density-fitted factor), the Becke grid
and the AO values on it, the superposition-of-atoms guess and an orthogonaliser of the overlap
matrix; one :class:`PreparedProblem` per conformer, of plain numpy arrays. Padding to shared shapes
and the cast to the loop's precision happen later (:mod:`pyscf_ipu.integral_sources`,
:mod:`pyscf_ipu.problem`). The JAX integral source assembles the same on the device instead
(:mod:`pyscf_ipu.assembly`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from pyscf import dft, gto

from .buckets import SizeBucket, auxiliary_basis
from .molecule import Molecule
from .packed import PackedERI
from .programs import usable_cores
from .pyscf_mole import build_mole
from .templates import atomic_guess

if TYPE_CHECKING:
    from .method import Method

# Eigenvalues of S below this are treated as linear dependence and projected out (PySCF's lindep).
LINEAR_DEPENDENCE_THRESHOLD = 1e-8


@dataclass(frozen=True, eq=False)
class PreparedProblem:
    """One conformer's inputs to the SCF loop as prepared on the host: numpy arrays in float64 at the
    molecule's own sizes (N AOs, G grid points)."""

    molecule: Molecule
    mol: gto.Mole = field(repr=False)
    nocc: int
    overlap: np.ndarray  # (N, N)
    hcore: np.ndarray  # (N, N)  T + V
    eri_s8: np.ndarray  # (N(N+1)/2 * (N(N+1)/2 + 1) / 2,)  screened, PySCF's s8 packing
    eri_kept: int  # non-zero unique integrals after screening
    eri_fitted: np.ndarray  # (naux, N(N+1)/2): the density-fitted ERIs (:func:`fitted_eri`) where the J-K
    # backend is density fitted; then eri_s8 is empty, else this is (0, 0)
    orthogonaliser: np.ndarray  # (N, M)  X with X^T S X = 1, M <= N
    density_guess: np.ndarray  # (N, N)  the superposition of atomic densities
    grid_coords: np.ndarray  # (G, 3) Bohr
    grid_weights: np.ndarray  # (G,)
    grid_owners: np.ndarray  # (G,) int: the atom whose grid each point belongs to
    ao: np.ndarray  # (4, G, N)  values and x/y/z derivatives
    nuclear_repulsion: float
    timings: dict[str, float]
    bucket: SizeBucket  # the size bucket whose shapes the problem is padded to

    @property
    def nao(self) -> int:
        return self.overlap.shape[0]

    @property
    def grid_points(self) -> int:
        return self.grid_weights.shape[0]

    @property
    def eri(self) -> PackedERI:
        """The molecule's ERIs as the J-K backends' profiles take them."""
        return PackedERI(self.eri_s8, self.nao, self.eri_kept)


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


def screened(mol: gto.Mole, expcutoff: float) -> gto.Mole:
    """A copy of ``mol`` whose libcint integrals use primitive screening at ``expcutoff``.

    libcint skips a primitive product (and so a primitive quartet or triple) whose Gaussian prefactor
    bound, times the contraction coefficients, is below exp(-expcutoff); 0 keeps its default of 60.
    The default of 30 changes no label measurably (``docs/decisions/libcint-expcutoff.md``).
    """
    copy = mol.copy()
    copy._env[gto.PTR_EXPCUTOFF] = expcutoff
    return copy


def eri_s8(mol: gto.Mole, expcutoff: float = 0.0) -> np.ndarray:
    """The 8-fold-symmetric ERI from libcint, with its primitive screening at ``expcutoff``
    (:func:`screened`). ``mol`` itself is left unchanged."""
    return screened(mol, expcutoff).intor("int2e", aosym="s8")


def fitting_moles(mol: gto.Mole, basis: str, expcutoff: float = 0.0, omega: float = 0.0) -> tuple[gto.Mole, gto.Mole]:
    """(orbitals, fitting functions): copies of ``mol`` with libcint's primitive screening at ``expcutoff``
    (:func:`screened`), and the fitting basis of :func:`~pyscf_ipu.buckets.auxiliary_basis` (PySCF's
    default for ``basis``) on its atoms; both of the operator erf(ω r)/r where ``omega`` > 0, as PySCF's
    ``DF.range_coulomb`` sets them (the 3-centre integrals read ω from the first, the metric from the
    second). ``mol`` itself is left unchanged."""
    from pyscf import df

    orbitals = screened(mol, expcutoff)
    auxmol = df.addons.make_auxmol(mol, {symbol: auxiliary_basis(basis, symbol) for symbol in set(mol.elements)})
    orbitals.omega = auxmol.omega = omega
    return orbitals, auxmol


def fitted_eri(mol: gto.Mole, basis: str, expcutoff: float = 0.0, out: np.ndarray | None = None,
               omega: float = 0.0) -> np.ndarray:  # fmt: skip
    """(naux, npair) float64: the density-fitted ERIs as a Cholesky factor B with
    (ij|kl) ~ sum_Q B[Q, ij] B[Q, kl], over pairs i >= j in PySCF's packing, in the fitting basis of
    :func:`~pyscf_ipu.buckets.auxiliary_basis` (PySCF's default for ``basis``): B = L^-1 (Q|ij) with
    L the Cholesky factor of the metric (P|Q), as ``df.incore.cholesky_eri`` makes it.

    The 3-centre integrals come from libcint in one call, with its primitive screening at
    ``expcutoff`` (:func:`screened`), and are solved in place, with BLAS on every
    core this process may use (the rest of the run keeps one BLAS thread): one thread would leave
    the others idle through the solve. With ``out``, a C-contiguous float64 array of npair columns and
    at least naux rows (a caller's padded buffer), the factor is made in its leading rows, which are
    returned, and no copy is needed; its other rows are left as they are. A metric that is not
    positive definite goes to PySCF's function, which drops its near-null directions (fewer rows).
    ``omega`` > 0 fits the long-range operator erf(ω r)/r instead, its metric and 3-centre integrals
    both attenuated (as PySCF's ``DF.range_coulomb``); that metric is often only semi-definite, and so
    takes PySCF's function. ``mol`` itself is left unchanged.
    """
    import scipy.linalg
    from pyscf import df
    from threadpoolctl import threadpool_limits

    orbitals, auxmol = fitting_moles(mol, basis, expcutoff, omega)
    try:
        metric = scipy.linalg.cholesky(auxmol.intor("int2c2e", hermi=1), lower=True)  # (naux, naux) L
    except scipy.linalg.LinAlgError:
        factor = df.incore.cholesky_eri(orbitals, auxmol=auxmol)
        if out is None:
            return factor
        out[: len(factor)] = factor
        return out[: len(factor)]
    # (npair, naux) in Fortran order: the memory of ``out``'s leading naux rows
    ints = df.incore.aux_e2(orbitals, auxmol, "int3c2e", aosym="s2ij", out=out)
    trsm = scipy.linalg.get_blas_funcs("trsm", (metric, ints))
    with threadpool_limits(usable_cores(), user_api="blas"):
        # X L^T = (ij|Q): X = B^T, written over the integrals
        factor_t = trsm(1.0, metric, ints, side=1, lower=True, trans_a=1, overwrite_b=True)
    return factor_t.T


def prepare(molecules: list[Molecule], method: Method) -> list[PreparedProblem]:
    """PySCF's float64 preparation of ``molecules`` under ``method``: conformers of molecules of one
    size bucket (:class:`SizeBucket`), a batch; a functional without a grid part (Hartree-Fock) gets
    no grid.

    The grid has exactly the points and weights of PySCF's RKS grid at ``grid_level`` (PySCF 2.14
    prunes nothing by default), so our results and PySCF's refer to the same quadrature; only PySCF's
    spatial sort of the points is skipped. The timings are each conformer's own host seconds.
    """
    config = method.config
    mols = [build_mole(molecule, config.basis) for molecule in molecules]  # checks the elements and basis
    bucket = method.same_bucket(molecules)
    return [_prepare_one(molecule, mol, method, bucket) for molecule, mol in zip(molecules, mols)]


def _prepare_one(molecule: Molecule, mol: gto.Mole, method: Method, bucket: SizeBucket) -> PreparedProblem:
    """One conformer's preparation: integrals, guess, orthogonaliser, screening, grid and AO values."""
    config, timings = method.config, {}
    t = time.perf_counter()
    guess = atomic_guess(config.basis, mol.elements)
    timings["guess"] = time.perf_counter() - t

    t = time.perf_counter()
    overlap, hcore = mol.intor("int1e_ovlp"), mol.intor("int1e_kin") + mol.intor("int1e_nuc")
    x = orthogonaliser(overlap)
    timings["one_electron"] = time.perf_counter() - t

    t = time.perf_counter()
    nao = mol.nao_nr()
    eri, nonzero, fitted = method.backend.host_eris(mol, bucket, config)  # s8 ERIs or the fitted factor
    timings["eri"] = time.perf_counter() - t

    if method.needs_grid:
        t = time.perf_counter()
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
        overlap=overlap,
        hcore=hcore,
        eri_s8=eri,
        eri_kept=nonzero,
        eri_fitted=fitted,
        orthogonaliser=x,
        density_guess=guess,
        grid_coords=np.asarray(coords),
        grid_weights=np.asarray(weights),
        grid_owners=np.asarray(owners),
        ao=np.asarray(ao),
        nuclear_repulsion=float(mol.energy_nuc()),
        timings=timings,
        bucket=bucket,
    )
