"""Closed-shell exchange-correlation functionals in JAX (float32/float64).

Every *piece* is a pure function ``piece(rho, sigma) -> e`` of the total
density ``rho`` and ``sigma = |grad rho|^2`` returning the energy density per
unit volume (libxc's ``exc * rho``) with the shape and dtype of ``rho``.
Densities at or below :data:`DENSITY_CUTOFF` contribute exactly 0, and values
and gradients are free of NaN/inf for any non-negative input.

Pieces: :func:`slater_x` (LDA_X), :func:`b88_x` (GGA_X_B88),
:func:`vwn5_c` (LDA_C_VWN), :func:`vwn_rpa_c` (LDA_C_VWN_RPA),
:func:`lyp_c` (GGA_C_LYP), :func:`pbe_x` (GGA_X_PBE), :func:`pbe_c`
(GGA_C_PBE), and the semi-local parts of the range-separated hybrids :func:`wb97x_xc`
(HYB_GGA_XC_WB97X) and :func:`wb97x_d_xc` (HYB_GGA_XC_WB97X_D).  Composite functionals:
:data:`FUNCTIONALS`, by name (:func:`pyscf_ipu.resolution.resolve` looks them up).
"""
from ._common import DENSITY_CUTOFF
from .b88 import b88_x
from .functionals import FUNCTIONALS, Functional
from .lyp import lyp_c
from .pbe import pbe_c, pbe_x
from .slater import slater_x
from .vwn import vwn5_c, vwn_rpa_c
from .wb97 import wb97x_d_xc, wb97x_xc

__all__ = [
    "DENSITY_CUTOFF",
    "wb97x_xc",
    "wb97x_d_xc",
    "slater_x",
    "b88_x",
    "vwn5_c",
    "vwn_rpa_c",
    "lyp_c",
    "pbe_x",
    "pbe_c",
    "Functional",
    "FUNCTIONALS",
]
