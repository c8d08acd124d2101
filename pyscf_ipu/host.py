"""Host-side preparation through PySCF (libcint), in float64.

Everything the SCF loop needs that is not the loop itself: the basis, one-electron integrals, the
8-fold-symmetric ERI with optional Schwarz screening, the Becke grid with AO values and gradients on
it, the MINAO initial guess and an orthogonaliser of the overlap matrix. Parsed basis sets are
cached per (basis, element): PySCF reads and parses the basis file on every molecule otherwise,
which cost more than the one-electron integrals themselves (and 40 ms per molecule for MINAO's ANO
basis). The result is a :class:`HostProblem` of plain float64 numpy arrays at the molecule's true
sizes; padding to shared shapes and the cast to the device precision happen later
(:mod:`pyscf_ipu.problem`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from pyscf import dft, gto, lib, scf
from pyscf.lib.exceptions import BasisNotFoundError
from pyscf.scf import addons, atom_hf

from .buckets import SizeBucket, pad_atoms
from .config import RKSConfig, precision_scope
from .packed import s8_aos
from .integrals.ao_values import AOTables, ao_tables
from .molecule import Molecule, MoleculeError
from .programs import compiled

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
    eri_s8: np.ndarray  # (N(N+1)/2 * (N(N+1)/2 + 1) / 2,)  screened, PySCF's s8 packing; float64 from
    # libcint, or in the run's precision from the device integrals (then read-only)
    eri_kept: int  # non-zero unique integrals after screening
    orthogonaliser: np.ndarray  # (N, M)  X with X^T S X = 1, M <= N
    density_guess: np.ndarray  # (N, N)  MINAO
    grid_coords: np.ndarray  # (G, 3) Bohr
    grid_weights: np.ndarray  # (G,)
    grid_owners: np.ndarray  # (G,) int: the atom whose grid each point belongs to
    ao: np.ndarray | None  # (4, G, N)  values and x/y/z derivatives; None: evaluated on the device (ao_tables)
    nuclear_repulsion: float
    timings: dict[str, float]
    bucket: SizeBucket | None = None  # the size bucket whose shapes the problem is padded to
    ao_tables: AOTables | None = field(default=None, repr=False)  # the basis, for the device's AO values

    @property
    def nao(self) -> int:
        return self.overlap.shape[0]

    @property
    def eri_nao(self) -> int:
        """The AOs of ``eri_s8``: the molecule's (libcint), or its bucket's (the device integrals write
        the bucket's s8 array, of which the molecule's is the leading part; the rest is zero)."""
        return s8_aos(self.eri_s8.shape[0])

    @property
    def grid_points(self) -> int:
        return self.grid_weights.shape[0]

    @property
    def eri_unique(self) -> int:
        return self.eri_s8.shape[0]


@lru_cache(maxsize=None)
def element_basis(basis: str, symbol: str) -> list:
    """PySCF's parsed ``basis`` for one element (cached; treat as read-only). Raises as ``gto.basis.load``."""
    with warnings.catch_warnings():  # PySCF suggests basis-set-exchange on every miss
        warnings.simplefilter("ignore", UserWarning)
        return gto.basis.load(basis, symbol)


def build_mole(molecule: Molecule, basis: str) -> gto.Mole:
    """A PySCF ``Mole`` for ``molecule`` in ``basis``; an unknown basis or a missing element is a MoleculeError."""
    shells, missing = {}, []
    for symbol in sorted(set(molecule.symbols)):
        try:
            shells[symbol] = element_basis(basis, symbol)
        except (BasisNotFoundError, KeyError, OSError, RuntimeError):
            missing.append(symbol)
    if missing and _basis_unknown(basis):
        raise MoleculeError(f"unknown basis {basis!r}: use a basis PySCF knows, such as sto-3g, 6-31g or def2-svp")
    if missing:
        raise MoleculeError(f"element(s) {', '.join(missing)} not in basis {basis!r}: choose another basis")
    return gto.M(
        atom=molecule.pyscf_atom(),
        unit="Bohr",
        basis=shells,
        charge=molecule.charge,
        spin=molecule.spin,
        verbose=0,
    )


def _basis_unknown(basis: str) -> bool:
    """True if PySCF has no basis of this name at all (judged by hydrogen and carbon)."""
    for symbol in ("H", "C"):
        try:
            element_basis(basis, symbol)
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


def eri_s8(mol: gto.Mole, expcutoff: float = 0.0) -> np.ndarray:
    """The 8-fold-symmetric ERI from libcint, with its primitive screening at ``expcutoff``.

    libcint skips a primitive product (and so a primitive quartet) whose Gaussian prefactor bound,
    times the contraction coefficients, is below exp(-expcutoff); 0 keeps its default of 60.
    Measured on QM9 molecules (21989, 24320, 53938; STO-3G and 6-31G*): at 30 the ERIs take 20% less
    time, single integrals change by at most 3e-8 Ha, and converged float64 B3LYP energies by at
    most 0.0005 meV, HOMO and LUMO by at most 0.0001 meV (the label tolerance is 2 meV). ``mol``
    itself is left unchanged.
    """
    env = mol._env.copy()
    env[gto.PTR_EXPCUTOFF] = expcutoff
    return gto.getints("int2e_sph" if not mol.cart else "int2e_cart", mol._atm, mol._bas, env, aosym="s8")


def device_one_electron(mols: list[gto.Mole], bucket: SizeBucket) -> list[tuple[np.ndarray, np.ndarray]]:
    """(overlap, core Hamiltonian) of each conformer in ``mols`` (molecules of ``bucket``), as float64
    host arrays at the molecules' sizes, from :mod:`pyscf_ipu.integrals` in one call.

    Computed in float64 whatever the SCF's precision: in float32 their errors are systematic (the core
    Hamiltonian's energy came out 0.5-2.1 meV low on 9-heavy-atom molecules, measured against
    libcint's), and the labels' energy is first order in them; they are a small part of the work.
    """
    from .integrals.one_electron import one_electron

    bases = [primitive_template(bucket.basis, tuple(mol.elements)) for mol in mols]
    capacity = primitive_template(bucket.basis, bucket.template_elements)
    with precision_scope("float64"):
        ints = one_electron(bases, np.dtype("float64"), _conformer_coords(mols, bucket), capacity)
        overlap, hcore = np.asarray(ints["overlap"]), np.asarray(ints["kinetic"]) + np.asarray(ints["nuclear"])
    return [(overlap[k, : mol.nao, : mol.nao], hcore[k, : mol.nao, : mol.nao]) for k, mol in enumerate(mols)]


def device_eri_s8(mols: list[gto.Mole], bucket: SizeBucket, precision: str) -> tuple[list[np.ndarray], list[int]]:
    """(s8 ERIs, their non-zero counts) of each conformer in ``mols`` (molecules of ``bucket``) from
    :mod:`pyscf_ipu.integrals.eri`, computed in ``precision`` as one batch and kept in it: each the
    bucket's s8 array (the molecule's is its leading part, the rest zero), a read-only numpy view of
    the device's buffer (no copy on a CPU), which the J-K layout stacks as it is. The finalisation
    contracts these on the device. The counts are taken on the device too (numpy's
    ``count_nonzero`` of a float32 array took 1.9 ms per 9-heavy-atom conformer)."""
    from .integrals.eri import eri_s8 as device_eris

    plans = [eri_plan(bucket.basis, tuple(mol.elements), bucket) for mol in mols]
    with precision_scope(precision):
        eris = device_eris(plans, _conformer_coords(mols, bucket), precision)
        counts = np.asarray(_count_nonzero(eris))
        eris = np.asarray(eris)
    return list(eris), [int(c) for c in counts]


@compiled
def _count_nonzero(eris: jax.Array) -> jax.Array:
    """(C,) non-zero entries of each s8 array, int32 (an s8 array has fewer than 2^31 entries)."""
    return jnp.count_nonzero(eris, axis=-1)


def _conformer_coords(mols: list[gto.Mole], bucket: SizeBucket) -> np.ndarray:
    """(C, natm, 3) Bohr: the conformers' positions, padded to the bucket's atoms with dummies."""
    return np.stack([pad_atoms(mol.atom_coords(), bucket.natm) for mol in mols])


@lru_cache(maxsize=64)
def eri_plan(basis: str, elements: tuple[str, ...], bucket: SizeBucket | None = None):
    """The ERI plan of ``basis`` on these atoms in this order, in the shapes of ``bucket`` (default:
    its own bucketed counts); it does not depend on the geometry."""
    from .integrals.eri_plan import plan_eri

    return plan_eri(_placeholder_mole(basis, elements), None if bucket is None else eri_capacity(bucket))


@lru_cache(maxsize=16)
def eri_capacity(bucket: SizeBucket):
    """The ERI shapes of ``bucket`` (:func:`~.integrals.eri.eri_capacity` of its template molecule)."""
    from .integrals.eri_plan import eri_capacity as capacity

    return capacity(_placeholder_mole(bucket.basis, bucket.template_elements))


@lru_cache(maxsize=64)
def primitive_template(basis: str, elements: tuple[str, ...]):
    """The :class:`~.integrals.basis.PrimitiveBasis` of ``basis`` on these atoms, at placeholder
    positions: everything in it but ``coords`` is geometry independent (its one-centre integrals
    from libcint took a third of the device one-electron time, recomputed per conformer)."""
    from .integrals.basis import primitive_basis

    return primitive_basis(_placeholder_mole(basis, elements))


@lru_cache(maxsize=64)
def ao_template(basis: str, elements: tuple[str, ...]) -> AOTables:
    """The :class:`~.integrals.ao_values.AOTables` of ``basis`` on these atoms (geometry independent)."""
    return ao_tables(primitive_template(basis, elements))


@lru_cache(maxsize=64)
def _atom_grids(elements: tuple[str, ...], bucket: SizeBucket):
    """The atoms' grids of a molecule (geometry independent), padded to its bucket's points and
    atoms (zero-volume points, dummy atoms), and the molecule's own point count."""
    from .grid import atom_grids, pad_grids

    grids = atom_grids(_placeholder_mole(bucket.basis, elements), bucket.grid_level)
    return pad_grids(grids, bucket.grid_points, bucket.natm), len(grids.volumes)


def device_grids(mols: list[gto.Mole], bucket: SizeBucket) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(points (G, 3), weights (G,), owners (G,)) of each conformer in ``mols`` (molecules of
    ``bucket``), in float64, from one device program: the points and weights of PySCF's grid at the
    bucket's level without its zero-weight alignment padding (equal to PySCF's to 1e-12; host Becke
    partitioning took 10 ms per 9-heavy-atom conformer)."""
    from .grid import grid_points_and_weights_batch

    grids = [_atom_grids(tuple(mol.elements), bucket) for mol in mols]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *[g for g, _ in grids])
    with jax.enable_x64(True):
        points, weights = grid_points_and_weights_batch(stacked, jax.device_put(_conformer_coords(mols, bucket)))
        points, weights = np.asarray(points), np.asarray(weights)
    return [(points[k, :count], weights[k, :count], g.owner[:count]) for k, (g, count) in enumerate(grids)]


def _placeholder_mole(basis: str, elements: tuple[str, ...]) -> gto.Mole:
    """A Mole of ``elements`` in ``basis``, the atoms 3 Bohr apart on a line (geometry-independent uses)."""
    atoms = [(e, (0.0, 0.0, 3.0 * k)) for k, e in enumerate(elements)]
    shells = {e: element_basis(basis, e) for e in set(elements)}
    electrons = sum(gto.charge(e) for e in elements)
    return gto.M(atom=atoms, unit="Bohr", basis=shells, spin=electrons % 2, verbose=0)


class IntegralSource(Protocol):
    """Where a batch's integrals and grid come from: one object per source, chosen by name
    (``RKSConfig.integrals``, :func:`integral_source`). Every method takes the conformers of one
    size bucket as PySCF ``Mole`` objects."""

    name: str

    def one_electron(self, mols: list[gto.Mole], bucket: SizeBucket) -> list[tuple[np.ndarray, np.ndarray]]:
        """(overlap, core Hamiltonian) of each conformer, float64 at the molecule's size."""

    def eris(self, mols: list[gto.Mole], bucket: SizeBucket,
             config: RKSConfig) -> tuple[list[np.ndarray], list[int | None]]:  # fmt: skip
        """The s8 ERIs of each conformer and their non-zero counts (None where not counted)."""

    def grids(self, mols: list[gto.Mole], bucket: SizeBucket) -> list[tuple | None]:
        """Each conformer's (points, weights, owners), whose AO values the device then evaluates;
        None: PySCF builds the grid and evaluates the AO values on the host."""

    def final_jk(self, backend, jk: dict) -> tuple:
        """The float64 finalisation's J and K on the device: (the loop's J-K backend, its arrays),
        or () for libcint's contraction of the host's float64 s8 ERIs."""

    def eri_plan(self, basis: str, elements: tuple[str, ...]):
        """The ERI plan that spreads the integrals over tiles (for the IPU profile), or None."""


@dataclass(frozen=True)
class LibcintIntegrals:
    """libcint through PySCF, in float64 on the host: the reference. A float32 loop holds these
    integrals rounded, so the finalisation contracts the host's float64 ERIs instead."""

    name: str = "host"

    def one_electron(self, mols, bucket):
        return [(mol.intor("int1e_ovlp"), mol.intor("int1e_kin") + mol.intor("int1e_nuc")) for mol in mols]

    def eris(self, mols, bucket, config):
        return [eri_s8(mol, config.eri_expcutoff) for mol in mols], [None] * len(mols)

    def grids(self, mols, bucket):
        return [None] * len(mols)

    def final_jk(self, backend, jk):
        return ()

    def eri_plan(self, basis, elements):
        return None


@dataclass(frozen=True)
class JaxIntegrals:
    """The JAX kernels of :mod:`pyscf_ipu.integrals`, one program per stage for a whole batch: the
    one-electron integrals in float64, the ERIs in the SCF's precision, the grid and (later) the AO
    values. The loop's J-K arrays then hold the very integrals the host would use, so the device
    contracts them for the finalisation too (in float64)."""

    name: str = "device"

    def one_electron(self, mols, bucket):
        return device_one_electron(mols, bucket)

    def eris(self, mols, bucket, config):
        return device_eri_s8(mols, bucket, config.precision)

    def grids(self, mols, bucket):
        return device_grids(mols, bucket)

    def final_jk(self, backend, jk):
        return backend, jk

    def eri_plan(self, basis, elements):
        return eri_plan(basis, tuple(elements))


INTEGRAL_SOURCES: dict[str, IntegralSource] = {source.name: source for source in (LibcintIntegrals(), JaxIntegrals())}


def integral_source(name: str) -> IntegralSource:
    """The integral source registered under ``name`` (``RKSConfig.integrals``)."""
    try:
        return INTEGRAL_SOURCES[name]
    except KeyError:
        raise ValueError(f"unknown integral source {name!r}: choose one of {', '.join(INTEGRAL_SOURCES)}") from None


def orthogonaliser(overlap: np.ndarray) -> np.ndarray:
    """Canonical orthogonalisation X = U s^-1/2 over eigenvalues s of S above the lindep threshold."""
    s, u = np.linalg.eigh(overlap)
    keep = s > LINEAR_DEPENDENCE_THRESHOLD
    return u[:, keep] / np.sqrt(s[keep])


def prepare(molecule: Molecule, config: RKSConfig, needs_grid: bool = True) -> HostProblem:
    """Run PySCF's float64 preparation for ``molecule`` under ``config``.

    The grid has exactly the points and weights of PySCF's RKS grid at level ``grid_level`` (PySCF
    2.14 prunes nothing by default: ``small_rho_cutoff = 0``), so our results and PySCF's refer to
    the same quadrature; only PySCF's spatial sort of the points, which serves its CPU blocking and
    cost 13 ms per 9-heavy-atom molecule, is skipped. ``needs_grid=False`` (Hartree-Fock) skips it.
    """
    return prepare_conformers([molecule], config, needs_grid)[0]


def prepare_conformers(molecules: list[Molecule], config: RKSConfig, needs_grid: bool = True) -> list[HostProblem]:
    """:func:`prepare` for a batch: conformers of molecules of one size bucket (:class:`SizeBucket`).

    The one-electron integrals, the ERIs and the grids come from the run's :class:`IntegralSource`,
    each in one call for the whole batch (the JAX source runs one program per batch and bucket); the
    timings share that time out equally.
    """
    mols = [build_mole(molecule, config.basis) for molecule in molecules]  # checks the elements and basis
    bucket = SizeBucket.of(molecules[0], config.basis, config.grid_level)
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

    source = integral_source(config.integrals)
    t = time.perf_counter()
    one_electron = source.one_electron(mols, bucket)
    one_electron_seconds = (time.perf_counter() - t) / len(mols)

    t = time.perf_counter()
    eris, counts = source.eris(mols, bucket, config)
    eri_seconds = (time.perf_counter() - t) / len(mols)

    t = time.perf_counter()
    grids = source.grids(mols, bucket) if needs_grid else [None] * len(mols)
    grid_seconds = (time.perf_counter() - t) / len(mols)
    timings = {"one_electron": one_electron_seconds, "eri": eri_seconds, "grid": grid_seconds, "guess": guess_seconds}
    return [_prepare_one(molecule, mol, *ints, eri, count, grid, guess, config, needs_grid, bucket, dict(timings))
            for molecule, mol, ints, eri, count, grid, guess
            in zip(molecules, mols, one_electron, eris, counts, grids, guesses)]  # fmt: skip


def _prepare_one(molecule: Molecule, mol: gto.Mole, overlap: np.ndarray, hcore: np.ndarray, eri: np.ndarray,
                 nonzero: int | None, grid: tuple | None, dm0: np.ndarray, config: RKSConfig, needs_grid: bool,
                 bucket: SizeBucket, timings: dict[str, float]) -> HostProblem:  # fmt: skip
    """The rest of one conformer's preparation, from its integrals and its initial density ``dm0``:
    orthogonaliser, screening, grid. ``nonzero`` counts the non-zero entries of ``eri`` where they
    are known (None: counted here). ``grid`` (points, weights, owners) from :func:`device_grids`
    leaves the AO values to the device (``ao`` None); without it, PySCF builds the grid and
    evaluates the AO values here."""
    t = time.perf_counter()
    x = orthogonaliser(overlap)
    timings["one_electron"] += time.perf_counter() - t

    t = time.perf_counter()
    nao = mol.nao_nr()
    if config.eri_threshold > 0 or nonzero is None:  # screening zeroes more: count what is left
        n = s8_aos(eri.shape[0])  # the molecule's AOs (libcint) or its bucket's (device)
        eri = schwarz_screen(eri, n * (n + 1) // 2, config.eri_threshold)
        nonzero = int(np.count_nonzero(eri))
    timings["eri"] += time.perf_counter() - t

    t = time.perf_counter()
    tables = None
    if grid is not None:
        (coords, weights, owners), ao = grid, None
        tables = ao_template(config.basis, tuple(mol.elements))
    elif needs_grid:
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

    return HostProblem(
        molecule=molecule,
        mol=mol,
        nocc=molecule.nelectron // 2,
        overlap=overlap,
        hcore=hcore,
        eri_s8=eri,
        eri_kept=nonzero,
        orthogonaliser=x,
        density_guess=dm0,
        grid_coords=np.asarray(coords),
        grid_weights=np.asarray(weights),
        grid_owners=np.asarray(owners),
        ao=None if ao is None else np.asarray(ao),
        nuclear_repulsion=float(mol.energy_nuc()),
        timings=timings,
        bucket=bucket,
        ao_tables=tables,
    )
