"""Composite exchange-correlation functionals and their registry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp

from .b88 import b88_x
from .lyp import lyp_c
from .pbe import pbe_c, pbe_x
from .slater import slater_x
from .vwn import vwn5_c, vwn_rpa_c
from .wb97 import WB97X, WB97X_D, B97Coefficients, wb97x_d_xc, wb97x_xc


@dataclass(frozen=True)
class Functional:
    """A (possibly hybrid, possibly range-separated) closed-shell XC functional.

    Its exact exchange is ``hf_exchange`` K + ``long_range_exchange`` K_ω, with K the exchange of the
    Coulomb operator 1/r and K_ω that of its long-range part erf(ω r)/r (PySCF's ``hyb`` and
    ``alpha - hyb`` of ``rsh_and_hybrid_coeff``; ωB97X: 0.157706 and 0.842294 at ω = 0.3).

    Attributes:
      name: registry name.
      pieces: ``(weight, piece)`` pairs; each piece is ``piece(rho, sigma) -> e``
        (energy density per volume), see :mod:`pyscf_ipu.xc`.
      hf_exchange: fraction a_x of exact (Hartree-Fock) exchange the SCF code
        must add (0.2 for B3LYP, 1.0 for HF, 0.0 for PBE).
      libxc_code: the string that makes PySCF (``mf.xc`` / ``eval_xc``) use
        the same functional.
      long_range_exchange: the fraction of long-range exact exchange K_ω added on top (0: none).
      omega: the range separation ω, Bohr^-1, of K_ω (0 where there is none).
    """

    name: str
    pieces: tuple[tuple[float, Callable], ...]
    hf_exchange: float
    libxc_code: str
    long_range_exchange: float = 0.0
    omega: float = 0.0

    @property
    def range_separated(self) -> bool:
        """Whether the exchange has a long-range part (the J-K backend then contracts K_ω as well)."""
        return self.long_range_exchange != 0.0

    @property
    def exchange_factor(self) -> float:
        """The factor the SCF code scales the J-K backend's K by: ``hf_exchange``, or 1 for a
        range-separated functional, whose backend returns the weighted sum of K and K_ω itself."""
        return 1.0 if self.range_separated else self.hf_exchange

    def energy_density(self, rho, sigma=None):
        """Sum of ``weight * piece(rho, sigma)``: the semi-local XC energy
        density per volume (zeros, with ``rho``'s dtype, for pure HF)."""
        rho = jnp.asarray(rho)
        e = jnp.zeros_like(rho)
        for weight, piece in self.pieces:
            e = e + weight * piece(rho, sigma)
        return e

    @property
    def needs_gradient(self) -> bool:
        """True if any piece is a GGA (the caller must then supply sigma)."""
        return any(getattr(p, "family", "GGA") == "GGA" for _, p in self.pieces)


def wb97_functional(name: str, coefficients: B97Coefficients, piece: Callable, libxc_code: str) -> Functional:
    """A ωB97-family hybrid: exact exchange for all of the long range and 1 - c_x of the short range,
    c_x = ``coefficients.exchange[0]`` being the semi-local exchange's share there; so K's weight is
    1 - c_x and K_ω's c_x (ωB97X: 0.157706 and 0.842294)."""
    c_x = coefficients.exchange[0]
    return Functional(name=name, pieces=((1.0, piece),), hf_exchange=1.0 - c_x, libxc_code=libxc_code,
                      long_range_exchange=c_x, omega=coefficients.omega)  # fmt: skip


FUNCTIONALS: dict[str, Functional] = {
    # PySCF >= 2.3 / libxc HYB_GGA_XC_B3LYP (code 402): VWN *RPA* correlation.
    "b3lyp": Functional(
        name="b3lyp",
        pieces=((0.08, slater_x), (0.72, b88_x), (0.19, vwn_rpa_c), (0.81, lyp_c)),
        hf_exchange=0.2,
        libxc_code="b3lyp",
    ),
    # PySCF alias B3LYP5: '.2*HF + .08*SLATER + .72*B88, .81*LYP + .19*VWN' (VWN5).
    "b3lyp5": Functional(
        name="b3lyp5",
        pieces=((0.08, slater_x), (0.72, b88_x), (0.19, vwn5_c), (0.81, lyp_c)),
        hf_exchange=0.2,
        libxc_code="b3lyp5",
    ),
    # PySCF alias PBE -> 'PBE,PBE' = GGA_X_PBE + GGA_C_PBE.
    "pbe": Functional(
        name="pbe",
        pieces=((1.0, pbe_x), (1.0, pbe_c)),
        hf_exchange=0.0,
        libxc_code="pbe,pbe",
    ),
    "hf": Functional(name="hf", pieces=(), hf_exchange=1.0, libxc_code="hf"),
    # libxc HYB_GGA_XC_WB97X (Chai and Head-Gordon 2008)
    "wb97x": wb97_functional("wb97x", WB97X, wb97x_xc, "wb97x"),
    # libxc HYB_GGA_XC_WB97X_D (Chai and Head-Gordon 2008, PCCP): the same form, refitted with ω = 0.2 beside
    # its own damped dispersion (the "chg" correction, pyscf_ipu.dispersion); PySCF names it by libxc's name
    "wb97x-d": wb97_functional("wb97x-d", WB97X_D, wb97x_d_xc, "hyb_gga_xc_wb97x_d"),
}
