r"""The Boys function :math:`F_m(T) = \int_0^1 t^{2m} e^{-T t^2} dt`: every order up to m at once, gather-free.

An integral kernel needs F_0 .. F_L at the same T, so :func:`boys_family` returns the whole family,
by two branches that are each stable where they are used (Helgaker, Jorgensen and Olsen,
*Molecular Electronic-Structure Theory*, 9.8.2):

- **T < T_s = L + 2:** F_L by its series of positive terms
  :math:`F_L(T) = e^{-T} \sum_k (2T)^k / ((2L+1)(2L+3)\cdots(2L+2k+1))` (no cancellation; the
  number of terms is chosen at trace time for the dtype), then the downward recursion
  :math:`F_m = (2T F_{m+1} + e^{-T}) / (2m + 1)`, which damps errors;
- **T >= T_s:** F_0 = (sqrt(pi)/2) erf(sqrt T) / sqrt T, then the upward recursion
  :math:`F_{m+1} = ((2m + 1) F_m - e^{-T}) / (2T)`, stable once 2T > 2m + 1.

Both branches are plain arithmetic, exp and erf, which XLA vectorises; a tabulated Boys function
needs a gather per element, and on the CPU a gather inside a loop fusion turns the whole ERI
kernel into scalar code. Against scipy's 1F1 the values hold about 1e-6 relative in float32 and
1e-12 in float64 (tests/test_integrals.py). The switch keeps T >= L + 2 on the upward branch, and
both branches see clamped arguments, so gradients are finite everywhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

MAX_ORDER = 16  # highest m served (ERIs of f shells need 12; their gradients one more)


def _series_terms(top: int, switch: float, eps: float) -> int:
    """Terms of F_top's positive series until one falls below ``eps`` of the sum at T = ``switch``."""
    term = total = 1.0 / (2 * top + 1)
    k = 0
    while term > eps * total:
        k += 1
        term *= 2.0 * switch / (2 * top + 2 * k + 1)
        total += term
    return k


def scaled(x, constant: float):
    """``constant`` x, with ``constant`` split into its value in x's precision plus the remainder.

    A constant rounded to float32 once scales every element by the same relative error (2 pi^(5/2):
    -3.4e-8), which summed over N^4 integrals biases E_J by a third of a meV; the split product
    leaves only each element's own rounding, which averages out. That needs x high + (x low) fused
    into one multiply-add, as XLA's compiled CPU code does (tests/test_integrals.py checks it):
    computed op by op (eagerly), the sum rounds the remainder away.
    """
    high = float(np.asarray(constant, x.dtype))
    low = constant - high
    return x * high + x * low if low else x * high


def boys_family(top: int, t) -> list[jax.Array]:
    """[F_0(T), ..., F_top(T)] for 0 <= ``top`` <= MAX_ORDER and T >= 0 (any shape), in T's precision."""
    t = _as_float(top, t)
    return boys_recursions(top, t, *boys_parts(top, t))


def boys_parts(top: int, t) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The three expensive pieces of the family: e^{-T}, F_0 by erf at max(T, T_s), and F_top's
    series at min(T, T_s) without its factor e^{-T} (T_s = top + 2).

    Kept apart from :func:`boys_recursions` so that a kernel can materialise these three once and
    let every consumer run the cheap recursions itself: XLA's CPU fusion evaluates a fused producer
    again for each output it feeds. e^{-T} serves both branches, each only where it is selected;
    the clamped arguments keep the other branch (and its gradient) finite.
    """
    t = _as_float(top, t)
    switch = top + 2.0
    near = jnp.minimum(t, switch)
    # summed by Horner's rule, smallest terms first: added last to the total, terms below half its
    # last place would be dropped, every one low (a bias of 1e-8 in float32). Each factor goes
    # through :func:`scaled`: XLA turns a division by a constant into a product by its rounded
    # reciprocal.
    series = jnp.ones_like(near)
    for k in range(_series_terms(top, switch, 0.1 * float(np.finfo(t.dtype).eps)), 0, -1):
        series = 1.0 + scaled(near * series, 2.0 / (2 * top + 2 * k + 1))
    root = jnp.sqrt(jnp.maximum(t, switch))
    # erf through erfc: near 1, float32 erf runs low on average (-2e-9 here); 1 - erfc rounds evenly
    f0 = scaled((1.0 - jax.scipy.special.erfc(root)) / root, 0.5 * math.sqrt(math.pi))
    return jnp.exp(-t), f0, scaled(series, 1.0 / (2 * top + 1))


def boys_recursions(top: int, t, decay, f0_far, series) -> list[jax.Array]:
    """[F_0, ..., F_top] from :func:`boys_parts`: below T_s, F_top = e^{-T} series and downward;
    above, F_0 from erf and upward."""
    t = _as_float(top, t)
    switch = top + 2.0
    near = jnp.minimum(t, switch)
    small = [decay * series]
    for m in range(top - 1, -1, -1):
        small.insert(0, scaled(2.0 * near * small[0] + decay, 1.0 / (2 * m + 1)))
    far = jnp.maximum(t, switch)
    large = [f0_far]
    for m in range(top):
        large.append(((2 * m + 1) * large[m] - decay) / (2.0 * far))
    return [jnp.where(t < switch, s, g) for s, g in zip(small, large)]


def _as_float(top: int, t):
    if not 0 <= top <= MAX_ORDER:
        raise ValueError(f"Boys function order {top} outside 0..{MAX_ORDER}")
    t = jnp.asarray(t)
    return t if jnp.issubdtype(t.dtype, jnp.floating) else t.astype(jnp.float32)


def boys(m: int, t):
    """F_m(T) for one order (see :func:`boys_family`)."""
    return boys_family(m, t)[m]
