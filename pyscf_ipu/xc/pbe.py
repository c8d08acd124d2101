"""Perdew-Burke-Ernzerhof GGA exchange and correlation (libxc ``GGA_X_PBE``, ``GGA_C_PBE``)."""
from __future__ import annotations

import math

import jax.numpy as jnp

from ._common import gga, masked, safe_inputs
from .slater import C_X
from .vwn import RS_FACTOR

# ----------------------------------------------------------------------------
# Exchange
# ----------------------------------------------------------------------------
#: PBE exchange kappa (Lieb-Oxford bound).
KAPPA = 0.804
#: PBE correlation beta as used by libxc (more digits than the paper's 0.066725).
BETA = 0.06672455060314922
#: PBE exchange mu = beta pi^2 / 3 (libxc value).
MU = 0.2195149727645171
#: s^2 = sigma / (4 (3 pi^2)^(2/3) rho^(8/3)) = S2_FACTOR * sigma / rho^(8/3)
S2_FACTOR = 1.0 / (4.0 * (3.0 * math.pi**2) ** (2.0 / 3.0))
#: Cap on u = mu s^2 / kappa.  F_x = 1 + kappa - kappa/(1+u) differs from its
#: limit by < kappa/u ~ 1e-17 relative, i.e. the cap is exact in float64; it
#: only keeps float32 derivatives finite for absurd sigma/rho^(8/3).
U_MAX = 1e17


@gga
def pbe_x(rho, sigma):
    r"""PBE exchange energy density, closed shell.

    .. math::
        e_x = -\frac34\left(\frac3\pi\right)^{1/3}\rho^{4/3} F_x(s),\qquad
        F_x(s) = 1 + \kappa - \frac{\kappa}{1 + \mu s^2/\kappa},\qquad
        s^2 = \frac{\sigma}{4 (3\pi^2)^{2/3} \rho^{8/3}}

    with :math:`u = \mu s^2/\kappa` capped at ``U_MAX`` (exact: F is saturated
    there).  Constants (libxc ``GGA_X_PBE``): kappa = 0.804,
    mu = 0.2195149727645171 (= beta pi^2/3 with beta = 0.06672455060314922).

    Reference: J. P. Perdew, K. Burke, M. Ernzerhof, Phys. Rev. Lett. 77,
    3865 (1996).

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
    u = jnp.minimum((MU / KAPPA * S2_FACTOR) * s * (tm4 * tm4), U_MAX)
    # Not 1 + kappa u/(1+u): its autodiff (quotient rule) subtracts two terms of
    # size ~1/u, losing ~u ulps in vsigma.  Here F's absolute error is ~ulp(1).
    fx = (1.0 + KAPPA) - KAPPA / (1.0 + u)
    e = -C_X * r43 * fx
    return masked(mask, e, rho)


# ----------------------------------------------------------------------------
# Correlation
# ----------------------------------------------------------------------------
#: Paramagnetic Perdew-Wang 92 parameters (A, alpha1, beta1, beta2, beta3, beta4), libxc's "modified"
#: set (LDA_C_PW_MOD, used inside libxc's GGA_C_PBE): A has more digits than the paper's 0.031091.
PW92_MOD = (0.0310907, 0.21370, 7.5957, 3.5876, 1.6382, 0.49294)
#: PBE correlation gamma = (1 - ln 2) / pi^2.
GAMMA = (1.0 - math.log(2.0)) / math.pi**2
#: t^2 = sigma / (4 k_s^2 rho^2) = T2_FACTOR * sigma / rho^(7/3),
#: k_s^2 = 4 k_F / pi, k_F = (3 pi^2 rho)^(1/3).
T2_FACTOR = math.pi / (16.0 * (3.0 * math.pi**2) ** (1.0 / 3.0))
#: Caps keeping float32 intermediates finite for absurd sigma/rho^(7/3).  There
#: eps + H is saturated: with y = A t^2 >= 1e15 it is below 1e-30 |eps|, so the
#: caps change the energy density only by that negligible absolute amount.
T2_MAX = 1e25
Y_MAX = 1e15


def pw92_eps(rs, parameters=PW92_MOD):
    r"""Perdew-Wang 92 correlation energy per electron at one spin polarisation.

    .. math::
        \epsilon_c(r_s) = -2A(1 + \alpha_1 r_s)\,
        \ln\Big(1 + \frac{1}{2A(\beta_1 r_s^{1/2} + \beta_2 r_s
        + \beta_3 r_s^{3/2} + \beta_4 r_s^{2})}\Big)

    with ``parameters`` = (A, alpha1, beta1, beta2, beta3, beta4): by default libxc's modified
    paramagnetic constants, A = 0.0310907, alpha1 = 0.21370, beta1 = 7.5957, beta2 = 3.5876,
    beta3 = 1.6382, beta4 = 0.49294.

    Reference: J. P. Perdew, Y. Wang, Phys. Rev. B 45, 13244 (1992).
    """
    a, alpha1, beta1, beta2, beta3, beta4 = parameters
    srs = jnp.sqrt(rs)
    q = srs * (beta1 + srs * (beta2 + srs * (beta3 + srs * beta4)))
    return -2.0 * a * (1.0 + alpha1 * rs) * jnp.log1p(1.0 / (2.0 * a * q))


@gga
def pbe_c(rho, sigma):
    r"""PBE correlation energy density, closed shell (zeta = 0, phi = 1).

    .. math::
        e_c = \rho\,[\epsilon_c^{PW92}(r_s) + H(r_s, t)],\qquad
        H = \gamma \ln\Big(1 + \frac{\beta}{\gamma} t^2
            \frac{1 + A t^2}{1 + A t^2 + A^2 t^4}\Big),\qquad
        A = \frac{\beta/\gamma}{e^{-\epsilon_c^{PW92}/\gamma} - 1}

    with :math:`t^2 = \sigma / (4 k_s^2 \rho^2)`, :math:`k_s^2 = 4k_F/\pi`,
    :math:`k_F = (3\pi^2\rho)^{1/3}`.  With :math:`y = A t^2` and
    :math:`E = e^{-\epsilon_c/\gamma} - 1` one has :math:`\beta t^2/\gamma = E y`,
    :math:`\gamma\ln(1+E) = -\epsilon_c`, hence the cancellation-free form
    used here (H tends to :math:`-\epsilon_c` for large t):

    .. math::
        \epsilon_c + H = \gamma\,\mathrm{log1p}\Big(
            \frac{\mathrm{expm1}(\epsilon_c/\gamma)}{1 + y + y^2}\Big).

    Constants (libxc ``GGA_C_PBE``): beta = 0.06672455060314922,
    gamma = (1 - ln 2)/pi^2; PW92 part with libxc's modified constants
    (see :func:`pw92_eps`).

    References: J. P. Perdew, K. Burke, M. Ernzerhof, Phys. Rev. Lett. 77,
    3865 (1996); J. P. Perdew, Y. Wang, Phys. Rev. B 45, 13244 (1992).

    Args:
      rho: total density; sigma: ``|grad rho|^2`` (same shape/dtype).

    Returns:
      Energy density per volume, same shape and dtype as ``rho``; exactly 0
      where ``rho <= DENSITY_CUTOFF``.
    """
    mask, r, s = safe_inputs(rho, sigma)
    # Powers of rho^(-1/3) (<= ~2e3 above the cut-off) rather than 1/rho^(7/3):
    # d(1/x)/dx = -1/x^2 would overflow float32 for x = rho^(7/3) ~ 1e-23.
    tm = 1.0 / jnp.cbrt(r)  # rho^(-1/3)
    tm2 = tm * tm
    inv_r73 = tm2 * tm2 * tm2 * tm  # rho^(-7/3)
    rs = RS_FACTOR * tm
    eps = pw92_eps(rs)
    big_e = jnp.expm1(-eps / GAMMA)
    a = (BETA / GAMMA) / big_e
    t2 = jnp.minimum(T2_FACTOR * s * inv_r73, T2_MAX)
    y = jnp.minimum(a * t2, Y_MAX)
    # eps + H without cancellation (H -> -eps for large t):
    # eps + gamma log1p(E G) = gamma log1p(expm1(eps/gamma) / (1 + y + y^2)).
    e = r * (GAMMA * jnp.log1p(jnp.expm1(eps / GAMMA) / (1.0 + y * (1.0 + y))))
    return masked(mask, e, rho)
