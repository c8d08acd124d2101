r"""The Boys function :math:`F_m(T) = \int_0^1 t^{2m} e^{-T t^2} dt`, tabulated, vectorised, differentiable.

Below :data:`TABLE_MAX` it is interpolated from a float64 table on a grid of spacing
:data:`TABLE_STEP` by the Taylor series about the nearest grid point T_0,

.. math:: F_m(T) = \sum_{k < K} F_{m+k}(T_0) \frac{(T_0 - T)^k}{k!}, \qquad |T - T_0| \le 0.05,

using dF_m/dT = -F_{m+1}; with K = :data:`TAYLOR_TERMS` the first omitted term is below 1e-15 of
F_m, and every term is a product of positive table values and small powers, so float32 keeps its
own precision (no cancellation). Above it, the asymptotic form
:math:`F_m(T) \approx \Gamma(m + 1/2) / (2 T^{m + 1/2})`, whose relative error
Q(m + 1/2, T) is below 1e-16 for m <= 8 at T = 60 (at T = 35 it would still be 2e-8).

The table is built once on the host: F_top by its series of positive terms
:math:`e^{-T} \sum_k (2T)^k / ((2m+1)(2m+3)\cdots(2m+2k+1))` in float64, then the stable downward
recursion :math:`F_m = (2T F_{m+1} + e^{-T}) / (2m + 1)`. This is the classic approach of quantum
chemistry codes (e.g. Helgaker, Jorgensen and Olsen, *Molecular Electronic-Structure Theory*, 9.8).
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax.numpy as jnp
import numpy as np

TABLE_STEP = 0.1
TABLE_MAX = 60.0
TAYLOR_TERMS = 8
MAX_ORDER = 16  # highest m served (ERIs of d shells need 8; gradients one more)


@lru_cache(maxsize=None)
def boys_table() -> np.ndarray:
    """(points, MAX_ORDER + TAYLOR_TERMS) float64: F_m(T_i) on T_i = i * TABLE_STEP up to TABLE_MAX (+ margin)."""
    t = np.arange(0.0, TABLE_MAX + 2 * TABLE_STEP, TABLE_STEP)
    top = MAX_ORDER + TAYLOR_TERMS - 1
    # F_top by its positive series: terms t_k = t_{k-1} * 2T / (2 top + 2k + 1), t_0 = 1 / (2 top + 1)
    term = np.full_like(t, 1.0 / (2 * top + 1))
    total = term.copy()
    for k in range(1, 400):  # T <= 60: the terms fall below 1e-17 of the sum long before
        term = term * 2.0 * t / (2 * top + 2 * k + 1)
        total += term
    table = np.empty((len(t), top + 1))
    table[:, top] = np.exp(-t) * total
    for m in range(top - 1, -1, -1):
        table[:, m] = (2.0 * t * table[:, m + 1] + np.exp(-t)) / (2 * m + 1)
    return table


def boys(m: int, t):
    """F_m(T) for an integer order 0 <= ``m`` <= MAX_ORDER and T >= 0 (any shape), in T's precision."""
    if not 0 <= m <= MAX_ORDER:
        raise ValueError(f"Boys function order {m} outside 0..{MAX_ORDER}")
    t = jnp.asarray(t)
    table = jnp.asarray(boys_table()[:, m : m + TAYLOR_TERMS], t.dtype)  # (points, K)
    index = jnp.clip(jnp.round(t / TABLE_STEP).astype(jnp.int32), 0, table.shape[0] - 1)
    step = index.astype(t.dtype) * TABLE_STEP - jnp.minimum(t, TABLE_MAX)  # T_0 - T, |.| <= 0.05 in range
    rows = table[index]  # (..., K)
    taylor = sum(rows[..., k] * step**k * (1.0 / math.factorial(k)) for k in range(TAYLOR_TERMS))
    far = jnp.maximum(t, TABLE_MAX)  # the asymptotic branch on a safe argument
    asymptotic = math.gamma(m + 0.5) / (2.0 * far ** (m + 0.5))
    return jnp.where(t > TABLE_MAX, asymptotic, taylor)
