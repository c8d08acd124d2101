r"""The ERI plan: which shell quartets the kernels evaluate, in which chunks, and where each value goes.

Built once per basis (on the host, in numpy); :mod:`.eri_kernels` evaluates it and :mod:`.eri` runs it.

- **Shells** here are the functions of one atom that share their exponents (:class:`Shells`): a
  Pople sp shell is one shell with an s and a p component, so a quartet's primitive quartets, Boys
  functions and Hermite integrals serve all its components.
- **Shell pairs** (a >= b in PySCF's shell order, swapped so that (l_a, K_a) >= (l_b, K_b), which
  the packed symmetric output does not see) are grouped in classes (l_a, K_a, l_b, K_b) of
  components and primitive counts, so that no shell is padded to another's primitive count.
- **Shell quartets** (bra pair >= ket pair) are grouped in classes (bra class, ket class), each cut
  into **chunks**: squares of :data:`CHUNK` bra x :data:`CHUNK` ket pairs. The tile plan of the
  simulated IPU (:mod:`pyscf_ipu.ipu.eri_tiles`) hands out the same squares.
- **Destinations:** the spherical values go straight into PySCF's 8-fold packed layout
  (``mol.intor("int2e", aosym="s8")``), at indices the kernels work out from each pair row's AO pairs
  (:func:`pair_rows`); repeats, padding and one-centre quartets go to :data:`NOWHERE`. The plan keeps
  which quartets of each chunk have values (``keep``).
- **One-centre quartets** (all four shells on one atom) do not depend on the geometry and hold the
  largest integrals, so they are constants of the plan, from libcint in float64 (:func:`one_centre_eris`).
- **Shared shapes:** pair rows, chunks, atoms, one-centre constants and the s8 length are rounded
  up (:func:`~pyscf_ipu.padding.padded_size`), or taken from a size bucket's :class:`EriCapacity`
  (possibly a wider bucket's counts, in the bucket's own s8 layout), so that molecules of similar
  size run one compiled program.
- **Screening at run time:** the plan depends on the basis and not on the geometry; the kernels skip
  chunks by their Schwarz bounds at run time (``docs/decisions/eri-screening.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import scipy.linalg
from pyscf import gto

from ..packed import s8_size
from ..padding import padded_size
from .basis import cartesian_powers, contracted_shells

CHUNK = 16  # pairs per side of a chunk: a kernel call computes CHUNK x CHUNK shell quartets
NOWHERE = np.iinfo(np.int32).max  # the destination of values to discard: beyond any s8 array


def padded_s8_size(size: int) -> int:
    """The s8 array's length as computed: ``size`` rounded up (:func:`~pyscf_ipu.padding.padded_size`; the tail beyond ``size`` is cut off)."""
    return padded_size(size, minimum=1024)


def cartesian_functions(components: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The Cartesian powers of a shell's functions: its components' in turn, each in PySCF's order."""
    return [power for l in components for power in cartesian_powers(l)]


def spherical_count(components: tuple[int, ...]) -> int:
    return sum(2 * l + 1 for l in components)


@lru_cache(maxsize=None)
def cartesian_to_spherical(components: tuple[int, ...]) -> np.ndarray:
    """(Cartesian, spherical) transform of a shell's functions, with libcint's normalisation (s and p
    included): block-diagonal, a block per component."""
    return scipy.linalg.block_diag(*(np.asarray(gto.cart2sph(l)) for l in components))


@dataclass(frozen=True)
class Shells:
    """The basis as ERI shells: the contracted functions of one atom that share their exponents are
    one row, with a component per function. A Pople sp shell (STO-3G's and 6-31G's valence shells)
    is one row with components s and p, a general contraction one row with a component per
    contracted function. A quartet of rows then evaluates its primitive quartets, Boys functions and
    Hermite integrals once for all its components. Primitives are padded to K, components to C."""

    components: tuple[tuple[int, ...], ...]  # (S,) the components' angular momenta, in PySCF's AO order
    atom: np.ndarray  # (S,) atom index
    nprim: np.ndarray  # (S,) primitives
    exponents: np.ndarray  # (S, K); padding repeats the first exponent (its coefficients are 0)
    coefficients: np.ndarray  # (S, C, K) PySCF's (radially normalised) contraction coefficients; 0 on padding
    offset: np.ndarray  # (S, C) first spherical AO of each component; 0 on padding


def shells_of(mol: gto.Mole) -> Shells:
    """``mol``'s shells, those of one atom with the same exponents merged into one row."""
    rows: dict[tuple[int, bytes], tuple[int, np.ndarray, list]] = {}
    ao_loc = mol.ao_loc_nr()
    for shell, l, atom, exps, coeff in contracted_shells(mol):
        _, _, functions = rows.setdefault((atom, np.asarray(exps, np.float64).tobytes()), (atom, exps, []))
        functions += [(l, coeff[c], ao_loc[shell] + c * (2 * l + 1)) for c in range(len(coeff))]
    rows = list(rows.values())
    k = max(len(exps) for _, exps, _ in rows)
    c = max(len(functions) for _, _, functions in rows)
    exponents, coefficients, offset = np.zeros((len(rows), k)), np.zeros((len(rows), c, k)), np.zeros((len(rows), c), int)
    for s, (_, exps, functions) in enumerate(rows):
        exponents[s] = exps[0]
        exponents[s, : len(exps)] = exps
        for m, (_, coeff, first) in enumerate(functions):
            coefficients[s, m, : len(coeff)] = coeff
            offset[s, m] = first
    return Shells(
        components=tuple(tuple(l for l, _, _ in functions) for _, _, functions in rows),
        atom=np.array([atom for atom, _, _ in rows]),
        nprim=np.array([len(exps) for _, exps, _ in rows]),
        exponents=exponents,
        coefficients=coefficients,
        offset=offset,
    )


def packed_pairs(i, j):
    """Index of (i, j) in a packed lower triangle (either order)."""
    hi, lo = np.maximum(i, j), np.minimum(i, j)
    return hi * (hi + 1) // 2 + lo


@dataclass(frozen=True)
class PairClass:
    """Shell pairs (a, b) with components (la, lb) and primitive counts (ka, kb), (la, ka) >= (lb, kb).

    The rows are padded to a rounded-up number of whole chunks (:func:`~pyscf_ipu.padding.padded_size`) by
    repeating the first pair (its quartets go nowhere), so that molecules of similar size share shapes.
    """

    la: tuple[int, ...]  # the components' angular momenta
    lb: tuple[int, ...]
    ka: int
    kb: int
    count: int  # real pairs: rows [0, count)
    first: np.ndarray  # (n,) shell a, n a multiple of CHUNK
    second: np.ndarray  # (n,) shell b

    @property
    def order(self) -> int:
        """The highest Hermite order of the pair's products: l_a + l_b of its highest components."""
        return max(self.la) + max(self.lb)

    @property
    def functions(self) -> int:
        """Spherical AO products per pair, S_a S_b."""
        return spherical_count(self.la) * spherical_count(self.lb)


@dataclass(frozen=True)
class QuartetClass:
    """The shell quartets (bra pair | ket pair) of two pair classes, as CHUNK x CHUNK squares of pairs."""

    bra: int  # pair class of the bra
    ket: int  # pair class of the ket
    chunks: np.ndarray  # (T, 2) bra chunk and ket chunk of each square: rows CHUNK * chunk + (0 .. CHUNK)
    keep: np.ndarray  # (T, CHUNK, CHUNK) bool: whether the quartet (bra row, ket row) has values to write

    def quartets(self) -> tuple[np.ndarray, np.ndarray]:
        """(bra rows, ket rows) of the quartets with values to write, in kernel order."""
        bra = CHUNK * self.chunks[:, 0, None, None] + np.arange(CHUNK)[None, :, None]
        ket = CHUNK * self.chunks[:, 1, None, None] + np.arange(CHUNK)[None, None, :]
        bra, ket = np.broadcast_arrays(bra, ket)  # (T, I, J)
        return bra[self.keep], ket[self.keep]


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: device arrays are cached per plan
class EriPlan:
    """Which shell quartets each class kernel evaluates, and where their values go (built once per basis)."""

    shells: Shells
    pairs: tuple[PairClass, ...]
    quartets: tuple[QuartetClass, ...]
    nao: int  # AOs of the s8 array written: the molecule's, or its bucket's (the extra AOs' integrals are 0)
    size: int  # entries of that s8 array
    natm: int  # the molecule's atoms
    one_centre_index: np.ndarray  # (M,) s8 positions of the integrals with all four AOs on one atom
    one_centre_value: np.ndarray  # (M,) their values (float64, from libcint: they do not depend on geometry)
    padded_natm: int  # atoms as computed (the extra atoms are at the origin and own no shell)
    padded_size: int  # the s8 array as computed (the tail beyond ``size`` is cut off)
    one_centre_count: int  # the one-centre constants' capacity
    padded_shells: int  # shells as computed (the extra rows are never read)
    # the operator's range separation: 0 for the Coulomb operator 1/r, else ω of the long-range erf(ω r)/r
    omega: float = 0.0


@dataclass(frozen=True)
class EriCapacity:
    """The shapes of a size bucket's ERI plans (:func:`eri_capacity` of its template molecule): every
    plan made with it has these pair classes with these padded row counts, full chunk grids and these
    sizes, so all molecules of the bucket run one program and may share a batch. The s8 layout is that
    of ``nao`` AOs; the counts may be a larger template's, so that its programs serve both."""

    classes: tuple[tuple, ...]  # (l_a, K_a, l_b, K_b) of each pair class, in order
    rows: tuple[int, ...]  # padded rows (pairs) of each class, multiples of CHUNK
    nao: int  # AOs of the s8 layout
    natm: int
    one_centre: int
    shells: int
    length: int  # the s8 array's entries as computed (at least those of nao AOs; the tail is cut off)


def _pair_classes(shells: Shells, atom_rank: np.ndarray | None = None) -> dict[tuple, list[tuple[int, int]]]:
    """Shell pairs by class (l_a, K_a, l_b, K_b), (l_a, K_a) >= (l_b, K_b), sorted by class; within a
    class in shell order, or by the higher ``atom_rank`` of the pair's two atoms (stable)."""
    # classes by components and primitive counts: padding a 1-primitive shell to the 6 of a
    # 6-31G core shell would multiply its primitive quartets by up to 36
    kind = list(zip(shells.components, shells.nprim.tolist()))  # (components, K) per shell
    by_class: dict[tuple, list[tuple[int, int]]] = {}
    for a in range(len(shells.atom)):
        for b in range(a + 1):
            first, second = (a, b) if kind[a] >= kind[b] else (b, a)
            by_class.setdefault(kind[first] + kind[second], []).append((first, second))
    if atom_rank is not None:
        rank = np.asarray(atom_rank)[shells.atom]
        by_class = {k: sorted(m, key=lambda pair: max(rank[pair[0]], rank[pair[1]])) for k, m in by_class.items()}
    return dict(sorted(by_class.items()))


def _one_centre_count(mol: gto.Mole) -> int:
    """Integrals with all four AOs on one atom: p(p+1)/2 for the p = n(n+1)/2 AO pairs of each atom."""
    pairs = [(a1 - a0) * (a1 - a0 + 1) // 2 for _, _, a0, a1 in mol.aoslice_by_atom()]
    return sum(p * (p + 1) // 2 for p in pairs)


def eri_capacity(template: gto.Mole, computed: gto.Mole | None = None) -> EriCapacity:
    """The ERI shapes of the size bucket whose template molecule is ``template``: its s8 layout, and
    the counts (pair rows, atoms, shells, one-centre constants, s8 length) of ``computed`` (default:
    ``template`` itself), a template with at least as many atoms of each kind, whose ERI programs then
    serve this bucket too (the extra pairs and chunks are padding, skipped at run time)."""
    shells = shells_of(template if computed is None else computed)
    by_class = _pair_classes(shells)
    if computed is None:
        computed = template
    elif tuple(by_class) != tuple(_pair_classes(shells_of(template))) or computed.natm < template.natm:
        raise ValueError("the computed template must hold the template's pair classes and atoms")
    rows = tuple(CHUNK * padded_size(-(-len(m) // CHUNK), minimum=1) for m in by_class.values())
    return EriCapacity(tuple(by_class), rows, template.nao_nr(), computed.natm, _one_centre_count(computed),
                       len(shells.atom), padded_s8_size(s8_size(max(template.nao_nr(), computed.nao_nr()))))


def plan_eri(mol: gto.Mole, capacity: EriCapacity | None = None, atom_rank: np.ndarray | None = None,
             quartets: bool = True, omega: float = 0.0) -> EriPlan:  # fmt: skip
    """Group ``mol``'s shell pairs and quartets into classes and chunks, and mark the quartets with values.

    Without ``capacity``, every count is rounded up on its own (:func:`~pyscf_ipu.padding.padded_size`)
    and chunks without a quartet to compute are left out. With the ``capacity`` of ``mol``'s size
    bucket, the plan takes the bucket's shapes: its classes' row counts, every chunk of each quartet
    class (a chunk with nothing to compute is skipped by the kernel at run time), and the s8 array of
    the bucket's AOs, of which ``mol``'s is the leading part. ``atom_rank`` orders each class's pairs
    by the higher rank of their atoms: a size bucket's template ranks its slots within their kind, so
    that the pairs of the slots a molecule leaves absent (the last of a kind) come last and fill
    whole chunks, which the kernel skips. ``quartets`` False plans the shell pairs alone (a
    density-fitted run pairs them with fitting functions instead: :mod:`.fitting`), with no s8 array.
    ``omega`` > 0 plans the long-range ERIs of erf(ω r)/r (range-separated hybrids' exchange) instead of
    the Coulomb ERIs: the same quartets (the long-range integrals are bounded by the Coulomb ones, so
    the same screening holds), other one-centre constants.
    """
    if omega < 0:
        raise ValueError(f"omega = {omega}: the range separation must be 0 (Coulomb) or positive")
    shells = shells_of(mol)
    nao = mol.nao_nr() if capacity is None else capacity.nao
    size = s8_size(nao)
    length = padded_s8_size(size) if capacity is None else capacity.length
    if quartets and length >= NOWHERE:
        raise ValueError(f"{nao} AOs: the s8 ERI array ({size:,} entries) exceeds 32-bit indexing")
    by_class = _pair_classes(shells, atom_rank)
    if capacity is not None and (tuple(by_class) != capacity.classes or mol.natm > capacity.natm
                                 or any(len(m) > r for m, r in zip(by_class.values(), capacity.rows))):  # fmt: skip
        raise ValueError("the molecule does not fit the ERI capacity of this size bucket")
    pairs = []
    for k, ((la, ka, lb, kb), members) in enumerate(by_class.items()):
        rows = np.array(members)
        padded = CHUNK * padded_size(-(-len(rows) // CHUNK), minimum=1) if capacity is None else capacity.rows[k]
        rows = np.concatenate([rows, np.repeat(rows[:1], padded - len(rows), axis=0)])
        pairs.append(PairClass(la, lb, ka, kb, len(members), rows[:, 0], rows[:, 1]))
    classes = []
    for x in range(len(pairs) if quartets else 0):
        for y in range(x + 1):
            quartet = _quartet_class(shells, pairs, x, y, every_chunk=capacity is not None)
            if quartet is not None:
                classes.append(quartet)
    index, value = one_centre_eris(mol, omega) if quartets else (np.zeros(0, np.int32), np.zeros(0))
    if capacity is None:
        padded_natm, padded_shells = padded_size(mol.natm, minimum=4), padded_size(len(shells.atom))
        one_centre = padded_size(len(index), minimum=64)
    else:
        padded_natm, one_centre, padded_shells = capacity.natm, capacity.one_centre, capacity.shells
    return EriPlan(shells, tuple(pairs), tuple(classes), nao, size, mol.natm, index, value, padded_natm,
                   length, one_centre, padded_shells, float(omega))  # fmt: skip


def _quartet_class(shells: Shells, pairs, x: int, y: int, every_chunk: bool = False) -> QuartetClass | None:
    """The chunks of the quartets (class x | class y), x >= y; None if none of them is computed
    (``every_chunk``: all chunks, those with nothing to compute included, so the shape is the classes').

    A quartet is computed unless it is padding, a repeat ((ij|kl) with kl > ij within one class)
    or one-centre (all four shells on one atom: a constant of the plan, see :func:`one_centre_eris`).
    """
    bra, ket = pairs[x], pairs[y]
    ti, tj = np.meshgrid(np.arange(len(bra.first) // CHUNK), np.arange(len(ket.first) // CHUNK), indexing="ij")
    chunks = np.stack([ti.ravel(), tj.ravel()], 1)
    if x == y:
        chunks = chunks[chunks[:, 0] >= chunks[:, 1]]
    bi = CHUNK * chunks[:, 0, None, None] + np.arange(CHUNK)[None, :, None]  # (T, I, 1)
    ki = CHUNK * chunks[:, 1, None, None] + np.arange(CHUNK)[None, None, :]  # (T, 1, J)
    bi, ki = np.broadcast_arrays(bi, ki)  # (T, I, J)
    keep = (bi < bra.count) & (ki < ket.count)
    if x == y:
        keep &= bi >= ki
    atoms = [shells.atom[c.first[rows]] for c, rows in ((bra, bi), (ket, ki))]
    atoms += [shells.atom[c.second[rows]] for c, rows in ((bra, bi), (ket, ki))]
    keep &= ~((atoms[0] == atoms[1]) & (atoms[0] == atoms[2]) & (atoms[0] == atoms[3]))
    used = keep.any((1, 2)) | every_chunk
    if not used.any():
        return None
    return QuartetClass(x, y, chunks[used].astype(np.int32), keep[used])


def one_centre_eris(mol: gto.Mole, omega: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The s8 positions and float64 values of every ERI with all four AOs on one atom, of the Coulomb
    operator (``omega`` 0) or of the long-range erf(ω r)/r.

    These do not depend on the geometry, so libcint evaluates them once per plan; they are also
    the largest ERIs (core orbitals, up to ~5 Hartree), where float32's last digit alone is 5e-7,
    and the device path could not meet 1e-6 on them after summing hundreds of primitive terms.
    """
    index, value = [], []
    blocks: dict[str, np.ndarray] = {}  # by atom symbol: atoms of one symbol have one basis
    for atom, (shell_start, shell_stop, ao_start, ao_stop) in enumerate(mol.aoslice_by_atom()):
        if shell_stop == shell_start:
            continue
        symbol = mol.atom_symbol(atom)
        if symbol not in blocks:
            with mol.with_range_coulomb(omega):  # 0: the Coulomb operator itself
                blocks[symbol] = mol.intor("int2e", shls_slice=(shell_start, shell_stop) * 4)  # (n, n, n, n)
        block = blocks[symbol]
        aos = np.arange(ao_start, ao_stop)
        mu, nu = np.tril_indices(len(aos))
        ij = packed_pairs(aos[mu], aos[nu])
        left, right = np.tril_indices(len(ij))
        index.append(packed_pairs(ij[left], ij[right]))
        value.append(block[mu[left], nu[left], mu[right], nu[right]])
    return np.concatenate(index).astype(np.int32), np.concatenate(value)


def pair_rows(shells: Shells, pair: PairClass) -> tuple[np.ndarray, np.ndarray]:
    """(S_a S_b, rows) each: the packed AO pair of every value of every row of ``pair``'s class, and
    whether it repeats another of the row's values (a shell with itself: (mu, nu) and (nu, mu) are one
    value; mu >= nu is kept)."""
    def functions(shell, components):  # (rows, S): the spherical AOs of each shell's components in turn
        return np.concatenate([shells.offset[shell, c, None] + np.arange(2 * l + 1) for c, l in enumerate(components)], 1)

    a, b = pair.first, pair.second
    mu, nu = np.broadcast_arrays(functions(a, pair.la)[:, :, None], functions(b, pair.lb)[:, None, :])
    repeat = (a == b)[:, None, None] & (mu < nu)
    return packed_pairs(mu, nu).reshape(len(a), -1).T, repeat.reshape(len(a), -1).T
