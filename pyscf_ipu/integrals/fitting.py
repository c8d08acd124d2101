r"""The density-fitted ERIs' factor on the device: the 3-centre integrals (ij|P) and the metric (P|Q) by
McMurchie-Davidson, then B = L^{-1} (Q|ij) with L L^T = (P|Q), in float64.

A fitting function P is a Gaussian shell on its own; the kernels of :mod:`.eri_kernels` take it as
a shell pair whose second shell is a **companion**: an s function of exponent 0 on the same atom,
whose coefficient makes it exactly 1 (its Hermite expansion is P's own). So (ij|P) is a quartet of
an orbital pair and a fitting "pair", and (P|Q) one of two fitting "pairs", and the chunk kernel of
the four-centre ERIs computes both. Their destinations separate into a bra part and a ket part: a
value of orbital pair ij and fitting function Q goes to Q npair + ij, one of P and Q to P Qp + Q,
so the plan (:class:`FittingPlan`) holds each class's pair and function indices, not one index per
value. The pairs (ij) are i >= j of the padded AOs in PySCF's packing; padding fitting functions
(a slot's element has fewer than its kind's layout) have zero integrals and a unit metric diagonal,
so their rows of B are zero. The factor is what ``df.incore.cholesky_eri`` makes (J. L. Whitten,
J. Chem. Phys. 58, 4496 (1973); Vahtras, Almlof and Feyereisen, Chem. Phys. Lett. 213, 514 (1993)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from ..programs import compiled, on_device
from .eri_kernels import _by_chunk, _chunk, _ket_signed
from .eri_plan import CHUNK, NOWHERE, EriPlan, PairClass, _packed
from ..padding import padded_size

# The companion's coefficient: libcint's s functions carry 1/sqrt(4 pi), so this makes it exactly 1.
COMPANION_COEFFICIENT = math.sqrt(4.0 * math.pi)


@dataclass(frozen=True)
class FittedClass:
    """The (bra class | ket class) quartets of the factor's integrals, in CHUNK x CHUNK squares of
    pairs, with each bra and ket row's destinations (NOWHERE for repeats and padding)."""

    bra: int  # pair class of the bra, in the stage's list
    ket: int  # pair class of the ket
    chunks: np.ndarray  # (T, 2) int32  bra chunk and ket chunk of each square
    bra_index: np.ndarray  # (rows of bra, S_ab) int32  orbital pair (3-centre) or fitting function (metric)
    ket_index: np.ndarray  # (rows of ket, S_P) int32  fitting function


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: device arrays are cached per plan
class FittingPlan:
    """A size bucket's 3-centre and metric integrals: the fitting shells as pairs with their
    companions, appended to the orbital plan's pair classes (the bra side of the 3-centre ones)."""

    orbital: EriPlan
    pairs: tuple[PairClass, ...]  # the fitting shells' "pairs" (la = (l,), lb = (0,)); second: the companion
    shell_atom: np.ndarray  # (S_f + natm,) the atom of each fitting shell, then each atom's companion
    three: tuple[FittedClass, ...]  # bra: an orbital class; ket: a fitting class
    metric: tuple[FittedClass, ...]  # bra and ket: fitting classes
    naux: int  # fitting functions (Qp)
    npair: int  # orbital pairs i >= j of the padded AOs


def _rows(members: np.ndarray) -> np.ndarray:
    """``members`` padded with its first to whole chunks, bucketed (as the orbital plan's classes)."""
    padded = CHUNK * padded_size(-(-len(members) // CHUNK), minimum=1)
    return np.concatenate([members, np.repeat(members[:1], padded - len(members))])


def plan_fitting(orbital: EriPlan, atom: np.ndarray, l: np.ndarray, primitives: np.ndarray, natm: int) -> FittingPlan:
    """The :class:`FittingPlan` of fitting shells on atoms ``atom`` (S_f,) with angular momenta ``l``
    and primitive counts ``primitives``, their functions in this order, beside ``orbital``."""
    sizes = 2 * np.asarray(l) + 1
    offset = np.concatenate([[0], np.cumsum(sizes)])[:-1]
    naux = int(sizes.sum())
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
    orbital_index = [_pair_functions(orbital, c) for c in orbital.pairs]
    first = len(orbital.pairs)
    three = tuple(_fitted_class(x, first + y, orbital_index[x], functions[y])
                  for x in range(len(orbital.pairs)) for y in range(len(pairs)))  # fmt: skip
    metric = tuple(_fitted_class(x, y, functions[x], functions[y]) for x in range(len(pairs)) for y in range(len(pairs)))
    shell_atom = np.concatenate([atom, np.arange(natm)]).astype(np.int32)
    return FittingPlan(orbital, tuple(pairs), shell_atom, three, metric, naux, npad * (npad + 1) // 2)


def _pair_functions(plan: EriPlan, pair: PairClass) -> np.ndarray:
    """(rows, S_a S_b) int32: the packed index (i >= j) of each AO pair of each of the class's shell
    pairs; NOWHERE for a shell with itself's repeats (i < j) and for padding rows."""
    shells = plan.shells

    def functions(shell, components):  # (rows, S): the spherical AOs of each shell's components in turn
        return np.concatenate([shells.offset[shell, c, None] + np.arange(2 * l + 1) for c, l in enumerate(components)], 1)

    a, b = pair.first, pair.second
    mu, nu = np.broadcast_arrays(functions(a, pair.la)[:, :, None], functions(b, pair.lb)[:, None, :])
    index = np.where((a == b)[:, None, None] & (mu < nu), NOWHERE, _packed(mu, nu)).reshape(len(a), -1)
    index[pair.count :] = NOWHERE
    return index.astype(np.int32)


def _fitted_class(x: int, y: int, bra: np.ndarray, ket: np.ndarray) -> FittedClass:
    ti, tj = np.meshgrid(np.arange(len(bra) // CHUNK), np.arange(len(ket) // CHUNK), indexing="ij")
    return FittedClass(x, y, np.stack([ti.ravel(), tj.ravel()], 1).astype(np.int32), bra, ket)


def _stage(classes, static, data, shifts, size: int, width: int, batch: int):
    """The values of one stage's classes written to a flat (size,) array: value (bra row i, its
    function s, ket row j, its function t) to ket_index[j, t] * width + bra_index[i, s]."""
    kinds, keys = static
    out = jnp.zeros(size, shifts.dtype)
    for (x, y), (chunks, bra_index, ket_index) in zip(keys, classes):
        orders = tuple(max(kinds[c][0]) + max(kinds[c][1]) for c in (x, y))
        (e_bra, p_bra, pa_bra, atom_bra, _), (e_ket, p_ket, pa_ket, atom_ket, _) = data[x], data[y]
        bra = (_by_chunk(e_bra, chunks[:, 0]), _by_chunk(p_bra, chunks[:, 0]), _by_chunk(pa_bra, chunks[:, 0], 1))
        ac = shifts[_by_chunk(atom_bra, chunks[:, 0])[:, None, :], _by_chunk(atom_ket, chunks[:, 1])[:, :, None]]
        ket = (_by_chunk(p_ket, chunks[:, 1]), _by_chunk(pa_ket, chunks[:, 1], 1), chunks[:, 1], ac)
        signed = _ket_signed(orders[1], e_ket)
        signed = signed.reshape(-1, CHUNK, *signed.shape[1:])
        values = jax.lax.map(lambda arguments, orders=orders, signed=signed: _chunk(*orders, *arguments, signed),
                             (bra, ket), batch_size=batch)  # (T, I, S_ab, J, S_P)  # fmt: skip
        rows, columns = _by_chunk(bra_index, chunks[:, 0]), _by_chunk(ket_index, chunks[:, 1])  # (T, I, S_ab), (T, J, S_P)
        valid = (rows != NOWHERE)[:, :, :, None, None] & (columns != NOWHERE)[:, None, None, :, :]
        destination = jnp.where(valid, columns[:, None, None, :, :] * width + rows[:, :, :, None, None], NOWHERE)
        out = out.at[destination.reshape(-1)].set(values.reshape(-1), mode="drop", unique_indices=True)
    return out


def factor_member(static, plan_arrays, data, shifts, present, batch: int):
    """One conformer's factor B (Qp, npair) in the precision of its pair ``data`` (float64), from
    the orbital and fitting pair data, the atoms' differences ``shifts`` and which fitting functions
    are there, ``present`` (Qp,)."""
    three_static, metric_static, naux, npair, orbital_classes = static
    three_classes, metric_classes = plan_arrays
    three = _stage(three_classes, three_static, data, shifts, naux * npair, npair, batch).reshape(naux, npair)
    metric = _stage(metric_classes, metric_static, data[orbital_classes:], shifts, naux * naux, naux, batch)
    metric = metric.reshape(naux, naux) + jnp.diag(jnp.where(present, 0.0, 1.0))  # padding: a unit diagonal
    lower = jnp.linalg.cholesky(metric)
    return jax.scipy.linalg.solve_triangular(lower, three, lower=True)


def _factor_program(static, plan_arrays, data, shifts, present, batch: int, dtype: str):
    """:func:`factor_member` of conformers one after another (lax.map): (the factors in float64, and
    rounded to ``dtype``) (C, Qp, npair) each."""
    exact = jax.lax.map(lambda member: factor_member(static, plan_arrays, *member, batch), (data, shifts, present))
    return exact, exact.astype(dtype)


factor_program = compiled(_factor_program, static_argnums=(0, 5, 6), name="fitted_factor")


def fitting_static(plan: FittingPlan) -> tuple:
    """The compile-time part of ``plan`` (see :func:`factor_member`)."""
    orbital_kinds = tuple((c.la, c.lb, c.ka, c.kb) for c in plan.orbital.pairs)
    fitting_kinds = tuple((c.la, c.lb, c.ka, c.kb) for c in plan.pairs)
    three = (orbital_kinds + fitting_kinds, tuple((c.bra, c.ket) for c in plan.three))
    metric = (fitting_kinds, tuple((c.bra, c.ket) for c in plan.metric))
    return three, metric, plan.naux, plan.npair, len(plan.orbital.pairs)


@lru_cache(maxsize=4)
def plan_arrays(plan: FittingPlan):
    """The plan's index arrays on the device (once per plan)."""
    pick = lambda classes: tuple((c.chunks, c.bra_index, c.ket_index) for c in classes)  # noqa: E731
    return on_device((pick(plan.three), pick(plan.metric)))


@lru_cache(maxsize=4)
def fitting_structure(plan: FittingPlan):
    """The fitting pair stage's index arrays on the device: per fitting class (shells, companions,
    their atoms)."""
    atom = plan.shell_atom
    return on_device(tuple((c.first.astype(np.int32), c.second.astype(np.int32), atom[c.first], atom[c.second])
                           for c in plan.pairs))  # fmt: skip

