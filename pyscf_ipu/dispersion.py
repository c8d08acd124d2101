"""Empirical dispersion corrections, added to a functional's energy and forces: none; Grimme's D3
with Becke-Johnson damping, D3(BJ); or Chai and Head-Gordon's damped C6 term, ωB97X-D's own; chosen
by name from :data:`DISPERSIONS`.

D3(BJ) [S. Grimme, S. Ehrlich, L. Goerigk, J. Comput. Chem. 32, 1456 (2011)] is a sum over atom pairs,

    E_disp = -sum_{A<B} sum_{n=6,8} s_n C_n^AB / (r_AB^n + (a_1 R_0^AB + a_2)^n),

with C_6^AB interpolated from reference values by the atoms' coordination numbers, C_8^AB from C_6^AB,
R_0^AB = sqrt(C_8^AB / C_6^AB), and s_6, s_8, a_1, a_2 fitted per functional. It depends on the
geometry alone, so it is computed on the host per conformer, in float64, by the ``pyscf-dispersion``
package (the simple-DFTD3 library, which PySCF's own ``mf.disp`` calls), with its parameters for the
functional. The three-body term is left out, as PySCF leaves it out for ``disp = "d3bj"``.

ωB97X-D's correction [J.-D. Chai and M. Head-Gordon, Phys. Chem. Chem. Phys. 10, 6615 (2008)] is

    E_disp = -sum_{A<B} C_6^AB / (r_AB^6 (1 + a (r_AB / R_r^AB)^-12)),   a = 6,

with C_6^AB = sqrt(C_6^A C_6^B) and R_r^AB = R_0^A + R_0^B from the per-element C_6 and van der Waals
radii of Grimme's D2 [S. Grimme, J. Comput. Chem. 27, 1787 (2006)], unscaled. No library PySCF
uses implements it (PySCF refuses ``wb97x-d``), so it is written here, in float64 on the host, and
tested against Psi4's ``-CHG`` correction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np
from pyscf import gto
from pyscf.data.elements import ELEMENTS

from .config import OWN_DISPERSION, ConfigError
from .molecule import Molecule, MoleculeError, atomic_number
from .units import BOHR_PER_ANGSTROM, BOHR_RADIUS_ANGSTROM
from .xc.functionals import Functional


@dataclass(frozen=True)
class NoDispersion:
    """No correction: the functional's energy and forces as they are."""

    name: str = "none"
    in_pyscf: ClassVar[bool] = True

    def energy_terms(self, molecule: Molecule, functional: Functional) -> dict[str, float]:
        """The terms this correction adds to the energy (Hartree): none."""
        return {}

    def gradient(self, molecule: Molecule, functional: Functional, gradient: np.ndarray) -> np.ndarray:
        """``gradient`` (natm, 3) (Hartree/Bohr) with the correction's added: as it is."""
        return gradient

    def check(self, functional: Functional) -> None:
        """Every functional takes no correction."""

    def check_elements(self, symbols) -> None:
        """Every element takes no correction."""

    def pyscf_counterpart(self, mf):
        """PySCF's mean-field object ``mf`` with the same correction: as it is."""
        return mf


@dataclass(frozen=True)
class D3BJ:
    """Grimme's D3 with Becke-Johnson damping, two-body, with the parameters published for the
    functional (B3LYP5 takes B3LYP's, as in PySCF)."""

    name: str = "d3bj"
    in_pyscf: ClassVar[bool] = True

    def energy_terms(self, molecule: Molecule, functional: Functional) -> dict[str, float]:
        """``{"dispersion": E_disp}`` in Hartree."""
        return {"dispersion": float(_d3bj(molecule, functional.name).get_dispersion()["energy"])}

    def gradient(self, molecule: Molecule, functional: Functional, gradient: np.ndarray) -> np.ndarray:
        """``gradient`` (natm, 3) (Hartree/Bohr) plus dE_disp/dR."""
        correction = _d3bj(molecule, functional.name).get_dispersion(grad=True)["gradient"]
        return gradient + np.asarray(correction, np.float64)

    def check(self, functional: Functional) -> None:
        """:class:`ConfigError` where the library has no parameters for ``functional``."""
        _d3bj(_HYDROGEN, functional.name)

    def check_elements(self, symbols) -> None:
        """The library's reference values cover H to Pu, beyond every all-electron basis this package takes."""

    def pyscf_counterpart(self, mf):
        """PySCF's mean-field object ``mf`` with the same correction (``mf.disp``)."""
        mf.disp = "d3bj"
        return mf


_HYDROGEN = Molecule(np.array([1, 1]), np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 1.4]]))


# By molecule object (a Molecule compares by identity): a conformer's energy, in its finalisation, and
# its gradient, with --forces, share one model and one PySCF Mole, whose building costs more than both.
# The size holds a batch's conformers, whose labels are all read before their gradients.
@lru_cache(maxsize=1024)
def _d3bj(molecule: Molecule, functional: str):
    """The library's D3(BJ) model of ``molecule`` with ``functional``'s parameters."""
    from pyscf.dispersion import dftd3  # only where the correction is asked for

    # the library reads the atoms from a Mole; its basis is never used: one s function per element
    mol = gto.M(atom=molecule.pyscf_atom(), unit="Bohr", basis={s: [[0, [1.0, 1.0]]] for s in set(molecule.symbols)},
                charge=molecule.charge, spin=molecule.spin, verbose=0)  # fmt: skip
    try:
        return dftd3.DFTD3Dispersion(mol, functional, version="d3bj")
    except RuntimeError:  # the library's way of saying it has no parameters for the functional
        raise ConfigError(f"D3(BJ) has no parameters for the functional {functional!r}: choose --dispersion "
                          "none") from None


# Grimme's D2 per element, H to Xe [J. Comput. Chem. 27, 1787 (2006), table 1]: C_6 in J nm^6 mol^-1 and the
# van der Waals radius R_0 in Angstrom; the transition metals of a row share one pair.
_D2_C6 = (0.14, 0.08, 1.61, 1.61, 3.13, 1.75, 1.23, 0.70, 0.75, 0.63, 5.71, 5.71, 10.79, 9.23, 7.84, 5.57, 5.07,
          4.61, 10.80, 10.80, *(10.80,) * 10, 16.99, 17.10, 16.37, 12.64, 12.47, 12.01, 24.67, 24.67,
          *(24.67,) * 10, 37.32, 38.71, 38.44, 31.74, 31.50, 29.99)  # fmt: skip
_D2_R0 = (1.001, 1.012, 0.825, 1.408, 1.485, 1.452, 1.397, 1.342, 1.287, 1.243, 1.144, 1.364, 1.639, 1.716, 1.705,
          1.683, 1.639, 1.595, 1.485, 1.474, *(1.562,) * 10, 1.650, 1.727, 1.760, 1.771, 1.749, 1.727, 1.628, 1.606,
          *(1.639,) * 10, 1.672, 1.804, 1.881, 1.892, 1.892, 1.881)  # fmt: skip
# J nm^6 mol^-1 -> Hartree Bohr^6 (CODATA 2018's Hartree energy in J and Avogadro constant)
_C6_TO_ATOMIC = 1.0 / (4.3597447222071e-18 * 6.02214076e23) * (10.0 / BOHR_RADIUS_ANGSTROM) ** 6
_CHG_DAMPING = 6.0  # the paper's a


@dataclass(frozen=True)
class ChaiHeadGordon:
    """ωB97X-D's damped C_6 dispersion (the module doc), for that functional alone: it was fitted with it."""

    name: str = "chg"
    in_pyscf: ClassVar[bool] = False

    def energy_terms(self, molecule: Molecule, functional: Functional) -> dict[str, float]:
        """``{"dispersion": E_disp}`` in Hartree."""
        c6, radius, distance = _chg_pairs(molecule)
        return {"dispersion": float(-0.5 * np.sum(c6 / _chg_denominator(distance, radius)))}  # each pair twice

    def gradient(self, molecule: Molecule, functional: Functional, gradient: np.ndarray) -> np.ndarray:
        """``gradient`` (natm, 3) (Hartree/Bohr) plus dE_disp/dR: each pair's dE/dr along its bond."""
        c6, radius, distance = _chg_pairs(molecule)
        denominator = _chg_denominator(distance, radius)  # (natm, natm)
        # E_AB = -C6 / D(r), D = r^6 + a R^12 r^-6: dE/dr = C6 D'(r) / D^2
        d_denominator = 6.0 * distance**5 - 6.0 * _CHG_DAMPING * radius**12 * distance**-7.0
        with np.errstate(invalid="ignore"):  # inf / inf on the diagonal, zeroed next
            de_dr = c6 * d_denominator / denominator**2
        np.fill_diagonal(de_dr, 0.0)
        positions = np.asarray(molecule.positions, np.float64)
        unit = (positions[:, None, :] - positions[None, :, :]) / distance[..., None]  # (natm, natm, 3): B to A
        return gradient + np.einsum("ab,abx->ax", de_dr, unit)

    def check(self, functional: Functional) -> None:
        """:class:`ConfigError` for any functional but ωB97X-D."""
        if OWN_DISPERSION.get(functional.name) != self.name:
            raise ConfigError(f"--dispersion chg is ωB97X-D's own, fitted with it: not for --xc {functional.name} "
                              "(choose d3bj or none)")

    def check_elements(self, symbols) -> None:
        """:class:`MoleculeError` for an element beyond Xe, where D2's tables end."""
        _d2_indices([atomic_number(symbol) for symbol in symbols])

    def pyscf_counterpart(self, mf):
        """PySCF has no such correction: :class:`ConfigError` (compare with ``--dispersion none``, or add
        :meth:`energy_terms` to PySCF's energy without it)."""
        raise ConfigError("PySCF has no Chai and Head-Gordon dispersion: compare its wb97x-d with --dispersion none")


def _chg_pairs(molecule: Molecule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each pair's C_6 (Hartree Bohr^6), R_r (Bohr) and distance (Bohr), (natm, natm) each; a distance
    of inf on the diagonal, so that no atom pairs with itself."""
    index = _d2_indices(molecule.atomic_numbers)
    c6 = np.asarray(_D2_C6)[index] * _C6_TO_ATOMIC
    r0 = np.asarray(_D2_R0)[index] * BOHR_PER_ANGSTROM
    positions = np.asarray(molecule.positions, np.float64)
    distance = np.linalg.norm(positions[:, None, :] - positions[None, :, :], axis=-1)
    np.fill_diagonal(distance, np.inf)
    return np.sqrt(c6[:, None] * c6[None, :]), r0[:, None] + r0[None, :], distance


def _d2_indices(numbers) -> np.ndarray:
    """Rows of the D2 tables for atomic numbers ``numbers``; :class:`MoleculeError` beyond Xe."""
    numbers = np.asarray(numbers, int)
    beyond = sorted({ELEMENTS[z] for z in numbers if not 1 <= z <= len(_D2_C6)})
    if beyond:
        raise MoleculeError(f"--dispersion chg (ωB97X-D's) has parameters for H to Xe only, not {', '.join(beyond)}")
    return numbers - 1


def _chg_denominator(distance: np.ndarray, radius: np.ndarray) -> np.ndarray:
    """r^6 (1 + a (r / R_r)^-12) = r^6 + a R_r^12 r^-6, a pair's energy's denominator (inf on the diagonal)."""
    return distance**6 + _CHG_DAMPING * radius**12 * distance**-6.0


DISPERSIONS: dict[str, NoDispersion | D3BJ | ChaiHeadGordon] = {
    d.name: d for d in (NoDispersion(), D3BJ(), ChaiHeadGordon())
}
