"""Shared helpers for the exchange-correlation pieces.

Every piece is a pure function ``piece(rho, sigma) -> e`` for a closed-shell
(spin-unpolarised) density, where ``rho`` is the total density, ``sigma`` is
``|grad rho|^2`` and ``e`` is the energy density per unit volume (libxc's
``exc * rho``).

Numerical safety follows the "double where" pattern: points whose density is
at or below :data:`DENSITY_CUTOFF` have their inputs replaced by harmless
values *before* any arithmetic (so neither the value nor its derivatives can
become NaN/inf there), and their result is set to exactly 0 afterwards.
"""
from __future__ import annotations

import jax.numpy as jnp

#: Densities at or below this value contribute exactly 0 (and 0 gradient).
DENSITY_CUTOFF = 1e-10


def safe_inputs(rho, sigma=None):
    """Return ``(mask, rho_safe, sigma_safe)``.

    ``mask`` is True where ``rho > DENSITY_CUTOFF``.  Masked-out densities are
    replaced by 1.0 and their sigma by 0.0, so every intermediate quantity of a
    formula is finite and well conditioned there.  Negative sigma (which cannot
    occur for ``|grad rho|^2`` but may come from round-off in a caller) is
    treated as 0.  ``sigma=None`` (allowed for LDA pieces) gives
    ``sigma_safe=None``.
    """
    rho = jnp.asarray(rho)
    mask = rho > DENSITY_CUTOFF
    rho_safe = jnp.where(mask, rho, 1.0)
    if sigma is None:
        return mask, rho_safe, None
    sigma = jnp.asarray(sigma, dtype=rho.dtype)
    sigma_safe = jnp.where(mask & (sigma >= 0.0), sigma, 0.0)
    return mask, rho_safe, sigma_safe


def masked(mask, e, like):
    """Zero ``e`` where ``mask`` is False and give it the dtype of ``like``."""
    return jnp.where(mask, e, 0.0).astype(jnp.asarray(like).dtype)


def lda(fn):
    """Mark a piece as LDA (depends on rho only; sigma is ignored)."""
    fn.family = "LDA"
    return fn


def gga(fn):
    """Mark a piece as GGA (depends on rho and sigma)."""
    fn.family = "GGA"
    return fn
