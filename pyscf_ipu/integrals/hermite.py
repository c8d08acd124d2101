r"""Hermite Gaussian algebra shared by the one- and two-electron integrals (McMurchie-Davidson).

A product of two Cartesian Gaussians on centres A and B (exponents a, b; p = a + b, P the weighted
centre, mu = ab/p) expands in Hermite Gaussians about P with coefficients E^{ij}_t per axis
(T. Helgaker, P. Jorgensen, J. Olsen, *Molecular Electronic-Structure Theory*, Wiley 2000, 9.5):

.. math::

    E^{00}_0 = e^{-\mu X_{AB}^2}, \quad
    E^{i+1,j}_t = \tfrac{1}{2p} E^{ij}_{t-1} + X_{PA} E^{ij}_t + (t+1) E^{ij}_{t+1},

and likewise for j + 1 with X_PB. The Hermite Coulomb integrals are R^{n}_{000} = (-2p)^n F_n(p R_{PC}^2),
raised by R^{n}_{t+1,u,v} = t R^{n+1}_{t-1,u,v} + X_{PC} R^{n+1}_{tuv} (and in u, v alike) (ibid., 9.9).
The recursions are unrolled at trace time, elementwise over arrays of pairs.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .boys import boys_parts, boys_recursions

class PairFactors(NamedTuple):
    """The exponent factors of primitive pairs (a, b), p = a + b: arrays over pairs."""

    half: jax.Array  # 1 / (2p)
    a_frac: jax.Array  # a / p
    b_frac: jax.Array  # b / p
    mu: jax.Array  # ab / p

    @classmethod
    def of(cls, a, b) -> PairFactors:
        p = a + b
        return cls(0.5 / p, a / p, b / p, a * b / p)


def hermite_coefficients(i_max: int, j_max: int, factors: PairFactors, xab):
    """E[i][j][t] for i <= i_max, j <= j_max, t <= i + j: arrays over pairs (one axis).

    ``xab`` (pairs,) = A - B on this axis. The factors may come from the host in float64 (the ERIs
    take them so: one rounding each instead of three).
    """
    # P - A and P - B from A - B, never from P: exactly zero for two primitives on one atom
    # (float32 rounding of P itself would leave ~1e-7, amplified by tight exponents).
    xpa, xpb, half = -factors.b_frac * xab, factors.a_frac * xab, factors.half
    zero = jnp.zeros_like(xpa + half)

    def get(table, t):
        return table[t] if 0 <= t < len(table) else zero

    e = [[None] * (j_max + 1) for _ in range(i_max + 1)]
    e[0][0] = [jnp.exp(-factors.mu * xab**2) + zero]
    for i in range(i_max + 1):
        for j in range(j_max + 1):
            if i == 0 and j == 0:
                continue
            if j > 0:  # raise j from (i, j - 1)
                prev, shift = e[i][j - 1], xpb
            else:  # raise i from (i - 1, 0)
                prev, shift = e[i - 1][j], xpa
            e[i][j] = [half * get(prev, t - 1) + shift * get(prev, t) + (t + 1) * get(prev, t + 1)
                       for t in range(i + j + 1)]  # fmt: skip
    return e


def stack_hermite(table, i_max: int, j_max: int, t_max: int):
    """E[i][j][t] as one array (pairs, i_max + 1, j_max + 1, t_max + 1), zero beyond t = i + j."""
    zero = jnp.zeros_like(table[0][0][0])
    return jnp.stack([jnp.stack([jnp.stack([table[a][b][t] if t < len(table[a][b]) else zero
                                            for t in range(t_max + 1)], -1)
                                 for b in range(j_max + 1)], -2)
                      for a in range(i_max + 1)], -3)  # fmt: skip


@lru_cache(maxsize=None)
def hermite_indices(order: int) -> tuple[tuple[int, int, int], ...]:
    """The Hermite indices (t, u, v) with t + u + v <= ``order``, in a fixed order."""
    return tuple((t, u, v) for total in range(order + 1) for t in range(total, -1, -1)
                 for u in range(total - t, -1, -1) for v in [total - t - u])  # fmt: skip


def hermite_coulomb(order: int, p, pc):
    """R[t][u][v] for t + u + v <= ``order``, elementwise over arrays of one shape: ``p`` and the
    components (x, y, z) of P - C, separate arrays (a trailing xyz axis costs XLA a strided pass)."""
    t_arg = p * (pc[0] * pc[0] + pc[1] * pc[1] + pc[2] * pc[2])
    # r[n][(t, u, v)]: the auxiliary R^n_{tuv}
    parts = boys_parts(order, t_arg)
    if order > 0:
        # Materialise the Boys function's expensive parts (exp, erf, series): every R below reads
        # the family, and XLA's CPU fusion would otherwise evaluate them again for each R (one
        # fused loop computes every output element from scratch). A matmul with the identity is
        # the one op it will not fuse into; the cheap recursions then run in each consumer.
        parts = jnp.eye(3, dtype=t_arg.dtype) @ jnp.stack(parts, 0).reshape(3, -1)
        parts = [part.reshape(t_arg.shape) for part in parts]
    family = boys_recursions(order, t_arg, *parts)
    r = {(0, 0, 0, n): (-2.0 * p) ** n * family[n] for n in range(order + 1)}

    def get(t, u, v, n):
        if min(t, u, v) < 0:
            return 0.0
        return r[(t, u, v, n)]

    for total in range(1, order + 1):
        for n in range(order - total + 1):
            for t in range(total + 1):
                for u in range(total - t + 1):
                    v = total - t - u
                    if t > 0:
                        r[(t, u, v, n)] = (t - 1) * get(t - 2, u, v, n + 1) + pc[0] * get(t - 1, u, v, n + 1)
                    elif u > 0:
                        r[(t, u, v, n)] = (u - 1) * get(t, u - 2, v, n + 1) + pc[1] * get(t, u - 1, v, n + 1)
                    else:
                        r[(t, u, v, n)] = (v - 1) * get(t, u, v - 2, n + 1) + pc[2] * get(t, u, v - 1, n + 1)
    return {(t, u, v): value for (t, u, v, n), value in r.items() if n == 0}


def _raised(previous, before, shift, k: int, axis: int):
    """One step of the recursion along one Hermite index: R^n_{k+1} = k R^{n+1}_{k-1} + X R^{n+1}_k,
    ``previous`` holding R_k for n = 0..m (along ``axis``), ``before`` R_{k-1} for n = 0..m+1."""
    upper = jax.lax.slice_in_dim(previous, 1, None, axis=axis)
    if not k:
        return shift * upper
    return k * jax.lax.slice_in_dim(before, 1, previous.shape[axis], axis=axis) + shift * upper


def hermite_coulomb_stacked(order: int, p, pc):
    """(H, *shape) the R_tuv of :func:`hermite_coulomb` stacked in :func:`hermite_indices` order, by
    whole-array recursions: along t for every n, then along u for every (t, n), then along v for
    every (t, u) with t + u <= order and every n, each index's values padded with zeros to one
    length (the padding reaches only entries that are never read).

    The same recursion in about 3 ``order`` array operations where :func:`hermite_coulomb` unrolls
    one per (t, u, v, n): a program compiles in a fraction of the time, at the cost of computing a
    prism's entries for the tetrahedron's."""
    t_arg = p * (pc[0] * pc[0] + pc[1] * pc[1] + pc[2] * pc[2])
    family = boys_recursions(order, t_arg, *boys_parts(order, t_arg))
    rank = t_arg.ndim
    scale, power, first = -2.0 * p, jnp.ones_like(t_arg), []
    for value in family:
        first.append(power * value)
        power = power * scale
    stacked = jnp.stack(first)  # (n, *shape): R^n_000

    def along(values, shift, axis: int, last: bool = False):
        """Each index k of ``axis`` from k = 0: stacked before the n axis, n padded to one length
        (``last``: only n = 0, the R_tuv themselves)."""
        steps = [values]
        for k in range(order):
            steps.append(_raised(steps[-1], steps[-2] if k else None, shift, k, axis))
        if last:
            return jnp.stack([jax.lax.index_in_dim(x, 0, axis, keepdims=False) for x in steps], axis)
        pad = lambda x: jnp.pad(x, [(0, 0)] * axis + [(0, order + 1 - x.shape[axis])] + [(0, 0)] * rank)  # noqa: E731
        return jnp.stack([pad(x) for x in steps], axis)

    side = order + 1
    cube = along(stacked, pc[0], 0)  # (t, n, *shape)
    cube = along(cube, pc[1], 1)  # (t, u, n, *shape)
    pairs = [(t, u) for t in range(side) for u in range(side - t)]  # t + u <= order: the v stage's rows
    cube = jnp.take(cube.reshape(side * side, *cube.shape[2:]), np.asarray([t * side + u for t, u in pairs]), axis=0)
    cube = along(cube, pc[2], 1, last=True)  # (tu, v, *shape)
    row = {tu: k for k, tu in enumerate(pairs)}
    flat = np.asarray([row[t, u] * side + v for t, u, v in hermite_indices(order)])
    return jnp.take(cube.reshape(len(pairs) * side, *t_arg.shape), flat, axis=0)
