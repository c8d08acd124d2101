"""A PySCF basis as flat arrays of primitive Cartesian Gaussians, for vectorised integral kernels.

Each contracted Cartesian AO mu of PySCF's Cartesian order is a sum over primitives k of
c_k x_A^i y_A^j z_A^l exp(-a_k |r - A|^2). The integral kernels work on all primitive pairs at
once and contract with a (primitives, Cartesian AOs) matrix; spherical AOs follow from PySCF's
``cart2sph_coeff``. Coefficients follow libcint's conventions, so the Cartesian results equal
``mol.intor("..._cart")``: PySCF stores primitive coefficients with the radial normalisation
(``gto_norm``) and the contraction normalisation folded in, and libcint multiplies s and p shells
by the angular factors 1/sqrt(4 pi) and sqrt(3 / (4 pi)) (d and higher get theirs in the
spherical transform).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from pyscf import gto

# libcint's CINTcommon_fac_sp: the angular normalisation applied to s and p shells.
ANGULAR_FACTOR = {0: 1.0 / math.sqrt(4.0 * math.pi), 1: math.sqrt(3.0 / (4.0 * math.pi))}
MAX_L = 3  # s, p, d and f shells in the orbital bases
MAX_FITTING_L = 4  # up to g in the density-fitting bases (their shells enter the kernels alone)


class UnsupportedBasisError(ValueError):
    """A basis with shells beyond what the kernels evaluate (or with ECPs): bad input, one line."""


def unsupported_shell(basis, symbol: str, l: int, max_l: int = MAX_L) -> UnsupportedBasisError:
    """The error for a shell of angular momentum ``l`` > ``max_l`` on ``symbol`` in ``basis`` (a name,
    or PySCF's parsed basis, which is not named)."""
    kinds = "spdfghi"
    name = f"basis {basis!r}" if isinstance(basis, str) else "the basis"
    supported = f"{', '.join(kinds[:max_l])} and {kinds[max_l]}"
    return UnsupportedBasisError(f"{name} has {kinds[l]} functions on {symbol}: only {supported} shells are "
                                 "supported by the integrals here; choose another basis")


def cartesian_powers(l: int) -> list[tuple[int, int, int]]:
    """PySCF's order of the Cartesian components of a shell: xx, xy, xz, yy, yz, zz for d."""
    return [(l - a, a - b, b) for a in range(l + 1) for b in range(a + 1)]


@dataclass(frozen=True)
class PrimitiveBasis:
    """Host arrays: one row per primitive Cartesian Gaussian (``P`` of them)."""

    exponents: np.ndarray  # (P,)
    atom: np.ndarray  # (P,) the atom each primitive sits on
    powers: np.ndarray  # (P, 3) int: Cartesian powers (i, j, l)
    contraction: np.ndarray  # (P, Nc): coefficient of each primitive in each Cartesian AO
    cart2sph: np.ndarray  # (Nc, N): PySCF's Cartesian -> spherical AO transform
    charges: np.ndarray  # (natm,) nuclear charges
    coords: np.ndarray  # (natm, 3) Bohr
    one_centre: np.ndarray  # (3, N, N): overlap, kinetic, own-nucleus attraction of each atom's AO block

    @property
    def centres(self) -> np.ndarray:
        """(P, 3) Bohr: each primitive's centre, its atom's position."""
        return self.coords[self.atom]


def contracted_shells(mol: gto.Mole, max_l: int = MAX_L):
    """Yield (shell, l, atom, exponents (nprim,), coefficients (nctr, nprim)) for every shell of ``mol``
    (of at most ``max_l``).

    PySCF's radially normalised contraction coefficients, without libcint's angular factors; no ECPs
    (an :class:`UnsupportedBasisError` names the offending shell's kind and atom).
    """
    if mol.has_ecp():
        raise UnsupportedBasisError("ECP basis sets are not supported by the integrals here")
    for shell in range(mol.nbas):
        l, nprim, nctr = (int(mol._bas[shell, k]) for k in (gto.ANG_OF, gto.NPRIM_OF, gto.NCTR_OF))
        if l > max_l:
            raise unsupported_shell(mol.basis, mol.atom_symbol(mol.bas_atom(shell)), l, max_l)
        start = int(mol._bas[shell, gto.PTR_COEFF])
        coefficients = mol._env[start : start + nprim * nctr].reshape(nctr, nprim)
        yield shell, l, mol.bas_atom(shell), mol.bas_exp(shell), coefficients


def primitive_basis(mol: gto.Mole) -> PrimitiveBasis:
    """Flatten ``mol``'s shells into primitive Cartesian Gaussians (up to :data:`MAX_L`; no ECPs)."""
    exponents, atoms, powers, rows = [], [], [], []
    nao_cart = mol.nao_cart()
    column = 0
    for _, l, atom, exps, coeff in contracted_shells(mol):
        coeff = coeff * ANGULAR_FACTOR.get(l, 1.0)
        for c in range(len(coeff)):
            for power in cartesian_powers(l):
                for k in range(len(exps)):
                    row = np.zeros(nao_cart)
                    row[column] = coeff[c, k]
                    rows.append(row)
                    exponents.append(exps[k])
                    atoms.append(atom)
                    powers.append(power)
                column += 1
    assert column == nao_cart
    return PrimitiveBasis(
        exponents=np.asarray(exponents),
        atom=np.asarray(atoms, np.int32),
        powers=np.asarray(powers, np.int32),
        contraction=np.asarray(rows),
        cart2sph=np.asarray(mol.cart2sph_coeff()),
        charges=mol.atom_charges().astype(float),
        coords=mol.atom_coords(),
        one_centre=one_centre_one_electron(mol),
    )


def one_centre_one_electron(mol: gto.Mole) -> np.ndarray:
    """(3, N, N) float64 from libcint: within each atom's block of AOs, the overlap, the kinetic
    energy and the attraction to that atom's own nucleus (zero elsewhere).

    They do not depend on the geometry, and they are the largest one-electron integrals (an O core's
    attraction to its nucleus is ~60 Hartree, where float32 resolves only 4e-6): the device kernels
    compute everything else and add these.
    """
    out = np.zeros((3, mol.nao_nr(), mol.nao_nr()))
    blocks: dict[str, np.ndarray] = {}  # by atom symbol: atoms of one symbol have one basis and charge
    for atom, (s0, s1, a0, a1) in enumerate(mol.aoslice_by_atom()):
        if s1 == s0:
            continue
        symbol = mol.atom_symbol(atom)
        if symbol not in blocks:
            block = (s0, s1, s0, s1)
            with mol.with_rinv_origin(mol.atom_coord(atom)):
                blocks[symbol] = np.stack([mol.intor("int1e_ovlp", shls_slice=block), mol.intor("int1e_kin", shls_slice=block),
                                           -mol.atom_charge(atom) * mol.intor("int1e_rinv", shls_slice=block)])  # fmt: skip
        out[:, a0:a1, a0:a1] = blocks[symbol]
    return out
