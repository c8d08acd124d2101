"""Lee-Yang-Parr GGA correlation (libxc ``GGA_C_LYP``)."""
from __future__ import annotations

import math

import jax.numpy as jnp

from ._common import gga, masked, safe_inputs

#: LYP parameters (Lee, Yang, Parr 1988; libxc GGA_C_LYP).
A = 0.04918
B = 0.132
C = 0.2533
D = 0.349
#: Thomas-Fermi constant C_F = (3/10) (3 pi^2)^(2/3).
C_F = 0.3 * (3.0 * math.pi**2) ** (2.0 / 3.0)


@gga
def lyp_c(rho, sigma):
    r"""LYP correlation energy density, closed shell, Miehlich et al. form.

    Miehlich et al. rewrote LYP without the Laplacian (by integration by
    parts).  Setting :math:`\rho_\alpha = \rho_\beta = \rho/2` and
    :math:`|\nabla\rho_\alpha|^2 = |\nabla\rho_\beta|^2 = \nabla\rho_\alpha\cdot\nabla\rho_\beta = \sigma/4`
    in their spin-resolved formula gives, with :math:`t = \rho^{-1/3}`,

    .. math::
        e_c = -\frac{a}{1 + d t}\Big[\rho + b\,e^{-c t}\Big(C_F\,\rho
              - \frac{3 + 7\delta}{72}\,\sigma\,\rho^{-5/3}\Big)\Big],
        \qquad \delta = c t + \frac{d t}{1 + d t},

    :math:`C_F = \frac{3}{10}(3\pi^2)^{2/3}`, a = 0.04918, b = 0.132,
    c = 0.2533, d = 0.349.  The factor :math:`e^{-ct}\rho^{-5/3}` is evaluated
    as one exponential, :math:`\exp(-ct - \frac53\ln\rho)`, which stays finite
    (it underflows to 0 rather than forming inf * 0) for tiny densities.

    References: C. Lee, W. Yang, R. G. Parr, Phys. Rev. B 37, 785 (1988);
    B. Miehlich, A. Savin, H. Stoll, H. Preuss, Chem. Phys. Lett. 157, 200
    (1989).  Same as libxc ``GGA_C_LYP``.

    Args:
      rho: total density; sigma: ``|grad rho|^2`` (same shape/dtype).

    Returns:
      Energy density per volume, same shape and dtype as ``rho``; exactly 0
      where ``rho <= DENSITY_CUTOFF``.
    """
    mask, r, s = safe_inputs(rho, sigma)
    t = 1.0 / jnp.cbrt(r)
    den = 1.0 + D * t
    delta = C * t + D * t / den
    ct = C * t
    w = jnp.exp(-ct)
    w53 = jnp.exp(-ct - (5.0 / 3.0) * jnp.log(r))  # e^{-ct} rho^{-5/3}
    inner = r + B * (C_F * r * w - ((3.0 + 7.0 * delta) / 72.0) * s * w53)
    e = -A * inner / den
    return masked(mask, e, rho)
