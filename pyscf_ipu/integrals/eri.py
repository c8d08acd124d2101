r"""Two-electron repulsion integrals (ERIs) by McMurchie-Davidson, per shell-quartet class, in JAX.

For primitive Gaussians with product centres P (exponents a + b = p) and Q (c + d = q),

.. math::

    (ab|cd) = \frac{2\pi^{5/2}}{pq\sqrt{p+q}} \sum_{tuv} E^{ab}_{tuv}
              \sum_{\tau\nu\phi} (-1)^{\tau+\nu+\phi} E^{cd}_{\tau\nu\phi}\,
              R_{t+\tau,u+\nu,v+\phi}(\alpha, \mathbf{R}_{PQ}), \qquad \alpha = \frac{pq}{p+q},

with the Hermite expansion coefficients E (products of the per-axis E^{ij}_t of
:mod:`.one_electron`) and the Hermite Coulomb integrals R of :func:`.one_electron.hermite_coulomb`
(McMurchie and Davidson, J. Comput. Phys. 26, 218 (1978); Helgaker, Jorgensen and Olsen,
*Molecular Electronic-Structure Theory*, 9.9).

Organisation (the shape of the work is fixed by the basis, not by the geometry):

- **Shells** here are the functions of one atom that share their exponents (:class:`Shells`): a
  Pople sp shell is one shell with an s and a p component, so a quartet's primitive quartets, Boys
  functions and Hermite integrals serve all its components (STO-3G, 9 heavy atoms: 3.2x fewer
  quartets than separate s and p shells; measured against libcint, 2.7x -> 4.1x its speed).
- **Shell pairs** (a >= b in PySCF's shell order, swapped so that (l_a, K_a) >= (l_b, K_b),
  which the packed symmetric output does not see) are grouped in classes (l_a, K_a, l_b, K_b) of
  components and primitive counts: one class for both would pad every shell to the most
  primitives (6-31G: 15x the primitive quartets, 9x slower than libcint; STO-3G has 3 classes
  either way). For each pair and primitive pair, the kernel forms the Hermite matrix E (spherical
  AO pair, t u v), with the contraction coefficients and the Cartesian-to-spherical transform
  folded in: (pairs, K2, S_a S_b, H).
- **Shell quartets** (bra pair >= ket pair) are grouped in classes (bra class, ket class): 6 on
  QM9 molecules at STO-3G, 120 at 6-31G, 231 at 6-31G* (so compiling a plan takes ~10 s, ~2 and
  ~5.5 minutes). Each class runs one kernel over **tiles**: squares of :data:`TILE` bra x
  :data:`TILE` ket pairs (``lax.map`` over the tiles, so memory stays bounded; the tile plan of
  the simulated IPU, :mod:`pyscf_ipu.ipu.eri_tiles`, hands out the same squares). Within a tile
  the work is three matmuls and flat elementwise loops (see :func:`_tile`): XLA's CPU backend
  vectorises a loop along its last axis only and fuses everything but matmuls, so the layout is
  chosen for that. Diagonal tiles of a class with itself compute both halves and keep one.
- The spherical values go straight into PySCF's 8-fold packed layout (``mol.intor("int2e",
  aosym="s8")``), through destination indices built once per basis on the host; that is the layout
  the J-K backends take.
- **Cores:** from host positions, the tiles are dealt out to worker threads, one jit per share
  (:func:`eri_s8`), because XLA's CPU backend runs each loop on one core; conformers of a batch
  run one after another within each share.
- **Shared shapes:** pair rows, tiles per class and share, atoms, one-centre constants and the s8
  length are rounded up to buckets (:func:`~pyscf_ipu.padding.bucket`, at most 1/8 more; extra
  tiles and constants write :data:`NOWHERE`, the s8 tail is cut off), and every share has the same
  shapes. So the shares, and molecules of similar size, run one compiled program: the 100
  molecules of the generator's built-in sample need 31 instead of 2 x 95.
- **No screening in the kernels:** every shell quartet and every primitive quartet is computed, so
  the plan is fixed by the basis and molecules of similar size share its shapes;
  ``RKSConfig.eri_threshold`` applies its Schwarz screening to the finished s8 array on the host.
  Primitive screening was built and measured (commit 0d7c1e7, reverted): with libcint's rule at
  exp(-30), 7-9% of the shell pairs and 40% of the primitive quartets of three 9-heavy-atom
  molecules at STO-3G drop out, but a plan then depends on its conformers and splits its classes
  by what they keep. The ERIs got 8-17% faster and the generator 3% (interleaved, 8 conformers per
  molecule); over 16 distinct molecules (``benchmarks/generator_cold.py``) it lost 50% cold and 19%
  with the compilation cache filled, as fewer molecules shared programs (dropping only whole
  pairs, 12% and 8%). Quartets with all four shells on one atom are not computed at all: their
  values are constants of the plan (see :func:`_one_centre`).

Geometry enters through differences: A - C between atoms from a float64 host table, and P - A =
-(b/p)(A - B), so a quartet on one atom sees exactly zero displacements in float32 as well.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
from pyscf import gto

from ..padding import bucket
from ..programs import compiled
from .basis import cartesian_powers, contracted_shells
from .one_electron import PairFactors, _stack, hermite_coefficients, hermite_coulomb, hermite_indices

TILE = 16  # pairs per side of a tile: a kernel call computes TILE x TILE shell quartets
NOWHERE = np.iinfo(np.int32).max  # the destination of values to discard: beyond any s8 array


def padded_s8_size(size: int) -> int:
    """The s8 array's length as computed: ``size`` bucketed (the tail beyond ``size`` is cut off)."""
    return bucket(size, minimum=1024)


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
    Hermite integrals once for all its components: at STO-3G on 9-heavy-atom molecules, 3.2x fewer
    quartets than one row per s or p shell. Primitives are padded to K, components to C."""

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


def _packed(i, j):
    """Index of (i, j) in a packed lower triangle (either order)."""
    hi, lo = np.maximum(i, j), np.minimum(i, j)
    return hi * (hi + 1) // 2 + lo


@dataclass(frozen=True)
class PairClass:
    """Shell pairs (a, b) with components (la, lb) and primitive counts (ka, kb), (la, ka) >= (lb, kb).

    The rows are padded to a bucketed number of whole tiles (:func:`~pyscf_ipu.padding.bucket`) by
    repeating the first pair (its quartets go nowhere), so that molecules of similar size share shapes.
    """

    la: tuple[int, ...]  # the components' angular momenta
    lb: tuple[int, ...]
    ka: int
    kb: int
    count: int  # real pairs: rows [0, count)
    first: np.ndarray  # (n,) shell a, n a multiple of TILE
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
    """The shell quartets (bra pair | ket pair) of two pair classes, as TILE x TILE squares of pairs."""

    bra: int  # pair class of the bra
    ket: int  # pair class of the ket
    tiles: np.ndarray  # (T, 2) bra tile and ket tile of each square: rows TILE * tile + (0 .. TILE)
    destination: np.ndarray  # (T, TILE, S_a S_b, TILE, S_c S_d) index into the s8 array; NOWHERE for nothing

    def quartets(self) -> tuple[np.ndarray, np.ndarray]:
        """(bra rows, ket rows) of the quartets with values to write, in kernel order."""
        real = (self.destination != NOWHERE).any((2, 4))  # (T, I, J)
        bra = TILE * self.tiles[:, 0, None, None] + np.arange(TILE)[None, :, None]
        ket = TILE * self.tiles[:, 1, None, None] + np.arange(TILE)[None, None, :]
        bra, ket = np.broadcast_arrays(bra, ket)
        return bra[real], ket[real]


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


@dataclass(frozen=True)
class EriCapacity:
    """The shapes of a size bucket's ERI plans (:func:`eri_capacity` of its template molecule): every
    plan made with it has these pair classes with these padded row counts, full tile grids and these
    sizes, so all molecules of the bucket run one program and may share a batch."""

    classes: tuple[tuple, ...]  # (l_a, K_a, l_b, K_b) of each pair class, in order
    rows: tuple[int, ...]  # padded rows (pairs) of each class, multiples of TILE
    nao: int
    natm: int
    one_centre: int


def _pair_classes(shells: Shells) -> dict[tuple, list[tuple[int, int]]]:
    """Shell pairs by class (l_a, K_a, l_b, K_b), (l_a, K_a) >= (l_b, K_b), sorted by class."""
    # classes by components and primitive counts: padding a 1-primitive shell to the 6 of a
    # 6-31G core shell would multiply its primitive quartets by up to 36
    kind = list(zip(shells.components, shells.nprim.tolist()))  # (components, K) per shell
    by_class: dict[tuple, list[tuple[int, int]]] = {}
    for a in range(len(shells.atom)):
        for b in range(a + 1):
            first, second = (a, b) if kind[a] >= kind[b] else (b, a)
            by_class.setdefault(kind[first] + kind[second], []).append((first, second))
    return dict(sorted(by_class.items()))


def _one_centre_count(mol: gto.Mole) -> int:
    """Integrals with all four AOs on one atom: p(p+1)/2 for the p = n(n+1)/2 AO pairs of each atom."""
    pairs = [(a1 - a0) * (a1 - a0 + 1) // 2 for _, _, a0, a1 in mol.aoslice_by_atom()]
    return sum(p * (p + 1) // 2 for p in pairs)


def eri_capacity(template: gto.Mole) -> EriCapacity:
    """The ERI shapes of the size bucket whose template molecule is ``template``."""
    by_class = _pair_classes(shells_of(template))
    rows = tuple(TILE * bucket(-(-len(m) // TILE), minimum=1) for m in by_class.values())
    return EriCapacity(tuple(by_class), rows, template.nao_nr(), template.natm, _one_centre_count(template))


def plan_eri(mol: gto.Mole, capacity: EriCapacity | None = None) -> EriPlan:
    """Group ``mol``'s shell pairs and quartets into classes and tiles and work out the s8 destinations.

    Without ``capacity``, every count is rounded up to its own bucket (:func:`~pyscf_ipu.padding.bucket`)
    and tiles without a quartet to compute are left out. With the ``capacity`` of ``mol``'s size
    bucket, the plan takes the bucket's shapes: its classes' row counts, every tile of each quartet
    class (a tile with nothing to compute is skipped by the kernel at run time), and the s8 array of
    the bucket's AOs, of which ``mol``'s is the leading part.
    """
    shells = shells_of(mol)
    nao = mol.nao_nr() if capacity is None else capacity.nao
    npair = nao * (nao + 1) // 2
    size = npair * (npair + 1) // 2
    if padded_s8_size(size) >= NOWHERE:
        raise ValueError(f"{nao} AOs: the s8 ERI array ({size:,} entries) exceeds 32-bit indexing")
    by_class = _pair_classes(shells)
    if capacity is not None and (tuple(by_class) != capacity.classes or mol.natm > capacity.natm
                                 or any(len(m) > r for m, r in zip(by_class.values(), capacity.rows))):  # fmt: skip
        raise ValueError("the molecule does not fit the ERI capacity of this size bucket")
    pairs = []
    for k, ((la, ka, lb, kb), members) in enumerate(by_class.items()):
        rows = np.array(members)
        padded = TILE * bucket(-(-len(rows) // TILE), minimum=1) if capacity is None else capacity.rows[k]
        rows = np.concatenate([rows, np.repeat(rows[:1], padded - len(rows), axis=0)])
        pairs.append(PairClass(la, lb, ka, kb, len(members), rows[:, 0], rows[:, 1]))
    quartets = []
    for x in range(len(pairs)):
        for y in range(x + 1):
            quartet = _quartet_class(shells, pairs, x, y, every_tile=capacity is not None)
            if quartet is not None:
                quartets.append(quartet)
    index, value = _one_centre(mol)
    if capacity is None:
        padded_natm, one_centre = bucket(mol.natm, minimum=4), len(index)
    else:
        padded_natm, one_centre = capacity.natm, capacity.one_centre
    return EriPlan(shells, tuple(pairs), tuple(quartets), nao, size, mol.natm, index, value, padded_natm,
                   padded_s8_size(size), one_centre)  # fmt: skip


def _quartet_class(shells: Shells, pairs, x: int, y: int, every_tile: bool = False) -> QuartetClass | None:
    """The tiles of the quartets (class x | class y), x >= y; None if none of them is computed
    (``every_tile``: all tiles, those with nothing to compute included, so the shape is the classes').

    A quartet is computed unless it is padding, a repeat ((ij|kl) with kl > ij within one class)
    or one-centre (all four shells on one atom: a constant of the plan, see :func:`_one_centre`).
    """
    bra, ket = pairs[x], pairs[y]
    ti, tj = np.meshgrid(np.arange(len(bra.first) // TILE), np.arange(len(ket.first) // TILE), indexing="ij")
    tiles = np.stack([ti.ravel(), tj.ravel()], 1)
    if x == y:
        tiles = tiles[tiles[:, 0] >= tiles[:, 1]]
    bi = TILE * tiles[:, 0, None, None] + np.arange(TILE)[None, :, None]  # (T, I, 1)
    ki = TILE * tiles[:, 1, None, None] + np.arange(TILE)[None, None, :]  # (T, 1, J)
    bi, ki = np.broadcast_arrays(bi, ki)  # (T, I, J)
    keep = (bi < bra.count) & (ki < ket.count)
    if x == y:
        keep &= bi >= ki
    atoms = [shells.atom[c.first[rows]] for c, rows in ((bra, bi), (ket, ki))]
    atoms += [shells.atom[c.second[rows]] for c, rows in ((bra, bi), (ket, ki))]
    keep &= ~((atoms[0] == atoms[1]) & (atoms[0] == atoms[2]) & (atoms[0] == atoms[3]))
    used = keep.any((1, 2)) | every_tile
    if not used.any():
        return None
    tiles, bi, ki, keep = tiles[used], bi[used], ki[used], keep[used]
    destination = _destinations(shells, bra, ket, bi.ravel(), ki.ravel(), x == y)  # (T I J, S_ab, S_cd)
    destination[~keep.ravel()] = NOWHERE
    t, n = len(tiles), TILE
    destination = destination.reshape(t, n, n, *destination.shape[1:]).transpose(0, 1, 3, 2, 4)
    return QuartetClass(x, y, tiles.astype(np.int32), np.ascontiguousarray(destination))


def _one_centre(mol: gto.Mole) -> tuple[np.ndarray, np.ndarray]:
    """The s8 positions and float64 values of every ERI with all four AOs on one atom.

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
            blocks[symbol] = mol.intor("int2e", shls_slice=(shell_start, shell_stop) * 4)  # (n, n, n, n)
        block = blocks[symbol]
        aos = np.arange(ao_start, ao_stop)
        mu, nu = np.tril_indices(len(aos))
        ij = _packed(aos[mu], aos[nu])
        left, right = np.tril_indices(len(ij))
        index.append(_packed(ij[left], ij[right]))
        value.append(block[mu[left], nu[left], mu[right], nu[right]])
    return np.concatenate(index).astype(np.int32), np.concatenate(value)


def _destinations(shells: Shells, bra: PairClass, ket: PairClass, bi, ki, same_class: bool) -> np.ndarray:
    """(Q, S_a S_b, S_c S_d) s8 index of every value of every quartet; NOWHERE for the repeats."""
    def functions(shell, components):  # (Q, S): the spherical AOs of each shell's components in turn
        return np.concatenate([shells.offset[shell, c, None] + np.arange(2 * l + 1) for c, l in enumerate(components)], 1)

    def aos(pair: PairClass, rows):
        a, b = pair.first[rows], pair.second[rows]
        mu, nu = np.broadcast_arrays(functions(a, pair.la)[:, :, None], functions(b, pair.lb)[:, None, :])  # (Q, S_a, S_b)
        # a shell with itself: (mu, nu) and (nu, mu) are one value; keep mu >= nu
        repeat = (a == b)[:, None, None] & (mu < nu)
        return _packed(mu, nu).reshape(len(rows), -1), repeat.reshape(len(rows), -1)

    ij, repeat_bra = aos(bra, bi)
    kl, repeat_ket = aos(ket, ki)
    index = _packed(ij[:, :, None], kl[:, None, :])
    repeat = repeat_bra[:, :, None] | repeat_ket[:, None, :]
    if same_class:  # a pair with itself: (ij|kl) and (kl|ij) are one value; keep ij >= kl
        repeat |= (bi == ki)[:, None, None] & (ij[:, :, None] < kl[:, None, :])
    return np.where(repeat, NOWHERE, index).astype(np.int32)  # plan_eri refuses sizes beyond int32


# ---------------------------------------------------------------------------------------------
# Device side


@lru_cache(maxsize=None)
def _hermite_gather(la: tuple[int, ...], lb: tuple[int, ...]):
    """Index arrays (3 axes) of shape (C_a C_b, H) into a stacked E table (i, j, t), for the Hermite matrix."""
    hermite = hermite_indices(max(la) + max(lb))
    rows = [(pa, pb) for pa in cartesian_functions(la) for pb in cartesian_functions(lb)]
    return tuple(
        (np.array([[pa[axis] for _ in hermite] for pa, _ in rows], np.int32),
         np.array([[pb[axis] for _ in hermite] for _, pb in rows], np.int32),
         np.array([[h[axis] for h in hermite] for _ in rows], np.int32))
        for axis in range(3)
    )  # fmt: skip


@lru_cache(maxsize=None)
def _coulomb_pairs(bra_order: int, ket_order: int) -> np.ndarray:
    """(H_ket, H_bra): the position among R's Hermite indices of h + g, for ket index g and bra index h."""
    position = {h: n for n, h in enumerate(hermite_indices(bra_order + ket_order))}
    return np.array([[position[(h[0] + g[0], h[1] + g[1], h[2] + g[2])] for h in hermite_indices(bra_order)]
                     for g in hermite_indices(ket_order)], np.int32)  # fmt: skip


def _pair_factors(plan: EriPlan, c: PairClass):
    """Host float64 -> (PairFactors, p, c_a c_b / p) for the primitive pairs of a class: (n, K2) each but
    the last, (n, K2, C_a C_b) with the coefficients of each pair of Cartesian functions."""
    sh = plan.shells
    n = len(c.first)
    a, b = sh.exponents[c.first, : c.ka, None], sh.exponents[c.second, None, : c.kb]  # (n, ka, 1), (n, 1, kb)
    p = a + b
    flat = lambda x: np.broadcast_to(x, (n, c.ka, c.kb)).reshape(n, -1)  # noqa: E731

    def cartesian(shell, components, k):  # (n, K, C): each Cartesian function's coefficients, by component
        return np.concatenate([np.repeat(sh.coefficients[shell, m, :k, None], len(cartesian_powers(l)), axis=2)
                               for m, l in enumerate(components)], 2)  # fmt: skip

    ca, cb = cartesian(c.first, c.la, c.ka), cartesian(c.second, c.lb, c.kb)
    coef = ca[:, :, None, :, None] * cb[:, None, :, None, :] / p[..., None, None]  # (n, ka, kb, C_a, C_b)
    return PairFactors(*(flat(x) for x in (0.5 / p, a / p, b / p, a * b / p))), flat(p), coef.reshape(n, c.ka * c.kb, -1)


def _pair_data(la, lb, factors: PairFactors, p, scale, ab):
    """Per shell pair and primitive pair: the Hermite matrix (n, K2, S_a S_b, H) with the coefficients,
    1/p and the spherical transform folded in; P - A as (3, n, K2)."""
    n, k2 = p.shape
    top_a, top_b = max(la), max(lb)
    e = None
    for axis, (i, j, t) in enumerate(_hermite_gather(la, lb)):
        table = hermite_coefficients(top_a, top_b, factors, ab[:, None, axis])
        factor = _stack(table, top_a, top_b, top_a + top_b)[:, :, i, j, t]  # (n, K2, C_a C_b, H)
        e = factor if e is None else e * factor
    e = e * scale[:, :, :, None]
    h = e.shape[-1]
    sa, sb = cartesian_to_spherical(la), cartesian_to_spherical(lb)
    e = e.reshape(n, k2, sa.shape[0], sb.shape[0], h)
    e = jnp.einsum("nkabh,as,bt->nksth", e, jnp.asarray(sa, e.dtype), jnp.asarray(sb, e.dtype))
    pa = -factors.b_frac[None] * ab.T[:, :, None]  # (3, n, K2)
    return e.reshape(n, k2, -1, h), pa


def _ket_signed(ket_order: int, e_ket):
    """The ket's Hermite matrix with the signs (-1)^(tau + nu + phi) of the Coulomb contraction, per ket
    pair as (n, Y, K2k H_k), the layout of a tile's matmul against R."""
    n, k2, y, h = e_ket.shape
    sign = jnp.asarray([(-1.0) ** sum(g) for g in hermite_indices(ket_order)], e_ket.dtype)  # (H_k,)
    return (e_ket * sign).transpose(0, 2, 1, 3).reshape(n, y, k2 * h)


def _tile(bra_order, ket_order, bra, ket, signed):
    """(I, S_a S_b, J, S_c S_d) ERIs of one TILE x TILE square of quartets, from the data of its I bra
    pairs (E (I, K2b, S_ab, H_b), p (I, K2b), P - A (3, I, K2b)) and J ket pairs (p (J, K2k), P - A
    (3, J, K2k), the signed Hermite matrices of :func:`_ket_signed`, and A - C (J, I, 3)).

    Primitive quartets are laid out (J, K2k, I K2b): XLA's CPU loops vectorise along the last axis
    only, and this one is long. R (with the prefactor) is laid out as G[(l, g), (h, i, k)] =
    R_{h+g}(ket primitive pair l, bra pair i, bra primitive pair k), which the ket's signed Hermite
    matrices contract in one matmul per ket pair, (Y, K2k H_k) x (K2k H_k, H_b I K2b); then the
    bra's Hermite matrices contract the result. (A dense (H_b Y, H_R K2k) matrix per ket pair, with
    the sign pattern S[g, h, h + g] spread into it, did the same with 3.5x the multiplications, most
    of them by zero: 9 heavy atoms at STO-3G, 2.9 against 0.8 GFLOP per conformer; the whole ERI
    time 66 -> 55 ms per conformer.)
    """
    e_b, p_b, pa_b = bra
    p_k, pa_k, ket_tile, ac = ket
    m = jax.lax.dynamic_index_in_dim(signed, ket_tile, keepdims=False)  # (J, Y, K2k H_k)
    j, kk = p_k.shape
    i, kb = p_b.shape
    # Every primitive quartet's P - Q (x, y, z), as a batched matmul of pair factors per ket pair,
    # (K2k, 2) x (2, I K2b): it writes them flat and contiguous, where broadcasting costs XLA index
    # arithmetic per element (measured: 3x the whole Boys function). P - Q = ((A - C) + (P - A))
    # - (Q - C), A - C from the host's float64 table; the products are by 1, so the sums are those
    # of the elementwise form.
    dtype = pa_b.dtype
    bra_part = ac.transpose(2, 0, 1)[..., None] + pa_b[:, None]  # (3, J, I, K2b)
    left = jnp.stack([jnp.ones((3, j, kk), dtype), -pa_k], -1)  # (3, J, K2k, 2)
    right = jnp.stack([bra_part.reshape(3, j, -1), jnp.ones((3, j, i * kb), dtype)], 2)  # (3, J, 2, I K2b)
    pq = jnp.matmul(left, right).reshape(3, -1)  # (3, M), M = J K2k I K2b
    # p + q and pq the same way; they do not depend on the geometry (computed once for all conformers)
    left = jnp.stack([p_k.reshape(-1), jnp.ones(j * kk, p_k.dtype)], -1)  # (J K2k, 2)
    total = (left @ jnp.stack([jnp.ones(i * kb, p_b.dtype), p_b.reshape(-1)])).reshape(-1)
    product = (p_k.reshape(-1, 1) @ p_b.reshape(1, -1)).reshape(-1)
    alpha, weight = product / total, 2.0 * math.pi**2.5 / jnp.sqrt(total)
    r = hermite_coulomb(bra_order + ket_order, alpha, pq)
    indices = hermite_indices(bra_order + ket_order)
    r = [jnp.broadcast_to(r[h] * weight, alpha.shape).reshape(j, kk, 1, -1) for h in indices]
    pairs = _coulomb_pairs(bra_order, ket_order)  # (H_k, H_b)
    # laid out by concatenation: a gather of the same (h + g) positions from stacked R was 1.5x slower
    g = jnp.concatenate([r[n] for n in pairs.ravel()], 2)  # (J, K2k, H_k H_b, I K2b)
    t = jnp.matmul(m, g.reshape(j, kk * pairs.shape[0], -1))  # (J, Y, H_b I K2b)
    t = t.reshape(j, -1, pairs.shape[1], i, kb)
    return jnp.einsum("jyhik,ikxh->ixjy", t, e_b)


def _by_tile(x, index, axis=0):
    """The rows of ``x`` (along ``axis``) of tiles ``index`` (T,): (T, ..., TILE, ...) with T leading."""
    shape = x.shape[:axis] + (-1, TILE) + x.shape[axis + 1 :]
    # indices are in range by construction: clip spares the out-of-range select of the default mode
    return jnp.moveaxis(jnp.take(x.reshape(shape), index, axis=axis, mode="clip"), axis, 0)


def eri_s8(plans, coords, dtype=jnp.float32, workers: int | None = None) -> jax.Array:
    """The ERIs packed as PySCF's s8: (size,) for one plan (an :class:`EriPlan`) and atom positions
    ``coords`` (natm, 3) in Bohr, or (C, size) for C conformers (C, natm, 3), computed as one batch.
    ``plans`` is one plan for all conformers, or one per conformer: plans of one size bucket
    (:func:`plan_eri` with the bucket's :class:`EriCapacity`), so that conformers of different
    molecules share the batch; positions beyond a molecule's atoms are ignored.

    Host (numpy) positions have their differences formed in float64 on the host: exact zeros within
    an atom, full precision between atoms, and the per-pair Hermite matrices are computed in
    float64 and rounded once (computed in float32 they carry a systematic error, +1.6e-7 of the
    ERIs on average, which moved 9-heavy-atom energies by +2.5 meV). The quartet tiles are then
    shared out over ``workers`` threads (default: :func:`default_workers`), each running its share
    as its own program: XLA's CPU backend runs a loop fusion on one core.

    JAX positions are differenced on the device and the whole computation runs in ``dtype`` as one
    program (no threads: it may be traced), so the result can be differentiated with respect to
    them (the forces do, in float64).
    """
    single = coords.ndim == 2
    plans = [plans] * (1 if single else coords.shape[0]) if isinstance(plans, EriPlan) else list(plans)
    first = plans[0]
    natm = max(plan.natm for plan in plans)
    if coords.ndim not in (2, 3) or coords.shape[-1] != 3 or not natm <= coords.shape[-2] <= first.padded_natm \
            or len(plans) != (1 if single else coords.shape[0]):  # fmt: skip
        raise ValueError(f"coords has shape {coords.shape}: expected ([conformers,] {natm}, 3), one plan per conformer")
    if any(_static(plan) != _static(first) or plan.padded_natm != first.padded_natm for plan in plans):
        raise ValueError("conformers computed together need plans of one size bucket")
    dtype = jnp.dtype(dtype)
    if single:
        coords = coords[None]
    extra_atoms = [(0, 0), (0, first.padded_natm - coords.shape[1]), (0, 0)]  # own no shell
    pair_arrays = _stacked(tuple(plans), "pairs", dtype.name if isinstance(coords, jax.Array) else "float64")
    if isinstance(coords, jax.Array):
        workers = 1  # one program: it may be traced
        coords = jnp.pad(coords, extra_atoms)
        shifts = (coords[..., :, None, :] - coords[..., None, :, :]).astype(dtype)
        data = _pairs_batch(_static(first)[0], pair_arrays, shifts, dtype.name)
    else:
        workers = default_workers() if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers = {workers}: need at least 1")
        coords = np.pad(np.asarray(coords, np.float64), extra_atoms)
        difference = coords[..., :, None, :] - coords[..., None, :, :]  # (C, natm, natm, 3)
        shifts = jax.device_put(difference.astype(dtype))
        with jax.enable_x64(True):
            data = _pairs_batch(_static(first)[0], pair_arrays, jax.device_put(difference), dtype.name)
    shares = _stacked(tuple(plans), ("quartets", workers), dtype.name)  # (share k's arrays, ...)
    static = _static(first)  # the shares' too: each keeps every quartet class, in order

    def run(k: int) -> jax.Array:
        return _quartets_batch(static, *shares[k], data, shifts)

    # every share runs one program (equal shapes): account for it before the threads start
    _LIVE_PROGRAMS.admit((static, str(jax.tree.map(lambda x: (x.shape, x.dtype.name), (shares[0], data, shifts)))))
    if workers == 1:
        out = _combine((run(0),), first.size)
    else:
        x64 = jax.config.jax_enable_x64  # the caller's, possibly a thread-local jax.enable_x64 context

        def in_thread(k: int) -> jax.Array:
            with jax.enable_x64(x64):  # worker threads do not inherit the caller's context
                return run(k).block_until_ready()  # in this thread: the point is to keep the cores busy at once

        with ThreadPoolExecutor(workers) as pool:
            out = _combine(tuple(pool.map(in_thread, range(workers))), first.size)
    return out[0] if single else out


@partial(compiled, static_argnums=1, name="eri_combine")
def _combine(shares: tuple, size: int) -> jax.Array:
    """The shares' s8 arrays added (each wrote zeros outside its own quartets) and cut to ``size``, in
    one pass: Python's ``sum`` and the slice made three copies of the batch's array (42 MB for 8
    conformers of a 53-AO molecule)."""
    total = shares[0]
    for share in shares[1:]:
        total = total + share
    return total[..., :size]


class _LivePrograms:
    """Keeps the quartet kernels' compiled programs within the process's memory-mapping limit.

    Each compiled program holds its machine code in memory mappings for as long as it is kept: ~700
    per STO-3G program, ~16,000 per 6-31G* one, against the kernel's limit per process
    (``vm.max_map_count``, 65,530 by default; past it LLVM aborts the process). So before a new
    shape runs, if the process already uses more than ``share`` of its limit, the kernels' in-memory
    caches are emptied, which gives the mappings back; the persistent compilation cache reloads a
    program that comes back.
    Where /proc does not tell, at most ``fallback`` shapes are kept.
    """

    def __init__(self, share: float = 0.5, fallback: int = 3):
        self.share, self.fallback = share, fallback
        self.seen: set = set()  # shapes run since the programs were last dropped

    def admit(self, key) -> None:
        if key in self.seen:
            return
        mappings = _memory_mappings()
        if (len(self.seen) >= self.fallback if mappings is None else mappings[0] > self.share * mappings[1]):
            _quartets_batch.clear()
            self.seen.clear()
        self.seen.add(key)


def _memory_mappings() -> tuple[int, int] | None:
    """(memory mappings this process uses, the kernel's limit), or None where /proc does not say."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return None


def default_workers() -> int:
    """Threads for :func:`eri_s8` from host positions: the cores this process may use on a CPU
    backend (capped at 8), one on an accelerator (where programs queue on one device anyway)."""
    if jax.default_backend() != "cpu":
        return 1
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@lru_cache(maxsize=2)  # the shares copy the plan's destinations
def _parts(plan: EriPlan, workers: int) -> tuple[EriPlan, ...]:
    """``plan`` split into ``workers`` plans with disjoint tiles and equal shapes, so that every share,
    and every molecule of similar size, runs one compiled program.

    The tiles of all classes, in order, are dealt out in turn (balanced to a tile per class); each
    share's class is then padded to a bucketed common count with tiles that write NOWHERE (the
    kernel skips them). The one-centre constants are dealt out likewise.
    """
    shares: list[list[QuartetClass]] = [[] for _ in range(workers)]
    dealt = 0
    for q in plan.quartets:
        owner = (dealt + np.arange(len(q.tiles))) % workers
        dealt += len(q.tiles)
        count = bucket(-(-len(q.tiles) // workers), minimum=1)
        for k in range(workers):
            mine = owner == k
            extra = count - int(mine.sum())
            tiles = np.concatenate([q.tiles[mine], np.repeat(q.tiles[:1], extra, axis=0)])
            nowhere = np.full((extra,) + q.destination.shape[1:], NOWHERE, np.int32)
            shares[k].append(QuartetClass(q.bra, q.ket, tiles, np.concatenate([q.destination[mine], nowhere])))
    count = bucket(-(-plan.one_centre_count // workers), minimum=64)

    def one_centre(values: np.ndarray, k: int, fill) -> np.ndarray:
        mine = values[k::workers]
        return np.pad(mine, (0, count - len(mine)), constant_values=fill)

    return tuple(replace(plan, quartets=tuple(share), one_centre_index=one_centre(plan.one_centre_index, k, NOWHERE),
                         one_centre_value=one_centre(plan.one_centre_value, k, 0.0))
                 for k, share in enumerate(shares))  # fmt: skip


def _static(plan: EriPlan):
    return (tuple((c.la, c.lb) for c in plan.pairs), tuple((q.bra, q.ket) for q in plan.quartets), plan.padded_size)


def _host_arrays(plan: EriPlan, what, dtype: str) -> tuple:
    """One plan's kernel inputs as host arrays: ``"pairs"``, the pair classes' exponent factors
    (``dtype``) and atoms; ``("quartets", workers)``, per share of :func:`_parts`, the tiles, whether
    each has anything to compute, and s8 destinations of every quartet class, and the share's
    one-centre positions and values."""
    if what == "pairs":
        out = []
        for c in plan.pairs:
            factors, p, scale = _pair_factors(plan, c)
            atoms = (plan.shells.atom[c.first].astype(np.int32), plan.shells.atom[c.second].astype(np.int32))
            out.append((tuple(np.asarray(f, dtype) for f in factors), np.asarray(p, dtype), np.asarray(scale, dtype))
                       + atoms)  # fmt: skip
        return tuple(out)
    _, workers = what
    return tuple((tuple((q.tiles, (q.destination != NOWHERE).any((1, 2, 3, 4)), q.destination.reshape(-1))
                        for q in part.quartets),
                  (part.one_centre_index, np.asarray(part.one_centre_value, dtype)))
                 for part in _parts(plan, workers))  # fmt: skip


@lru_cache(maxsize=4)  # a batch's arrays: the destinations of a 6-31G* plan alone are ~200 MB
def _stacked(plans: tuple[EriPlan, ...], what, dtype: str):
    """:func:`_host_arrays` of each plan, stacked along a leading conformer axis, on the device once
    per batch of plans (a batch of one molecule's conformers reuses them)."""
    per_plan = {id(plan): _host_arrays(plan, what, dtype) for plan in plans}
    members = [per_plan[id(plan)] for plan in plans]
    return jax.device_put(jax.tree.map(lambda *xs: np.stack(xs), *members))  # one transfer, no per-array program


def _pair_stage(pair_l, pair_arrays, shifts, dtype: str):
    """Per pair class: (Hermite matrices, p, P - A, first atom), from the atoms' differences ``shifts``,
    rounded to ``dtype`` inside the program (cast outside it, op by op, they were a dozen small
    programs that every new process compiled again)."""
    data = []
    for (la, lb), ((half, a_frac, b_frac, mu), p, scale, atom_a, atom_b) in zip(pair_l, pair_arrays):
        factors = PairFactors(half, a_frac, b_frac, mu)
        e, pa = _pair_data(la, lb, factors, p, scale, shifts[atom_a, atom_b])
        data.append((e.astype(dtype), p.astype(dtype), pa.astype(dtype), atom_a))
    return tuple(data)


def _quartet_stage(static, quartet_arrays, one_centre, data, shifts):
    """The s8 array: the one-centre constants, then every quartet class's tiles (those with nothing
    to compute, the padding of a size bucket's full tile grids, are skipped)."""
    pair_l, quartet_classes, size = static
    one_centre_index, one_centre_value = one_centre
    out = jnp.zeros(size, shifts.dtype).at[one_centre_index].set(one_centre_value.astype(shifts.dtype), mode="drop")
    for (x, y), (tiles, active, destination) in zip(quartet_classes, quartet_arrays):
        orders = tuple(max(la) + max(lb) for la, lb in (pair_l[x], pair_l[y]))  # Hermite orders of bra, ket
        (e_bra, p_bra, pa_bra, atom_bra), (e_ket, p_ket, pa_ket, atom_ket) = data[x], data[y]
        # each tile's pairs gathered up front: the kernel then only reads its own slice
        bra = (_by_tile(e_bra, tiles[:, 0]), _by_tile(p_bra, tiles[:, 0]), _by_tile(pa_bra, tiles[:, 0], 1))
        ac = shifts[_by_tile(atom_bra, tiles[:, 0])[:, None, :], _by_tile(atom_ket, tiles[:, 1])[:, :, None]]  # (T, J, I, 3)
        ket = (_by_tile(p_ket, tiles[:, 1]), _by_tile(pa_ket, tiles[:, 1], 1), tiles[:, 1], ac)
        # the ket's signed Hermite matrices (Y x K2k H_k per pair): indexed per tile, not copied per tile
        signed = _ket_signed(orders[1], e_ket)
        signed = signed.reshape(-1, TILE, *signed.shape[1:])
        shape = (TILE, e_bra.shape[2], TILE, e_ket.shape[2])

        def tile(arguments, orders=orders, signed=signed, shape=shape):
            work, bra_tile, ket_tile = arguments
            return jax.lax.cond(work, lambda: _tile(*orders, bra_tile, ket_tile, signed),
                                lambda: jnp.zeros(shape, shifts.dtype))  # fmt: skip

        # checkpointed: a gradient recomputes each tile instead of keeping every tile's Boys values
        values = jax.lax.map(jax.checkpoint(tile), (active, bra, ket))
        out = out.at[destination].set(values.reshape(-1), mode="drop", unique_indices=True)
    return out


# Conformers vmapped: the pair stage is small and elementwise.
_pairs_batch = compiled(
    lambda pair_l, arrays, shifts, dtype: jax.vmap(lambda a, s: _pair_stage(pair_l, a, s, dtype))(arrays, shifts),
    static_argnums=(0, 3), name="eri_pairs")
# Conformers one after another inside the program (lax.map), not vmapped into every tile: a tile's
# arrays then stay cache-sized (measured, 8 conformers of a 53-AO molecule on 2 cores: vmap 306 ms
# per conformer with 1 worker and 218 with 2; map 280 and 133).
_quartets_batch = compiled(
    lambda static, quartet_arrays, one_centre, data, shifts: jax.lax.map(
        lambda member: _quartet_stage(static, *member), (quartet_arrays, one_centre, data, shifts)),
    static_argnums=0, name="eri_quartets")
_LIVE_PROGRAMS = _LivePrograms()
