"""Becke 1988 GGA exchange (libxc ``GGA_X_B88``)."""
from __future__ import annotations

import jax.numpy as jnp

from ._common import gga, masked, safe_inputs
from .slater import C_X

#: Becke's beta (Hartree atomic units).
BETA = 0.0042
#: The "6" in the denominator 1 + 6 beta x asinh(x) (libxc's gamma).
GAMMA = 6.0
#: 2^(2/3): converts sigma/rho^(8/3) of the total density to x_sigma^2.
_TWO_23 = 2.0 ** (2.0 / 3.0)
#: 2^(-1/3): 2 * rho_sigma^(4/3) = 2^(-1/3) rho^(4/3) for rho_sigma = rho/2.
_TWO_M13 = 2.0 ** (-1.0 / 3.0)
#: Cap on x_sigma^2 (x_sigma = 1e15).  Physical densities have x_sigma of at
#: most ~1e4 (exponential tails at the density cut-off); the cap only keeps
#: float32 intermediates (and their derivatives) finite for absurd inputs such
#: as sigma = 1e30 at rho = 1e-9.
X2_MAX = 1e30


@gga
def b88_x(rho, sigma):
    r"""Becke 88 exchange energy density (LDA part included), closed shell.

    Spin-resolved form (Becke 1988), with :math:`\rho_\sigma = \rho/2`,
    :math:`\sigma_{\sigma\sigma} = \sigma/4` and
    :math:`x_\sigma = |\nabla\rho_\sigma| / \rho_\sigma^{4/3}`:

    .. math::
        e_x = \sum_\sigma -\rho_\sigma^{4/3}\left[\frac32\left(\frac{3}{4\pi}\right)^{1/3}
              + \frac{\beta x_\sigma^2}{1 + 6\beta x_\sigma \sinh^{-1} x_\sigma}\right]

    which for a closed shell is

    .. math::
        e_x = -\frac34\left(\frac3\pi\right)^{1/3}\rho^{4/3}
              - 2^{-1/3}\rho^{4/3}\frac{\beta x^2}{1 + 6\beta x \sinh^{-1} x},
        \qquad x^2 = 2^{2/3}\sigma/\rho^{8/3}.

    Constants: :math:`\beta = 0.0042`, 6 (libxc ``beta``, ``gamma``).
    :math:`x^2` is capped at ``X2_MAX`` (far outside any physical range).

    Reference: A. D. Becke, Phys. Rev. A 38, 3098 (1988).  Same as libxc
    ``GGA_X_B88``.

    Args:
      rho: total density; sigma: ``|grad rho|^2`` (same shape/dtype).

    Returns:
      Energy density per volume, same shape and dtype as ``rho``; exactly 0
      where ``rho <= DENSITY_CUTOFF``.
    """
    mask, r, s = safe_inputs(rho, sigma)
    r13 = jnp.cbrt(r)
    r43 = r * r13
    tm = 1.0 / r13  # rho^(-1/3), <= ~2e3 above the cut-off
    tm4 = (tm * tm) * (tm * tm)
    x2 = jnp.minimum(_TWO_23 * s * (tm4 * tm4), X2_MAX)
    # x asinh(x) is smooth in x^2, but sqrt is not at 0: double-where it.
    pos = x2 > 0.0
    x = jnp.sqrt(jnp.where(pos, x2, 1.0))
    x_asinh_x = jnp.where(pos, x * jnp.arcsinh(x), 0.0)
    grad_part = BETA * x2 / (1.0 + GAMMA * BETA * x_asinh_x)
    e = -r43 * (C_X + _TWO_M13 * grad_part)
    return masked(mask, e, rho)
