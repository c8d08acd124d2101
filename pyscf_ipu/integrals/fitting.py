r"""The density-fitted ERIs' factor on the device: the 3-centre integrals (ij|P) and the metric (P|Q) by
McMurchie-Davidson, then B = L^{-1} (Q|ij) with L L^T = (P|Q), in float64.

A fitting function P is a Gaussian shell on its own; the kernels of :mod:`.eri_kernels` take it as
a shell pair whose second shell is a **companion**: an s function of exponent 0 on the same atom,
whose coefficient makes it exactly 1 (its Hermite expansion is P's own). So (ij|P) is a quartet of
an orbital pair and a fitting "pair", and (P|Q) one of two fitting "pairs", and the chunk kernel of
the four-centre ERIs computes both. Each side's pair classes of one angular momentum pattern form a
:class:`FlatGroup`, one primitive pair per row, so that one kernel serves every primitive count (a
kernel per class made programs that took minutes to compile); the values of a row go to its pair's
destination, where a contracted pair's primitives add up. A value of orbital pair ij and fitting
function Q goes to Q npair + ij, one of P and Q to P Qp + Q. The pairs (ij) are i >= j of the
padded AOs in PySCF's packing; padding fitting functions (a slot's element has fewer than its
kind's layout) have zero integrals and a unit metric diagonal, so their rows of B are zero. The
factor is what ``df.incore.cholesky_eri`` makes (J. L. Whitten, J. Chem. Phys. 58, 4496 (1973);
Vahtras, Almlof and Feyereisen, Chem. Phys. Lett. 213, 514 (1993)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from pyscf.df import incore

from ..programs import compiled, map_members, members_at_once, on_device
from .eri_kernels import by_chunk, chunk_of, ket_signed, stacked_coulomb, unrolled_coulomb
from .eri_plan import CHUNK, NOWHERE, EriPlan, PairClass, packed_pairs
from ..padding import padded_size

# The companion's coefficient: libcint's s functions carry 1/sqrt(4 pi), so this makes it exactly 1.
COMPANION_COEFFICIENT = math.sqrt(4.0 * math.pi)
# A long-range metric's eigenvalues at or below this are dropped: PySCF's own threshold, which the host's
# factor (pyscf_ipu.prepare.fitted_eri, through df.incore.cholesky_eri) drops at
LONG_RANGE_LINEAR_DEPENDENCE = incore.LINEAR_DEP_THR


@dataclass(frozen=True)
class FlatGroup:
    """Pair classes of one angular momentum pattern, each pair's primitive pairs laid out as rows of
    their own (so that one kernel serves every primitive count), padded to whole chunks: each row's
    destination part (an orbital pair's packed index, or a fitting function's), repeated over a pair's
    primitives, whose values the scatter then adds up; NOWHERE for repeats and padding."""

    members: tuple[tuple[int, int], ...]  # (pair class in the stage's data, its primitive pairs K2), in order
    components: tuple[tuple[int, ...], tuple[int, ...]]  # (l_a, l_b) of every member
    index: np.ndarray  # (rows, S_a S_b) int32, rows a multiple of CHUNK


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: device arrays are cached per plan
class FittingPlan:
    """A size bucket's 3-centre and metric integrals: the fitting shells as pairs with their
    companions, appended to the orbital plan's pair classes, and both sides' classes gathered into
    :class:`FlatGroup`s by angular momentum (the bra side of the 3-centre integrals: the orbital
    pairs'; the ket side, and both sides of the metric: the fitting functions')."""

    orbital: EriPlan
    pairs: tuple[PairClass, ...]  # the fitting shells' "pairs" (la = (l,), lb = (0,)); second: the companion
    shell_atom: np.ndarray  # (S_f + natm,) the atom of each fitting shell, then each atom's companion
    orbital_groups: tuple[FlatGroup, ...]
    fitting_groups: tuple[FlatGroup, ...]
    naux: int  # fitting functions (Qp)
    npair: int  # orbital pairs i >= j of the padded AOs


def _rows(members: np.ndarray) -> np.ndarray:
    """``members`` padded with its first to whole chunks, rounded up (as the orbital plan's classes)."""
    padded = CHUNK * padded_size(-(-len(members) // CHUNK), minimum=1)
    return np.concatenate([members, np.repeat(members[:1], padded - len(members))])


def _flat_groups(classes: list[PairClass], indices: list[np.ndarray], first: int) -> tuple[FlatGroup, ...]:
    """``classes`` (their destination parts ``indices``, rows by pair) as :class:`FlatGroup`s: one per
    (l_a, l_b), each class's pairs repeated over their primitive pairs; class k is ``first + k`` in the
    stage's data."""
    groups: dict[tuple, list[int]] = {}
    for k, c in enumerate(classes):
        groups.setdefault((c.la, c.lb), []).append(k)
    out = []
    for components, members in sorted(groups.items()):
        rows = np.concatenate([np.repeat(indices[k], classes[k].ka * classes[k].kb, axis=0) for k in members])
        padded = CHUNK * -(-len(rows) // CHUNK)
        rows = np.concatenate([rows, np.full((padded - len(rows), rows.shape[1]), NOWHERE, np.int32)])
        out.append(FlatGroup(tuple((first + k, classes[k].ka * classes[k].kb) for k in members), components,
                             rows.astype(np.int32)))  # fmt: skip
    return tuple(out)


def plan_fitting(orbital: EriPlan, atom: np.ndarray, l: np.ndarray, primitives: np.ndarray, natm: int) -> FittingPlan:
    """The :class:`FittingPlan` of fitting shells on atoms ``atom`` (S_f,) with angular momenta ``l``
    and primitive counts ``primitives``, their functions in this order, beside ``orbital``."""
    sizes = 2 * np.asarray(l) + 1
    offset = np.concatenate([[0], np.cumsum(sizes)])[:-1]
    count = len(atom)
    pairs, functions = [], []
    for key in sorted(set(zip(l.tolist(), primitives.tolist()))):
        members = np.flatnonzero((l == key[0]) & (primitives == key[1]))
        rows = _rows(members)
        pairs.append(PairClass((key[0],), (0,), key[1], 1, len(members), rows, count + atom[rows]))
        index = offset[rows, None] + np.arange(2 * key[0] + 1)[None, :]
        index[len(members):] = NOWHERE
        functions.append(index.astype(np.int32))
    npad = orbital.nao
    orbital_groups = _flat_groups(list(orbital.pairs), [_pair_functions(orbital, c) for c in orbital.pairs], 0)
    fitting_groups = _flat_groups(pairs, functions, len(orbital.pairs))
    shell_atom = np.concatenate([atom, np.arange(natm)]).astype(np.int32)
    return FittingPlan(orbital, tuple(pairs), shell_atom, orbital_groups, fitting_groups, int(sizes.sum()),
                       npad * (npad + 1) // 2)  # fmt: skip


def _pair_functions(plan: EriPlan, pair: PairClass) -> np.ndarray:
    """(rows, S_a S_b) int32: the packed index (i >= j) of each AO pair of each of the class's shell
    pairs; NOWHERE for a shell with itself's repeats (i < j) and for padding rows."""
    shells = plan.shells

    def functions(shell, components):  # (rows, S): the spherical AOs of each shell's components in turn
        return np.concatenate([shells.offset[shell, c, None] + np.arange(2 * l + 1) for c, l in enumerate(components)], 1)

    a, b = pair.first, pair.second
    mu, nu = np.broadcast_arrays(functions(a, pair.la)[:, :, None], functions(b, pair.lb)[:, None, :])
    index = np.where((a == b)[:, None, None] & (mu < nu), NOWHERE, packed_pairs(mu, nu)).reshape(len(a), -1)
    index[pair.count :] = NOWHERE
    return index.astype(np.int32)


def flattened(members, rows: int, data, atom_fields: int = 1) -> tuple:
    """A group's pair data (its ``members``' classes in ``data``) as rows of one primitive pair each (the
    kernel's K2 = 1), padded to ``rows``: (E (R, 1, S, H), p (R, 1), P - A (3, R, 1), then the first
    ``atom_fields`` atom fields (R,) each: the first atom, and for a derivative's data the second);
    padding p = 1 (no division by zero) and E = 0 (no values)."""
    parts = [data[k] for k, _ in members]
    e = jnp.concatenate([d[0].reshape(-1, 1, *d[0].shape[2:]) for d in parts])
    p = jnp.concatenate([d[1].reshape(-1, 1) for d in parts])
    pa = jnp.concatenate([d[2].reshape(3, -1, 1) for d in parts], axis=1)
    atoms = [jnp.concatenate([jnp.repeat(d[3 + f], k2) for d, (_, k2) in zip(parts, members)])
             for f in range(atom_fields)]  # fmt: skip
    extra = rows - e.shape[0]
    return (jnp.pad(e, [(0, extra), (0, 0), (0, 0), (0, 0)]), jnp.pad(p, [(0, extra), (0, 0)], constant_values=1.0),
            jnp.pad(pa, [(0, 0), (0, extra), (0, 0)]), *(jnp.pad(a, (0, extra)) for a in atoms))  # fmt: skip


def hermite_order(components) -> int:
    return max(components[0]) + max(components[1])


class SquareKernel(NamedTuple):
    """What a stage's kernels compute: distributions ``raised`` orders above the bra's (a
    derivative's are one up), of the operator of range separation ``omega`` (0: 1/r; else the
    long-range erf(ω r)/r, :func:`~.eri_kernels.chunk_of`), R laid out by
    :func:`~.eri_kernels.stacked_coulomb` in pairs of groups of at most ``compact_chunks`` squares
    (a fraction of the compile time, each square slower), else by
    :func:`~.eri_kernels.unrolled_coulomb`."""

    raised: int = 0
    omega: float | jax.Array = 0.0
    compact_chunks: int = 0


def scan_squares(bra, ket, shifts, batch: int, carry, consume, kernel: SquareKernel = SquareKernel()):
    """Every (bra group | ket group) of one stage, ``batch`` CHUNK x CHUNK squares of rows at a time,
    handed to ``consume(carry, values, rows, columns, valid, bra atoms, ket atoms) -> carry``: the
    values (B, I, Y_a, J, Y_b), each row's and column's destination parts (B, I, S_a) and (B, J, S_b),
    whether a value has a destination (B, I, S_a, J, S_b), and each side's atoms (per atom field,
    (B, I) or (B, J)). ``bra`` and ``ket``: per group (its components, its flattened data: (E, p,
    P - A, atom fields...), its destination parts); ``kernel``: what the values are
    (:class:`SquareKernel`). Only one step's values are ever held."""
    raised, omega, compact_chunks = kernel
    for (bra_components, (e_bra, p_bra, pa_bra, *atoms_bra), bra_index) in bra:
        for (ket_components, (e_ket, p_ket, pa_ket, *atoms_ket), ket_index) in ket:
            orders = (hermite_order(bra_components) + raised, hermite_order(ket_components))
            signed = ket_signed(orders[1], e_ket)
            signed = signed.reshape(-1, CHUNK, *signed.shape[1:])
            chunks = np.stack(np.meshgrid(np.arange(len(bra_index) // CHUNK), np.arange(len(ket_index) // CHUNK),
                                          indexing="ij"), -1).reshape(-1, 2)  # fmt: skip
            steps = -(-len(chunks) // batch)
            coulomb = stacked_coulomb if len(chunks) <= compact_chunks else unrolled_coulomb
            real = np.arange(steps * batch) < len(chunks)  # padding steps repeat chunk 0, and add nothing
            chunks = np.concatenate([chunks, np.zeros((steps * batch - len(chunks), 2), chunks.dtype)])

            def step(carry, xs, bra=(e_bra, p_bra, pa_bra, atoms_bra, bra_index),
                     ket=(p_ket, pa_ket, atoms_ket, ket_index), signed=signed, orders=orders, coulomb=coulomb):  # fmt: skip
                (e_b, p_b, pa_b, atoms_b, bra_index), (p_k, pa_k, atoms_k, ket_index) = bra, ket
                chunks, real = xs  # (B, 2), (B,)
                first, second = chunks[:, 0], chunks[:, 1]
                atoms_b = [by_chunk(a, first) for a in atoms_b]  # (B, I) each
                atoms_k = [by_chunk(a, second) for a in atoms_k]  # (B, J) each
                left = (by_chunk(e_b, first), by_chunk(p_b, first), by_chunk(pa_b, first, 1))
                ac = shifts[atoms_b[0][:, None, :], atoms_k[0][:, :, None]]
                right = (by_chunk(p_k, second), by_chunk(pa_k, second, 1), second, ac)
                # (B, I, Y_a, J, Y_b)
                values = jax.vmap(lambda l, r: chunk_of(*orders, l, r, signed, omega, coulomb))(left, right)
                rows = by_chunk(bra_index, first)  # (B, I, S_a)
                columns = by_chunk(ket_index, second)  # (B, J, S_b)
                valid = ((rows != NOWHERE)[:, :, :, None, None] & (columns != NOWHERE)[:, None, None, :, :]
                         & real[:, None, None, None, None])  # fmt: skip
                return consume(carry, values, rows, columns, valid, atoms_b, atoms_k), None

            carry, _ = jax.lax.scan(step, carry, (jnp.asarray(chunks.reshape(steps, batch, 2), jnp.int32),
                                                  jnp.asarray(real.reshape(steps, batch))))  # fmt: skip
    return carry


def _stage(bra, ket, shifts, size: int, width: int, batch: int, kernel: SquareKernel):
    """Every (bra group | ket group) of one stage (:func:`scan_squares`), added into a flat (size,)
    array: the value of bra row i's function s and ket row j's function t goes to ket_index[j, t] *
    width + bra_index[i, s] (a contracted pair's or function's primitives add up there)."""
    index_dtype = jnp.int32 if size < np.iinfo(np.int32).max else jnp.int64

    def add(out, values, rows, columns, valid, *_):
        rows, columns = rows.astype(index_dtype), columns.astype(index_dtype)
        destination = jnp.where(valid, columns[:, None, None, :, :] * width + rows[:, :, :, None, None], size)
        return out.at[destination.reshape(-1)].add(values.reshape(-1), mode="drop")

    return scan_squares(bra, ket, shifts, batch, jnp.zeros(size, shifts.dtype), add, kernel)


def fitted_integrals(static, indices, data, shifts, present, batch: int, omega, compact_chunks: int = 0):
    """One conformer's 3-centre integrals T (Qp, npair) and metric M (Qp, Qp) in the precision of its
    pair ``data`` (float64), from the orbital and fitting pair data (the orbital plan's classes, then
    the fitting ones), the atoms' differences ``shifts`` and which fitting functions are there,
    ``present`` (Qp,); the metric of a padding function is a unit diagonal. ``static``: per side,
    each group's (members, components), then Qp, npair and the operator's range separation ω
    (:func:`fitting_static`); ``indices``: per side, each group's destination parts; ``omega``: the
    operator's (the static part's, or an array that picks the operator at run time); ``compact_chunks``: see
    :func:`scan_squares`."""
    orbital, fitting, naux, npair, _ = static
    orbital, fitting = groups_of(orbital, indices[0], data), groups_of(fitting, indices[1], data)
    kernel = SquareKernel(0, omega, compact_chunks)
    three = _stage(orbital, fitting, shifts, naux * npair, npair, batch, kernel)
    metric = _stage(fitting, fitting, shifts, naux * naux, naux, batch, kernel)
    return three.reshape(naux, npair), metric.reshape(naux, naux) + jnp.diag(jnp.where(present, 0.0, 1.0))


def groups_of(groups, group_indices, data, atom_fields: int = 1) -> list:
    """Each group of one side as (components, its :func:`flattened` ``data``, its destination parts)."""
    return [(components, flattened(members, len(index), data, atom_fields), index)
            for (members, components), index in zip(groups, group_indices)]  # fmt: skip


def factor_member(static, indices, data, shifts, present, omega, batch: int):
    """One conformer's factor B = L^-1 T (Qp, npair), L L^T = M, of :func:`fitted_integrals`, of the
    operator of range separation ``omega`` (an array known at run time, read where the static part is
    a range-separated run's, :func:`fitting_static`; else the Coulomb operator's).

    The long-range operator's metric is only positive semi-definite (erf(ω r)/r cannot tell apart
    fitting functions that differ only at short range: about 1e-15 of its largest eigenvalue for water
    at 6-31G*), and then has no Cholesky factor. There, as PySCF's ``df.incore.cholesky_eri`` does when
    Cholesky fails, M = U w U^T and B = w^-1/2 U^T T over the eigenvalues above
    :data:`LONG_RANGE_LINEAR_DEPENDENCE`, the dropped directions' rows zero: B^T B = T^T M^+ T either way."""
    separated = static[-1]  # (fitting_static)
    omega = omega if separated else 0.0
    three, metric = fitted_integrals(static, indices, data, shifts, present, batch, omega)
    lower = jnp.linalg.cholesky(metric)  # NaN where there is none
    solved = jax.scipy.linalg.solve_triangular(lower, three, lower=True)
    if not separated:  # the Coulomb metric: positive definite
        return solved
    u, inverse = kept_eigen(metric)
    pseudo = (u * jnp.sqrt(inverse)).T @ three
    return jnp.where(jnp.all(jnp.isfinite(lower)), solved, pseudo)


def kept_eigen(metric):
    """(U (Qp, Qp), 1/w (Qp,)) of a metric M = U w U^T that may be singular: the reciprocal eigenvalues
    above :data:`LONG_RANGE_LINEAR_DEPENDENCE`, 0 for the directions dropped (M's pseudo-inverse is
    U diag(1/w) U^T), as PySCF's ``df.incore.cholesky_eri`` drops them."""
    w, u = jnp.linalg.eigh(metric)
    kept = w > LONG_RANGE_LINEAR_DEPENDENCE
    return u, jnp.where(kept, 1.0 / jnp.where(kept, w, 1.0), 0.0)


def _factor_program(static, indices, members, omega, batch: int, dtype: str, at_once: int):
    """:func:`factor_member` of the batch's conformers (``members``: their pair data, differences and
    fitting functions there), ``at_once`` of them together (:func:`~pyscf_ipu.programs.map_members`):
    (the factors in float64, and rounded to ``dtype``) (C, Qp, npair) each."""
    exact = map_members(lambda member: factor_member(static, indices, *member, omega, batch), members, at_once)
    return exact, exact.astype(dtype)


factor_program = compiled(_factor_program, static_argnums=(0, 4, 5, 6), name="fitted_factor")


def fitting_static(plan: FittingPlan, separated: bool = False) -> tuple:
    """The compile-time part of ``plan`` (see :func:`factor_member`): per side, each group's (members,
    components), Qp, npair, and whether the program serves a range-separated run, taking the operator's
    ω (0: Coulomb; else the long-range erf(ω r)/r) at run time, so that one program makes both factors."""
    side = lambda groups: tuple((g.members, g.components) for g in groups)  # noqa: E731
    return side(plan.orbital_groups), side(plan.fitting_groups), plan.naux, plan.npair, bool(separated)


@lru_cache(maxsize=4)
def plan_indices(plan: FittingPlan) -> tuple:
    """Each group's destination parts on the device, per side (once per plan)."""
    return on_device((tuple(g.index for g in plan.orbital_groups), tuple(g.index for g in plan.fitting_groups)))


def fitted_factor(plan: FittingPlan, data, shifts, present, batch: int, dtype: str, omega: float = 0.0,
                  separated: bool = False):  # fmt: skip
    """The factors (C, Qp, npair) of a batch, in float64 and rounded to ``dtype``, from its pair data
    (the orbital classes', then the fitting ones'), differences ``shifts`` (C, natm, natm, 3) and fitting
    functions ``present`` (C, Qp), of the Coulomb operator or (``omega`` > 0) the long-range erf(ω r)/r;
    ``separated``: the run's functional is range-separated (both operators' factors, one program).
    Dispatched, not waited for."""
    # a conformer's three-centre integrals and its factor, in float64; a range-separated run's also
    # its Cholesky solve and its eigenvectors' (naux, naux) and product
    values = (3 * plan.npair + 2 * plan.naux) * plan.naux if separated else 2 * plan.naux * plan.npair
    at_once = members_at_once(present.shape[0], 8 * values)
    return factor_program(fitting_static(plan, separated), plan_indices(plan), (data, shifts, present),
                          np.float64(omega), batch, dtype, at_once)  # fmt: skip


def fitting_kinds(plan: FittingPlan) -> tuple:
    """The fitting "pairs"' (l_a, l_b, K_a, K_b), as the pair stage takes them."""
    return tuple((c.la, c.lb, c.ka, c.kb) for c in plan.pairs)


@lru_cache(maxsize=4)
def fitting_structure(plan: FittingPlan):
    """The fitting pair stage's index arrays on the device: per fitting class (shells, companions,
    their atoms)."""
    atom = plan.shell_atom
    return on_device(tuple((c.first.astype(np.int32), c.second.astype(np.int32), atom[c.first], atom[c.second])
                           for c in plan.pairs))  # fmt: skip

