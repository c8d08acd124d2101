"""The semi-local part of the range-separated hybrids ωB97X and ωB97X-D (libxc ``HYB_GGA_XC_WB97X``,
``HYB_GGA_XC_WB97X_D``): B97-style power series in the reduced gradient, with short-range LDA exchange.

For a closed shell (ρ_α = ρ_β = ρ/2, x_σ² = |∇ρ_σ|² / ρ_σ^{8/3} = 2^{2/3} σ / ρ^{8/3}):

    E_xc^{SL} = Σ_σ e_x^{LDA}(ρ_σ) F(a_σ) g(γ_x, c_x, x_σ²)
              + Σ_σ e_c^{σσ} g(γ_ss, c_ss, x_σ²) + e_c^{αβ} g(γ_ab, c_ab, (x_α² + x_β²)/2),

with g(γ, c, x²) = Σ_{i=0}^{4} c_i u^i, u = γx²/(1 + γx²); e_x^{LDA}(ρ_σ) = -(3/4)(6/π)^{1/3} ρ_σ^{4/3};
the erf attenuation F(a) = 1 - (8/3) a [√π erf(1/(2a)) + (2a - 4a³) e^{-1/(4a²)} - 3a + 4a³] at
a_σ = ω / (2 (6π²ρ_σ)^{1/3}); and Stoll's partition of Perdew-Wang 92 correlation (the paper's
constants, libxc ``LDA_C_PW``): e_c^{σσ} = ρ_σ ε_c(r_s(ρ_σ), ζ = 1),
e_c^{αβ} = ρ ε_c(r_s(ρ), 0) - Σ_σ e_c^{σσ}.

The exact exchange these functionals add (all of the long-range part, a fraction of the short-range
part) is not here: it comes from the J-K contraction (:mod:`pyscf_ipu.jk.range_separated`); the
registry's ``wb97x`` (:data:`~pyscf_ipu.xc.functionals.FUNCTIONALS`) pairs the two.
References: J.-D. Chai and M. Head-Gordon, J. Chem. Phys. 128, 084106 (2008) (ωB97X); Phys. Chem.
Chem. Phys. 10, 6615 (2008) (ωB97X-D).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import jax.numpy as jnp
from jax.scipy.special import erf

from ._common import gga, masked, safe_inputs
from .pbe import pw92_eps
from .vwn import RS_FACTOR


class B97Coefficients(NamedTuple):
    """A ωB97-family functional's series coefficients (u^0 to u^4) and its range-separation ω."""

    exchange: tuple[float, ...]
    same_spin: tuple[float, ...]
    opposite_spin: tuple[float, ...]
    omega: float  # Bohr^-1


# libxc's parameters (the papers' values)
WB97X = B97Coefficients((8.42294e-01, 7.26479e-01, 1.04760e00, -5.70635e00, 1.32794e01),
                        (1.00000e00, -4.33879e00, 1.82308e01, -3.17430e01, 1.72901e01),
                        (1.00000e00, 2.37031e00, -1.13995e01, 6.58405e00, -3.78132e00), 0.3)  # fmt: skip
WB97X_D = B97Coefficients((7.77964e-01, 6.61160e-01, 5.74541e-01, -5.25671e00, 1.16386e01),
                          (1.00000e00, -6.90539e00, 3.13343e01, -5.10533e01, 2.64423e01),
                          (1.00000e00, 1.79413e00, -1.20477e01, 1.40847e01, -8.50809e00), 0.2)  # fmt: skip
GAMMA_X, GAMMA_SS, GAMMA_AB = 0.004, 0.2, 0.006

# Perdew-Wang 92, paramagnetic (zeta = 0) and ferromagnetic (zeta = 1) sets: A, alpha1, beta1..beta4
PW92_PARAMAGNETIC = (0.031091, 0.21370, 7.5957, 3.5876, 1.6382, 0.49294)
PW92_FERROMAGNETIC = (0.015545, 0.20548, 14.1189, 6.1977, 3.3662, 0.62517)
C_X_SPIN = 0.75 * (6.0 / math.pi) ** (1.0 / 3.0)  # e_x^LDA(rho_s) = -C_X_SPIN rho_s^(4/3)
KF_FACTOR = (6.0 * math.pi**2) ** (1.0 / 3.0)  # a spin's Fermi wavevector, k_F = KF_FACTOR rho_s^(1/3)
X2_FACTOR = 2.0 ** (2.0 / 3.0)  # x_s^2 = X2_FACTOR sigma / rho^(8/3)
X2_MAX = 1e20  # the series are saturated (u = 1) long before: keeps float32 intermediates finite


def _attenuation_series(terms: int) -> tuple[float, ...]:
    """F(a) = Σ_{m>=1} f_m a^{-2m} for large a, exactly (1/36, -1/960, 1/26880, ...): F's closed form
    cancels there. From erf's and the exponential's series in b = 1/(2a)."""
    def c(m: int) -> Fraction:  # the bracket's coefficient of a^-(2m+1)
        return (Fraction(2 * (-1) ** m, math.factorial(m) * (2 * m + 1) * 2 ** (2 * m + 1))
                + Fraction(2 * (-1) ** (m + 1), math.factorial(m + 1) * 4 ** (m + 1))
                - Fraction(4 * (-1) ** m, math.factorial(m + 2) * 4 ** (m + 2)))  # fmt: skip

    return tuple(float(-Fraction(8, 3) * c(m)) for m in range(1, terms + 1))


ATTENUATION_SERIES = _attenuation_series(12)
# where the series takes over from the closed form, by float size: the closed form's relative error
# grows like 400 a^6 ulps, the series' 12 terms are exact to rounding above about a = 0.5
SERIES_FROM = {4: 0.5, 8: 1.0}


def attenuation(a):
    """F(a), the erf-attenuated LDA exchange's factor, for a > 0 (see the module doc)."""
    switch = SERIES_FROM[jnp.dtype(a.dtype).itemsize]
    small = a < switch
    near = jnp.where(small, a, switch)  # each branch gets inputs where it is exact and finite
    far = jnp.where(small, switch, a)
    closed = 1.0 - (8.0 / 3.0) * near * (math.sqrt(math.pi) * erf(0.5 / near)
                                         + (2.0 * near - 4.0 * near**3) * jnp.exp(-0.25 / (near * near))
                                         - 3.0 * near + 4.0 * near**3)  # fmt: skip
    inverse = 1.0 / (far * far)
    tail = jnp.zeros_like(far)
    for coefficient in reversed(ATTENUATION_SERIES):  # Horner's rule in a^-2
        tail = (tail + coefficient) * inverse
    return jnp.where(small, closed, tail)


def series(gamma: float, coefficients: tuple[float, ...], x2):
    """g = Σ c_i u^i, u = γx²/(1 + γx²)."""
    u = gamma * x2 / (1.0 + gamma * x2)
    g = jnp.zeros_like(u)
    for coefficient in reversed(coefficients):
        g = g * u + coefficient
    return g


def wb97_family(coefficients: B97Coefficients):
    """The closed-shell semi-local energy density e(ρ, σ) of a ωB97-family functional."""

    @gga
    def piece(rho, sigma):
        mask, r, s = safe_inputs(rho, sigma)
        half = 0.5 * r  # each spin's density
        r13 = jnp.cbrt(r)
        tm = 1.0 / r13  # rho^(-1/3): powers of it, not a quotient by rho^(8/3), whose square underflows float32
        tm4 = (tm * tm) * (tm * tm)
        x2 = jnp.minimum(X2_FACTOR * s * (tm4 * tm4), X2_MAX)  # each spin's x_s^2
        h13 = jnp.cbrt(half)
        exchange = -C_X_SPIN * half * h13 * attenuation(coefficients.omega / (2.0 * KF_FACTOR * h13))
        same = half * pw92_eps(RS_FACTOR / h13, PW92_FERROMAGNETIC)  # e_c of one spin alone
        opposite = r * pw92_eps(RS_FACTOR / r13, PW92_PARAMAGNETIC) - 2.0 * same
        e = 2.0 * (exchange * series(GAMMA_X, coefficients.exchange, x2)
                   + same * series(GAMMA_SS, coefficients.same_spin, x2)) \
            + opposite * series(GAMMA_AB, coefficients.opposite_spin, x2)  # fmt: skip
        return masked(mask, e, rho)

    return piece


wb97x_xc = wb97_family(WB97X)
wb97x_d_xc = wb97_family(WB97X_D)
