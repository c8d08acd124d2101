r"""The Boys function :math:`F_m(T) = \int_0^1 t^{2m} e^{-T t^2} dt`, vectorised and differentiable.

For T >= :data:`SERIES_BELOW` it is the regularised lower incomplete gamma function,
:math:`F_m(T) = \Gamma(m + 1/2)\, P(m + 1/2, T) / (2 T^{m + 1/2})`, which tends to the asymptotic
form :math:`\Gamma(m + 1/2) / (2 T^{m + 1/2})` as P -> 1 (T above about 30). Below, where that
quotient loses digits to cancellation, the Taylor series
:math:`F_m(T) = \sum_k (-T)^k / (k!\,(2m + 2k + 1))` (:data:`SERIES_TERMS` terms; the first
omitted one is below 1e-16 there) is used instead. Both branches are evaluated on safe arguments,
so gradients carry no NaN from the branch not taken.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.scipy.special import gammainc

SERIES_BELOW = 0.5
SERIES_TERMS = 14


def boys(m: int, t):
    """F_m(T) for an integer order ``m`` >= 0 and T >= 0 (any shape), in T's precision."""
    t = jnp.asarray(t)
    small = t < SERIES_BELOW
    ts = jnp.where(small, t, 0.0)
    series = sum((-ts) ** k * (1.0 / (math.factorial(k) * (2 * m + 2 * k + 1))) for k in range(SERIES_TERMS))
    tl = jnp.where(small, SERIES_BELOW, t)
    a = m + 0.5
    large = math.gamma(a) * gammainc(a, tl) / (2.0 * tl**a)
    return jnp.where(small, series, large)
