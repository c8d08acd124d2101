"""Vosko-Wilk-Nusair LDA correlation (libxc ``LDA_C_VWN`` and ``LDA_C_VWN_RPA``)."""
from __future__ import annotations

import math

import jax.numpy as jnp

from ._common import lda, masked, safe_inputs

#: rs = (3 / (4 pi rho))^(1/3) = RS_FACTOR / rho^(1/3)
RS_FACTOR = (3.0 / (4.0 * math.pi)) ** (1.0 / 3.0)

#: Paramagnetic parameters (A [Hartree], b, c, x0) as used by libxc.
#: VWN5: fit to the Ceperley-Alder QMC correlation energy ("formula V").
VWN5_PARAMS = (0.0310907, 3.72744, 12.9352, -0.10498)
#: VWN RPA: fit to the RPA correlation energy (libxc LDA_C_VWN_RPA, the one
#: inside libxc's / Gaussian's B3LYP).
VWN_RPA_PARAMS = (0.0310907, 13.0720, 42.7198, -0.409286)


def _vwn_paramagnetic(rho, sigma, params):
    mask, r, _ = safe_inputs(rho)
    a, b, c, x0 = params
    q = math.sqrt(4.0 * c - b * b)
    x0_big = x0 * x0 + b * x0 + c  # X(x0)
    rs = RS_FACTOR / jnp.cbrt(r)
    x = jnp.sqrt(rs)
    xx = x * x
    # ln(x^2 / X(x)) = -log1p((b x + c) / x^2)
    log1 = -jnp.log1p((b * x + c) / xx)
    # ln((x - x0)^2 / X(x)) = -log1p(((b + 2 x0) x + c - x0^2) / (x - x0)^2)
    xm = x - x0
    log2 = -jnp.log1p(((b + 2.0 * x0) * x + (c - x0 * x0)) / (xm * xm))
    atn = jnp.arctan(q / (2.0 * x + b))
    eps = a * (
        log1
        + (2.0 * b / q) * atn
        - (b * x0 / x0_big) * (log2 + (2.0 * (b + 2.0 * x0) / q) * atn)
    )
    return masked(mask, r * eps, rho)


@lda
def vwn5_c(rho, sigma=None):
    r"""VWN5 correlation energy density (paramagnetic, closed shell).

    With :math:`x = \sqrt{r_s}`, :math:`r_s = (3/(4\pi\rho))^{1/3}`,
    :math:`X(x) = x^2 + b x + c`, :math:`Q = \sqrt{4c - b^2}`:

    .. math::
        \epsilon_c = A\Big[\ln\frac{x^2}{X(x)} + \frac{2b}{Q}\tan^{-1}\frac{Q}{2x+b}
          - \frac{b x_0}{X(x_0)}\Big(\ln\frac{(x-x_0)^2}{X(x)}
          + \frac{2(b+2x_0)}{Q}\tan^{-1}\frac{Q}{2x+b}\Big)\Big],
        \qquad e = \rho\,\epsilon_c

    Constants (libxc ``LDA_C_VWN``): A = 0.0310907, b = 3.72744,
    c = 12.9352, x0 = -0.10498.

    Reference: S. H. Vosko, L. Wilk, M. Nusair, Can. J. Phys. 58, 1200 (1980).

    ``sigma`` is ignored.  Returns the energy density per volume with the dtype
    and shape of ``rho``; exactly 0 where ``rho <= DENSITY_CUTOFF``.
    """
    return _vwn_paramagnetic(rho, sigma, VWN5_PARAMS)


@lda
def vwn_rpa_c(rho, sigma=None):
    r"""VWN RPA correlation energy density (paramagnetic, closed shell).

    Same formula as :func:`vwn5_c` with the RPA fit parameters
    (libxc ``LDA_C_VWN_RPA``): A = 0.0310907, b = 13.0720, c = 42.7198,
    x0 = -0.409286.  This is the LDA correlation used by libxc's (and
    Gaussian's, and PySCF >= 2.3's default) B3LYP.

    Reference: S. H. Vosko, L. Wilk, M. Nusair, Can. J. Phys. 58, 1200 (1980).

    ``sigma`` is ignored.  Returns the energy density per volume with the dtype
    and shape of ``rho``; exactly 0 where ``rho <= DENSITY_CUTOFF``.
    """
    return _vwn_paramagnetic(rho, sigma, VWN_RPA_PARAMS)
