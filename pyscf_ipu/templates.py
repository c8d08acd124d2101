"""Bucket templates: what every molecule of a size bucket shares, and the element tables its atoms
gather their values from.

A bucket's **slots** are the atoms of its template molecule (``SizeBucket.template_elements``):
``capacity`` atoms of each kind, kind after kind. A molecule of the bucket puts its atoms of each kind
in that kind's first slots (``SizeBucket.place``); the other slots are **absent**: no functions, no
charge, no grid. Since the elements of a kind share their shells
(:func:`~pyscf_ipu.buckets.element_kind`), every array whose rows belong to atoms has one layout for
the whole bucket: the primitives, the Cartesian AOs, the ERI shells and one-centre integrals, the grid
points, the AO blocks of the one-centre one-electron integrals and of the guess. Only the values
depend on which element fills a slot, and those come from **element tables**: one row per element of
the bucket's kinds (row 0: an absent slot), computed once per (basis, element) from a one-atom
molecule (:func:`element_data`). A :class:`SlotRows` gathers a template array's values from a table.

So to the device a batch of conformers is their positions and each slot's element row: the
integrals, the grid and its AO values and the initial guess are assembled there
(:mod:`pyscf_ipu.assembly`), and nothing per molecule or conformer is left to the host. The
template's AOs are in slot order: a molecule's own AOs are a selection of them (:meth:`BucketTemplate.aos`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import jax
import numpy as np
from pyscf import gto, scf
from pyscf.dft import radi

from .buckets import SizeBucket, element_aos, kind_grid_size, auxiliary_layout, auxiliary_mole
from .grid import atom_grids
from .integrals.ao_values import AOTables, ao_tables
from .integrals.basis import MAX_FITTING_L, PrimitiveBasis, contracted_shells, primitive_basis
from .integrals.eri import SHARED_ERI_MOST, shared_eri_aos
from .integrals.eri_plan import EriPlan, eri_capacity, one_centre_eris, plan_eri, shells_of
from .packed import s8_size
from .pyscf_mole import placeholder_mole


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SlotRows:
    """The rows of a template array that belong to atoms: each row's slot and its place among its
    atom's rows (a column of the element tables)."""

    slot: np.ndarray  # (R,) int32
    local: np.ndarray  # (R,) int32

    @classmethod
    def of(cls, atoms: np.ndarray) -> SlotRows:
        """The rows of an array whose rows are grouped by atom, ``atoms`` (R,) giving each row's."""
        atoms = np.asarray(atoms)
        starts = np.flatnonzero(np.r_[True, atoms[1:] != atoms[:-1]]) if len(atoms) else np.zeros(0, int)
        if len(set(atoms[starts].tolist())) != len(starts):
            raise ValueError("a template array's rows must be grouped by atom")
        first = starts[np.searchsorted(starts, np.arange(len(atoms)), side="right") - 1]  # each row's group's first
        return cls(atoms.astype(np.int32), (np.arange(len(atoms)) - first).astype(np.int32))

    def gather(self, table, elements):
        """The rows' values: ``table`` (E, L, ...) read at (each row's slot's element, its place);
        ``elements`` (natm,) the element row of each slot. Traced or numpy alike."""
        return table[elements[self.slot], self.local]


@dataclass(frozen=True, eq=False)
class ElementData:
    """One element's values in one basis, as one atom's rows of the template arrays (float64)."""

    charge: float
    primitive_exponents: np.ndarray  # (P_e,)
    primitive_coefficients: np.ndarray  # (P_e,)  each primitive's coefficient in its Cartesian AO
    one_electron: np.ndarray  # (3, n, n)  overlap, kinetic energy, attraction to its own nucleus
    cartesian_exponents: np.ndarray  # (Nc_e, K)
    cartesian_coefficients: np.ndarray  # (Nc_e, K)
    shell_exponents: np.ndarray  # (S_e, K)
    shell_coefficients: np.ndarray  # (S_e, C, K)
    one_centre_eris: np.ndarray  # (M_e,)  in the order of :func:`~.integrals.eri_plan.one_centre_eris`
    guess: np.ndarray  # (n, n)  the spherically averaged atomic HF density (PySCF's "atom" guess)


@dataclass(frozen=True, eq=False)
class FittingData:
    """One element's density-fitting shells (:func:`~pyscf_ipu.buckets.auxiliary_shells` order)."""

    l: np.ndarray  # (F_e,)
    exponents: np.ndarray  # (F_e, K)  padded with 1
    coefficients: np.ndarray  # (F_e, K)  radially normalised, without libcint's angular factor; padded with 0


@lru_cache(maxsize=None)
def element_data(basis: str, symbol: str) -> ElementData:
    """:class:`ElementData` of ``symbol`` in ``basis``, from a one-atom molecule (cached)."""
    mol = placeholder_mole(basis, (symbol,))
    primitives = primitive_basis(mol)
    columns = np.argmax(primitives.contraction != 0, axis=1)
    cartesian = ao_tables(primitives)
    shells = shells_of(mol)
    return ElementData(
        charge=float(gto.charge(symbol)),
        primitive_exponents=primitives.exponents,
        primitive_coefficients=primitives.contraction[np.arange(len(columns)), columns],
        one_electron=primitives.one_centre,
        cartesian_exponents=cartesian.exponents,
        cartesian_coefficients=cartesian.coefficients,
        shell_exponents=shells.exponents,
        shell_coefficients=shells.coefficients,
        one_centre_eris=one_centre_eris(mol)[1],
        guess=np.asarray(scf.hf.init_guess_by_atom(mol)),
    )


@lru_cache(maxsize=None)
def long_range_one_centre(basis: str, symbol: str, omega: float) -> np.ndarray:
    """(M_e,) ``symbol``'s one-centre ERIs of the long-range erf(ω r)/r in ``basis``, in the order of
    its :attr:`ElementData.one_centre_eris` (cached)."""
    return one_centre_eris(placeholder_mole(basis, (symbol,)), omega)[1]


def long_range_one_centre_table(template: BucketTemplate, omega: float) -> np.ndarray:
    """(E, Lo): the bucket's elements' long-range one-centre ERIs (:func:`long_range_one_centre`), as
    its element tables hold the Coulomb ones (row 0: absent slots, zeros)."""
    basis = template.bucket.basis
    rows = [None] + [long_range_one_centre(basis, s, omega) for s in template.bucket.elements[1:]]
    return _stacked(rows, (_width(template.one_centre_rows),), 0.0)


@lru_cache(maxsize=None)
def fitting_data(basis: str, symbol: str) -> FittingData:
    """:class:`FittingData` of ``symbol``'s fitting functions for the orbital ``basis`` (cached)."""
    mol = auxiliary_mole(basis, symbol)
    shells = [(l, exps, row) for _, l, _, exps, coeff in contracted_shells(mol, MAX_FITTING_L) for row in coeff]
    shells.sort(key=lambda shell: (shell[0], -len(shell[1])))  # as auxiliary_shells orders them
    k = max(len(exps) for _, exps, _ in shells)
    return FittingData(
        l=np.array([l for l, _, _ in shells]),
        exponents=np.stack([np.pad(exps, (0, k - len(exps)), constant_values=1.0) for _, exps, _ in shells]),
        coefficients=np.stack([np.pad(row, (0, k - len(row))) for _, _, row in shells]),
    )


@lru_cache(maxsize=None)
def element_grid(symbol: str, level: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets (G_e, 3), volumes (G_e,)): PySCF's atomic grid of ``symbol`` at ``level`` about its nucleus."""
    grids = atom_grids(placeholder_mole("sto-3g", (symbol,)), level)
    return grids.offsets, grids.volumes


def atomic_guess(basis: str, symbols) -> np.ndarray:
    """(N, N): the block-diagonal superposition of the atoms' spherically averaged HF densities in
    ``basis`` (PySCF's ``init_guess_by_atom``), for atoms ``symbols`` in order."""
    import scipy.linalg

    return scipy.linalg.block_diag(*(element_data(basis, symbol).guess for symbol in symbols))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ElementTables:
    """A bucket's element tables: row 0 an absent slot, then one row per element of its kinds, each
    (E, L, ...) with L the most rows any of its kinds has per atom. An element the run has not met
    yet keeps the absent row's values (no batch reads it). Exponents of absent rows and padding are
    1, so that nothing divides by zero; every other value there is 0."""

    charges: np.ndarray  # (E,)
    primitive_exponents: np.ndarray  # (E, Lp)
    primitive_coefficients: np.ndarray  # (E, Lp)
    one_electron: np.ndarray  # (E, 3, n, n)
    cartesian_exponents: np.ndarray  # (E, Lc, K)
    cartesian_coefficients: np.ndarray  # (E, Lc, K)
    shell_exponents: np.ndarray  # (E, Ls, K)
    shell_coefficients: np.ndarray  # (E, Ls, C, K)
    one_centre_eris: np.ndarray  # (E, Lo)
    guess: np.ndarray  # (E, n, n)
    grid_offsets: np.ndarray  # (E, Lg + 1, 3)  the last column: the padding points', at the nucleus
    grid_volumes: np.ndarray  # (E, Lg + 1)  0 beyond an element's own points
    radii_adjust: np.ndarray  # (E, E)  Treutler's a_AB of a point's atom A and another atom B
    fitting_exponents: np.ndarray  # (E, Lf, Kf)  at each place of a slot's fitting layout
    fitting_coefficients: np.ndarray  # (E, Lf, Kf)
    fitting_present: np.ndarray  # (E, Lf) bool  whether the element has a shell at that place


def _stacked(rows: list[np.ndarray | None], width: tuple[int, ...], fill: float) -> np.ndarray:
    """Each element's rows (or None: the fill), padded with ``fill`` to ``width``, stacked."""
    out = np.full((len(rows),) + width, fill)
    for e, values in enumerate(rows):
        if values is not None:
            out[(e,) + tuple(slice(0, n) for n in values.shape)] = values
    return out


def treutler_adjust(charges: np.ndarray) -> np.ndarray:
    """(E, E) Treutler's size adjustment a_AB = (rho_B/rho_A - rho_A/rho_B)/4 from the square roots
    of the Bragg radii, clipped to [-1/2, 1/2] (PySCF's ``radi.treutler_atomic_radii_adjust``), for
    the atoms of these nuclear ``charges`` (0: absent, any value)."""
    rho = np.sqrt(radi.BRAGG_RADII[np.asarray(charges, int)]) + 1e-200
    ratio = rho[:, None] / rho[None, :]  # rho_A / rho_B
    return np.clip(0.25 * (ratio.T - ratio), -0.5, 0.5)


@dataclass(frozen=True, eq=False)
class BucketTemplate:
    """A size bucket's template molecule, the layout of its arrays by slot, and its element tables.

    Built once per (bucket, grid level) by :func:`bucket_template`; :meth:`tables` fills the element
    rows a run meets."""

    bucket: SizeBucket
    mol: gto.Mole  # the template molecule: each slot holds its kind's first element
    primitives: PrimitiveBasis  # the template's (its layout; its values are the first elements')
    cartesian: AOTables
    plan: EriPlan  # the bucket's ERI plan: its shapes, chunks and destinations
    primitive_rows: SlotRows  # (P,)
    cartesian_rows: SlotRows  # (Nc,)
    shell_rows: SlotRows  # (S,)
    one_centre_rows: SlotRows  # (M,)  the plan's one-centre integrals
    ao_rows: SlotRows  # (Np,)
    point_rows: SlotRows  # (Gp,)  each grid point's slot and place in its element's atomic grid
    fitting_rows: SlotRows  # (S_f,)  each fitting shell's slot and place in its kind's layout (none unfitted)
    fitting_l: np.ndarray  # (S_f,)
    fitting_primitives: np.ndarray  # (S_f,)

    @property
    def elements(self) -> tuple[str, ...]:
        return self.bucket.elements

    def aos(self, atoms: np.ndarray) -> np.ndarray:
        """(N,) int: the template AO of each AO of a molecule placed by ``SizeBucket.place`` (its atom
        per slot ``atoms``), in the molecule's own AO order."""
        slot_of = np.full(int(atoms.max()) + 1, -1)
        slot_of[atoms[atoms >= 0]] = np.flatnonzero(atoms >= 0)
        starts = self.mol.aoslice_by_atom()[:, 2]
        sizes = self.mol.aoslice_by_atom()[:, 3] - starts
        return np.concatenate([starts[s] + np.arange(sizes[s]) for s in slot_of])

    def tables(self, present: frozenset[str]) -> ElementTables:
        """The element tables with the rows of the elements in ``present`` filled (cached by the set)."""
        return _tables(self, frozenset(present))


def bucket_template(bucket: SizeBucket) -> BucketTemplate:
    """The :class:`BucketTemplate` of ``bucket`` (cached per bucket)."""
    return _template(bucket)


def eri_bucket(bucket: SizeBucket) -> SizeBucket:
    """The bucket whose ERI programs ``bucket``'s molecules run: on a CPU, the bucket widened to
    :data:`~pyscf_ipu.integrals.eri.SHARED_ERI_AOS` (:func:`~pyscf_ipu.integrals.eri.shared_eri_aos`),
    so that buckets that differ only in their hydrogens share them, where its s8 array holds at most
    :data:`~pyscf_ipu.integrals.eri.SHARED_ERI_MOST` entries; elsewhere, and for a density-fitted bucket
    (no four-centre ERIs), the bucket itself."""
    step = shared_eri_aos()
    if not step or bucket.occupied:
        return bucket
    wider = bucket.widened(step)
    return wider if s8_size(wider.nao_padded) <= SHARED_ERI_MOST else bucket


def _one_centre_count(aos: int) -> int:
    """Integrals with all four AOs on one atom of ``aos`` AOs: p(p+1)/2 of its p = n(n+1)/2 pairs."""
    pairs = aos * (aos + 1) // 2
    return pairs * (pairs + 1) // 2


@lru_cache(maxsize=32)
def _template(bucket: SizeBucket) -> BucketTemplate:
    mol = placeholder_mole(bucket.basis, bucket.template_elements)
    primitives = primitive_basis(mol)
    cartesian = ao_tables(primitives)
    # each slot ranked within its kind: a molecule leaves the highest ranks absent (SizeBucket.place)
    rank = np.arange(mol.natm) - np.searchsorted(bucket.slot_kinds, bucket.slot_kinds)
    # a density-fitted bucket pairs its shells with fitting functions: no four-centre quartets
    wider = eri_bucket(bucket)
    computed = placeholder_mole(bucket.basis, wider.template_elements) if wider != bucket else mol
    plan = plan_eri(mol, eri_capacity(mol, computed), atom_rank=rank, quartets=not bucket.occupied)
    aos = mol.aoslice_by_atom()[:, 3] - mol.aoslice_by_atom()[:, 2]
    # each slot's grid: its kind's largest atomic grid, the slots of kinds counted exactly first and then,
    # rank by rank, the others', so that absent slots' points come last (the XC loops stop before
    # them); then the padding to the bucket's aligned size, each point a column past every grid
    sizes = [kind_grid_size(bucket.basis, kind, bucket.grid_level) for kind, cap in bucket.kinds for _ in range(cap)]
    rounded = np.array([element_aos(kind) < 4 for kind, _ in bucket.kinds])[bucket.slot_kinds]  # at any bucket step
    order = np.lexsort((rank, rounded))  # exact kinds' slots, then the rounded kinds' by rank
    points = SlotRows.of(np.repeat(order, np.asarray(sizes)[order]))
    padding = bucket.grid_points_padded - len(points.slot)
    points = SlotRows(np.concatenate([points.slot, np.zeros(padding, np.int32)]),
                      np.concatenate([points.local, np.full(padding, max(sizes), np.int32)]))  # fmt: skip
    layouts = [auxiliary_layout(bucket.basis, kind) if bucket.occupied else () for kind, cap in bucket.kinds
               for _ in range(cap)]  # fmt: skip
    fitting = [(slot, l, k) for slot, layout in enumerate(layouts) for l, k in layout]
    fitting_slot, fitting_l, fitting_k = (np.array([f[i] for f in fitting], np.int32) for i in range(3))
    return BucketTemplate(
        bucket=bucket,
        mol=mol,
        primitives=primitives,
        cartesian=cartesian,
        plan=plan,
        primitive_rows=SlotRows.of(primitives.atom),
        cartesian_rows=SlotRows.of(cartesian.atom),
        shell_rows=SlotRows.of(plan.shells.atom),
        one_centre_rows=SlotRows.of(np.repeat(np.arange(mol.natm), [_one_centre_count(n) for n in aos])),
        ao_rows=SlotRows.of(np.repeat(np.arange(mol.natm), aos)),
        point_rows=points,
        fitting_rows=SlotRows.of(fitting_slot),
        fitting_l=fitting_l,
        fitting_primitives=fitting_k,
    )


def _width(rows: SlotRows) -> int:
    """The table columns that ``rows`` reads: one past its largest place."""
    return int(rows.local.max()) + 1


@lru_cache(maxsize=64)
def _tables(template: BucketTemplate, present: frozenset[str]) -> ElementTables:
    bucket, shells = template.bucket, template.plan.shells
    symbols = bucket.elements[1:]
    data = [element_data(bucket.basis, s) if s in present else None for s in symbols]
    grids = [element_grid(s, bucket.grid_level) if s in present else None for s in symbols]
    for symbol, values in zip(symbols, data):
        slot = bucket.template_elements.index(_first_of_kind(bucket, symbol))
        if values is not None and len(values.primitive_exponents) != np.sum(template.primitive_rows.slot == slot):
            raise ValueError(f"{symbol} in {bucket.basis} does not have the shells of its kind's template atom")
    n = int(template.ao_rows.local.max()) + 1  # the most AOs of an atom
    k, c = shells.exponents.shape[1], shells.coefficients.shape[1]
    kc = template.cartesian.exponents.shape[1]
    charges = np.array([0.0] + [float(gto.charge(s)) for s in symbols])

    def table(name: str, width: tuple[int, ...], fill: float, rows=data) -> np.ndarray:
        return _stacked([None] + [None if r is None else getattr(r, name) for r in rows], width, fill)

    points = _width(template.point_rows)
    return ElementTables(
        charges=charges,
        primitive_exponents=table("primitive_exponents", (_width(template.primitive_rows),), 1.0),
        primitive_coefficients=table("primitive_coefficients", (_width(template.primitive_rows),), 0.0),
        one_electron=table("one_electron", (3, n, n), 0.0),
        cartesian_exponents=table("cartesian_exponents", (_width(template.cartesian_rows), kc), 1.0),
        cartesian_coefficients=table("cartesian_coefficients", (_width(template.cartesian_rows), kc), 0.0),
        shell_exponents=table("shell_exponents", (_width(template.shell_rows), k), 1.0),
        shell_coefficients=table("shell_coefficients", (_width(template.shell_rows), c, k), 0.0),
        one_centre_eris=table("one_centre_eris", (_width(template.one_centre_rows),), 0.0),
        guess=table("guess", (n, n), 0.0),
        grid_offsets=_stacked([None] + [None if g is None else g[0] for g in grids], (points, 3), 0.0),
        grid_volumes=_stacked([None] + [None if g is None else g[1] for g in grids], (points,), 0.0),
        radii_adjust=treutler_adjust(charges),
        **_fitting_tables(template, symbols, present),
    )


def _fitting_tables(template: BucketTemplate, symbols: tuple[str, ...], present: frozenset[str]) -> dict:
    """The fitting shells' element tables: each element's shells of each l at the first places of
    that l in its kind's layout (:func:`~pyscf_ipu.buckets.auxiliary_layout`)."""
    bucket = template.bucket
    width = max(1, _width(template.fitting_rows)) if len(template.fitting_l) else 1
    k = int(template.fitting_primitives.max(initial=1))
    exponents, coefficients = np.ones((len(symbols) + 1, width, k)), np.zeros((len(symbols) + 1, width, k))
    there = np.zeros((len(symbols) + 1, width), bool)
    for row, symbol in enumerate(symbols, start=1):
        if symbol not in present or not bucket.occupied:
            continue
        layout = np.array([l for l, _ in auxiliary_layout(bucket.basis, _kind(bucket, symbol))])
        data = fitting_data(bucket.basis, symbol)
        for l in set(data.l.tolist()):
            places, own = np.flatnonzero(layout == l), np.flatnonzero(data.l == l)
            kk = data.exponents.shape[1]
            exponents[row, places[: len(own)], :kk] = data.exponents[own]
            coefficients[row, places[: len(own)], :kk] = data.coefficients[own]
            there[row, places[: len(own)]] = True
    return {"fitting_exponents": exponents, "fitting_coefficients": coefficients, "fitting_present": there}


def _kind(bucket: SizeBucket, symbol: str) -> tuple:
    from .buckets import element_kind

    return element_kind(bucket.basis, symbol, fitted=bucket.occupied > 0)


def _first_of_kind(bucket: SizeBucket, symbol: str) -> str:
    """The template's element for ``symbol``'s kind (the kind's first element)."""
    from .buckets import kind_members

    return kind_members(bucket.basis, _kind(bucket, symbol))[0]
