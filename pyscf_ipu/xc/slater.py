"""Slater-Dirac LDA exchange (libxc ``LDA_X``)."""
from __future__ import annotations

import math

import jax.numpy as jnp

from ._common import lda, masked, safe_inputs

#: C_x = (3/4) (3/pi)^(1/3): e_x = -C_x rho^(4/3) for a closed-shell density.
C_X = 0.75 * (3.0 / math.pi) ** (1.0 / 3.0)


@lda
def slater_x(rho, sigma=None):
    r"""Slater (Dirac) exchange energy density of a closed-shell density.

    .. math:: e_x = -\frac{3}{4}\left(\frac{3}{\pi}\right)^{1/3} \rho^{4/3}

    (Equal to :math:`2\,e_x^{\sigma}(\rho/2)` with the spin-resolved
    :math:`e_x^{\sigma}(\rho_\sigma) = -\frac32(\frac{3}{4\pi})^{1/3}\rho_\sigma^{4/3}`.)

    References: P. A. M. Dirac, Proc. Cambridge Phil. Soc. 26, 376 (1930);
    J. C. Slater, Phys. Rev. 81, 385 (1951).  Same as libxc ``LDA_X``.

    Args:
      rho: total density (any shape, float32 or float64).
      sigma: ignored (kept for the common ``(rho, sigma)`` signature).

    Returns:
      Energy density per volume, same shape and dtype as ``rho``; exactly 0
      where ``rho <= DENSITY_CUTOFF``.
    """
    mask, r, _ = safe_inputs(rho)
    e = -C_X * r * jnp.cbrt(r)
    return masked(mask, e, rho)
