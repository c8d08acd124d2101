"""Size buckets: the coarse sizes that every compiled program's shapes come from.

Atoms are counted by **kind**: elements whose shells in the basis have the same angular momenta,
primitive counts and contractions (at STO-3G: hydrogen and helium are one kind, lithium to neon
another). Which element of a kind an atom is changes only data (exponents, coefficients, charges,
the grid's radii), never a shape. A :class:`SizeBucket` holds, for each kind, a capacity: the
molecule's count of that kind rounded up (kinds of fewer than 4 AOs per atom in steps of 4 AOs' worth
of atoms, others exactly), so the padded AO count is at most three above the molecule's: coarse
enough that a run over a few dozen molecules compiles a few buckets, fine enough that the padding
costs little (the choice is in ``docs/decisions/size-buckets.md``); a run may choose a coarser step
(``RKSConfig.bucket_step``; an accelerator's default, :func:`default_bucket_step`, is 16 AOs' worth,
where padding costs less than compiling, and pads by at most 15 AOs). Where a J-K backend's shapes
depend on the occupied orbitals (density fitting), a bucket also holds their count rounded up to a
step (the run's ``occupied_step``), and its kinds split further by fitting functions per atom, in
steps of :data:`FITTING_STEP` (so that lithium's 83 at 6-31G* do not pad carbon's 70); elsewhere the
occupied capacity is 0 and buckets split by neither.
Every array of a molecule in the bucket is padded to the bucket's **template**: a placeholder
molecule with ``capacity`` atoms of each kind. So any two molecules of a bucket run the same
programs, and one batch may mix them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from .integrals.basis import MAX_L, unsupported_shell
from .molecule import Molecule, atomic_number

KIND_SEARCH_ELEMENTS = 36  # elements H..Kr are searched for the members of a kind (their grids)
LABEL_ELEMENTS = ("C", "H")  # a kind's name in labels: the first of these it holds, else its first element
GRID_ALIGNMENT = 1024  # padded grid sizes are multiples of the XC quadrature's block
FITTING_STEP = 8  # a density-fitted bucket's kinds hold elements of equal fitting functions rounded up to this
OCCUPIED_STEP = 8  # a density-fitted bucket rounds its occupied-orbital count up to a multiple of this
CPU_BUCKET_STEP = 4  # AOs' worth of atoms: a CPU's step for kinds of fewer than 4 AOs per atom
ACCELERATOR_BUCKET_STEP = 16  # the same on an accelerator, whose programs wait on latency more than on work


def default_bucket_step(platform: str) -> int:
    """The step (in AOs' worth of atoms) to which a size bucket rounds up the counts of its kinds of
    fewer than 4 AOs per atom, on a JAX ``platform``: :data:`CPU_BUCKET_STEP` on a CPU, where every
    padded AO costs work in every conformer; :data:`ACCELERATOR_BUCKET_STEP` elsewhere, where a padded
    AO costs little and every extra bucket costs its programs' compilation
    (``docs/decisions/size-buckets.md``)."""
    return CPU_BUCKET_STEP if platform == "cpu" else ACCELERATOR_BUCKET_STEP


@lru_cache(maxsize=None)
def element_kind(basis: str, symbol: str, fitted: bool = False) -> tuple:
    """The shape signature of ``symbol`` in ``basis``: ((l, primitives, contractions) per shell, the
    pattern of shared exponents, F), where F is 0, or for a ``fitted`` (density-fitted) run
    :func:`auxiliary_functions` rounded up to :data:`FITTING_STEP`. Elements of one signature fill
    the same slots of a bucket's template (:mod:`pyscf_ipu.templates`): every array of their atoms
    has the same shape and layout, only the values differ. :class:`~pyscf_ipu.integrals.basis.UnsupportedBasisError`
    where the element has shells the integrals do not cover."""
    shells = _shells(basis, symbol)
    highest = max(l for l, _, _ in shells[0])
    if highest > MAX_L:
        raise unsupported_shell(basis, symbol, highest)
    return shells, _fitting_tier(basis, symbol) if fitted else 0


def _shells(basis: str, symbol: str) -> tuple:
    """(l, primitives, contractions) per shell, and for each primitive of the atom (shell after
    shell) the first primitive with its exponent: the integral kernels share work between equal
    exponents (a Pople sp shell), so that sharing must be the same for every element of a kind."""
    from .pyscf_mole import element_basis

    shells = element_basis(basis, symbol)
    exponents = [float(primitive[0]) for shell in shells for primitive in shell[1:]]
    return (tuple((shell[0], len(shell) - 1, len(shell[1]) - 1) for shell in shells),
            tuple(exponents.index(e) for e in exponents))  # fmt: skip


def _fitting_tier(basis: str, symbol: str) -> int:
    return -(-auxiliary_functions(basis, symbol) // FITTING_STEP) * FITTING_STEP


def element_aos(kind: tuple) -> int:
    return sum((2 * l + 1) * contractions for l, _, contractions in kind[0][0])


@lru_cache(maxsize=None)
def kind_members(basis: str, kind: tuple) -> tuple[str, ...]:
    """The elements H..Kr of ``basis`` whose signature (:func:`element_kind`) is ``kind``."""
    from pyscf.data.elements import ELEMENTS

    shells, fitting = kind
    members = []
    for symbol in ELEMENTS[1 : KIND_SEARCH_ELEMENTS + 1]:
        try:
            if _shells(basis, symbol) != shells:
                continue
            # the fitting basis only where the shells match: it takes longer to build
            if not fitting or _fitting_tier(basis, symbol) == fitting:
                members.append(symbol)
        except Exception:  # the basis (or its fitting basis) lacks this element
            continue
    return tuple(members)


@lru_cache(maxsize=None)
def atomic_grid_size(symbol: str, level: int) -> int:
    """Points of PySCF's atomic grid of ``symbol`` at ``level`` (independent of the geometry and basis)."""
    from pyscf import dft, gto

    mol = gto.M(atom=[(symbol, (0.0, 0.0, 0.0))], basis="sto-3g", spin=gto.charge(symbol) % 2, verbose=0)
    grids = dft.gen_grid.Grids(mol)
    grids.level = level
    table = grids.gen_atomic_grids(mol, grids.atom_grid, grids.radi_method, level, grids.prune)
    return len(table[mol.atom_symbol(0)][1])


@lru_cache(maxsize=None)
def kind_grid_size(basis: str, kind: tuple, level: int) -> int:
    """The largest atomic grid of the kind's elements: a shared capacity, whichever element it is."""
    return max(atomic_grid_size(symbol, level) for symbol in kind_members(basis, kind))


@lru_cache(maxsize=None)
def auxiliary_basis(basis: str, symbol: str):
    """PySCF's default density-fitting basis for ``symbol`` under the orbital ``basis``
    (``df.addons.make_auxbasis``): a named JK-fitting basis where PySCF maps one (cc-pVDZ-JKFIT for
    6-31G*, def2-universal-JKFIT for the def2 family and STO-3G), else even-tempered functions generated
    from the orbital basis. What a PySCF user's ``density_fit()`` gets."""
    from pyscf import df, gto

    mol = gto.M(atom=[(symbol, (0.0, 0.0, 0.0))], basis=basis, spin=gto.charge(symbol) % 2, verbose=0)
    aux = df.addons.make_auxbasis(mol)
    return aux[symbol] if isinstance(aux, dict) else aux


@lru_cache(maxsize=None)
def auxiliary_mole(basis: str, symbol: str):
    """A one-atom PySCF ``Mole`` of ``symbol`` in its :func:`auxiliary_basis` (the fitting functions)."""
    from pyscf import gto

    return gto.M(atom=[(symbol, (0.0, 0.0, 0.0))], basis={symbol: auxiliary_basis(basis, symbol)},
                 spin=gto.charge(symbol) % 2, verbose=0)  # fmt: skip


@lru_cache(maxsize=None)
def auxiliary_functions(basis: str, symbol: str) -> int:
    """The (spherical) functions of :func:`auxiliary_basis` on one ``symbol`` atom."""
    return auxiliary_mole(basis, symbol).nao


@lru_cache(maxsize=None)
def auxiliary_shells(basis: str, symbol: str) -> tuple[tuple[int, int], ...]:
    """(l, primitives) of each fitting function's shell of ``symbol`` (a general contraction's
    functions one by one), by l and then by primitives, most first: the order in which an atom's
    fitting shells fill its slot's (:func:`auxiliary_layout`)."""
    mol = auxiliary_mole(basis, symbol)
    shells = [(int(mol.bas_angular(i)), int(mol.bas_nprim(i))) for i in range(mol.nbas) for _ in range(mol.bas_nctr(i))]
    return tuple(sorted(shells, key=lambda shell: (shell[0], -shell[1])))


def auxiliary_layout(basis: str, kind: tuple) -> tuple[tuple[int, int], ...]:
    """The fitting shells of one slot of a density-fitted ``kind``: for each l, as many shells as the
    kind's element with the most of that l has, each with the most primitives any element has at
    that place (:func:`auxiliary_shells` order); every element of the kind fits in it."""
    return _auxiliary_layout(basis, kind)


@lru_cache(maxsize=None)
def _auxiliary_layout(basis: str, kind: tuple) -> tuple[tuple[int, int], ...]:
    by_l: dict[int, list[int]] = {}
    for symbol in kind_members(basis, kind):
        try:
            shells = auxiliary_shells(basis, symbol)
        except Exception:  # no fitting basis for this element
            continue
        for l in {l for l, _ in shells}:
            primitives = [k for m, k in shells if m == l]
            widest = by_l.setdefault(l, [])
            widest.extend([0] * (len(primitives) - len(widest)))
            by_l[l] = [max(a, b) for a, b in zip(widest, primitives + [0] * (len(widest) - len(primitives)))]
    return tuple((l, k) for l in sorted(by_l) for k in by_l[l])


@lru_cache(maxsize=None)
def minimal_occupied(symbol: str) -> int:
    """Minimal-basis functions that hold electrons in the free atom's spherically averaged ground state
    (PySCF's ``atom_hf.frac_occ``): the rank of its share of the initial guess (a superposition of
    atomic densities), which is at least its share of the occupied orbitals."""
    from pyscf.scf import atom_hf

    shells = [atom_hf.frac_occ(symbol, l) for l in range(4)]
    return sum((2 * l + 1) * (ndocc + (frac > 0)) for l, (ndocc, frac) in enumerate(shells))


def _kind_maximum(basis: str, kind: tuple, count) -> int:
    """The largest ``count(symbol)`` over the kind's elements, skipping those it fails for."""
    values = []
    for symbol in kind_members(basis, kind):
        try:
            values.append(count(symbol))
        except Exception:  # e.g. no fitting basis for this element
            continue
    return max(values)


def capacity(count: int, aos_per_atom: int, step_aos: int = CPU_BUCKET_STEP) -> int:
    """A kind's count rounded up to a multiple of ``step_aos`` AOs' worth of its atoms (at 4, STO-3G
    hydrogen: 4 atoms, 6-31G hydrogen: 2); kinds of 4 or more AOs per atom exactly."""
    step = max(1, step_aos // aos_per_atom) if aos_per_atom < 4 else 1
    return -(-count // step) * step


@dataclass(frozen=True)
class SizeBucket:
    """The sizes programs are compiled for: the basis, the grid level and a capacity per atom kind."""

    basis: str
    grid_level: int
    kinds: tuple[tuple[tuple, int], ...]  # (kind signature, capacity), sorted by signature
    occupied: int = 0  # doubly occupied orbitals rounded up to the run's step; 0: not a dimension
    # a density-fitted bucket's factor held once, in float64, and read a block at a time each iteration:
    # where the loop's unpacked copy would not fit the memory budget (the fitted backend decides)
    streams_factor: bool = False

    @classmethod
    def of(cls, molecule: Molecule, basis: str, grid_level: int, occupied_step: int = 0,
           step_aos: int = CPU_BUCKET_STEP) -> SizeBucket:  # fmt: skip
        return cls.of_symbols(molecule.symbols, basis, grid_level, occupied_step, molecule.charge, step_aos)

    @classmethod
    def of_symbols(cls, symbols, basis: str, grid_level: int, occupied_step: int = 0, charge: int = 0,
                   step_aos: int = CPU_BUCKET_STEP) -> SizeBucket:  # fmt: skip
        """The bucket of a closed-shell molecule with these element symbols and total ``charge``: kinds
        of fewer than 4 AOs per atom rounded up to multiples of ``step_aos`` AOs' worth of atoms
        (:func:`capacity`); ``occupied_step`` > 0 (a density-fitted run) adds its occupied-orbital
        count, rounded up to a multiple of it, and counts atoms by fitted kinds (:func:`element_kind`).
        :class:`~pyscf_ipu.integrals.basis.UnsupportedBasisError` where the basis gives an element
        shells the integrals do not cover: the method cannot run, whatever the molecule."""
        counts = Counter(element_kind(basis, symbol, fitted=occupied_step > 0) for symbol in symbols)
        kinds = tuple(sorted((kind, capacity(n, element_aos(kind), step_aos)) for kind, n in counts.items()))
        occupied = 0
        if occupied_step:
            pairs = -(-(sum(atomic_number(s) for s in symbols) - charge) // 2)
            occupied = -(-pairs // occupied_step) * occupied_step
        return cls(basis, grid_level, kinds, occupied)

    @cached_property
    def template_elements(self) -> tuple[str, ...]:
        """The template molecule's atoms: ``capacity`` of each kind's first element, kind after kind."""
        return tuple(symbol for kind, cap in self.kinds for symbol in [kind_members(self.basis, kind)[0]] * cap)

    @property
    def always_full(self) -> bool:
        """Whether every molecule of the bucket has exactly its template's atoms: :func:`capacity` rounds
        no kind up (it rounds only kinds of fewer than 4 AOs per atom)."""
        return all(element_aos(kind) >= 4 for kind, _ in self.kinds)

    @property
    def natm_padded(self) -> int:
        return sum(cap for _, cap in self.kinds)

    @cached_property
    def slot_kinds(self) -> np.ndarray:
        """(natm,) int: the kind (its place in ``kinds``) of each slot, the template's atoms in turn."""
        return np.repeat(np.arange(len(self.kinds)), [cap for _, cap in self.kinds]).astype(np.int32)

    @cached_property
    def elements(self) -> tuple[str, ...]:
        """The rows of the bucket's element tables: ``""`` for an absent slot, then the elements of
        each kind in turn (a slot of a kind holds one of that kind's elements)."""
        return ("",) + tuple(symbol for kind, _ in self.kinds for symbol in kind_members(self.basis, kind))

    def place(self, symbols) -> tuple[np.ndarray, np.ndarray]:
        """Where a molecule of the bucket with these element ``symbols`` (in its atom order) sits in the
        template: (element row per slot (natm,), the molecule's atom per slot (natm,), -1 where absent).

        Each kind's slots take the molecule's atoms of that kind in their order, the first slots first.
        """
        fitted = self.occupied > 0
        kind_index = {kind: k for k, (kind, _) in enumerate(self.kinds)}
        first = np.concatenate([[0], np.cumsum([cap for _, cap in self.kinds])])
        filled = np.zeros(len(self.kinds), int)
        atoms = np.full(self.natm_padded, -1, np.int32)
        for atom, symbol in enumerate(symbols):
            k = kind_index[element_kind(self.basis, symbol, fitted)]
            atoms[first[k] + filled[k]] = atom
            filled[k] += 1
        row = {symbol: r for r, symbol in enumerate(self.elements)}
        rows = np.array([row[symbols[a]] if a >= 0 else 0 for a in atoms], np.int32)
        return rows, atoms

    def widened(self, step_aos: int) -> SizeBucket:
        """This bucket with the capacities of its kinds of fewer than 4 AOs per atom rounded up further,
        to multiples of ``step_aos`` AOs' worth of atoms (:func:`capacity`): a bucket whose template
        holds this one's, so that its programs can serve every bucket it widens."""
        kinds = tuple((kind, capacity(cap, element_aos(kind), step_aos)) for kind, cap in self.kinds)
        return SizeBucket(self.basis, self.grid_level, kinds, self.occupied, self.streams_factor)

    @property
    def nao_padded(self) -> int:
        """Np: the padded AO count (the template's AOs)."""
        return sum(cap * element_aos(kind) for kind, cap in self.kinds)

    @property
    def naux_padded(self) -> int:
        """Qp: the padded count of density-fitting functions: each kind's capacity times the functions
        of its slots' :func:`auxiliary_layout`."""
        return sum(cap * sum(2 * l + 1 for l, _ in auxiliary_layout(self.basis, kind)) for kind, cap in self.kinds)

    @property
    def density_rank(self) -> int:
        """R: a bound on the rank of any density of the bucket's molecules (the initial guess's, and so
        the occupied orbitals' count), at most Np."""
        bound = sum(cap * _kind_maximum(self.basis, kind, minimal_occupied) for kind, cap in self.kinds)
        return min(self.nao_padded, bound)

    @property
    def occupied_rank(self) -> int:
        """A bound on the rank of the occupied orbitals' density: the occupied capacity where the
        bucket has one, else :attr:`density_rank`."""
        return min(self.density_rank, self.occupied) if self.occupied else self.density_rank

    @property
    def grid_points_padded(self) -> int:
        """Gp: the template's largest grid, rounded up to :data:`GRID_ALIGNMENT` (0 without a grid)."""
        points = sum(cap * kind_grid_size(self.basis, kind, self.grid_level) for kind, cap in self.kinds)
        return -(-points // GRID_ALIGNMENT) * GRID_ALIGNMENT

    @property
    def shapes(self) -> tuple[int, int]:
        """(Np, Gp), the SCF problem's padded shapes."""
        return self.nao_padded, self.grid_points_padded

    def label(self) -> str:
        """A short name: the capacities by kind's first element, e.g. ``sto-3g:C9H8``."""
        def name(kind):
            members = kind_members(self.basis, kind)
            return next((e for e in LABEL_ELEMENTS if e in members), members[0])

        parts = "".join(f"{name(kind)}{cap}" for kind, cap in self.kinds)
        return (f"{self.basis}:{parts}" + (f":occ{self.occupied}" if self.occupied else "")
                + (":streamed" if self.streams_factor else ""))
