"""Empirical dispersion corrections, added to a functional's energy and forces: none, or Grimme's D3
with Becke-Johnson damping, D3(BJ); chosen by name from :data:`DISPERSIONS`.

D3(BJ) [S. Grimme, S. Ehrlich, L. Goerigk, J. Comput. Chem. 32, 1456 (2011)] is a sum over atom pairs,

    E_disp = -sum_{A<B} sum_{n=6,8} s_n C_n^AB / (r_AB^n + (a_1 R_0^AB + a_2)^n),

with C_6^AB interpolated from reference values by the atoms' coordination numbers, C_8^AB from C_6^AB,
R_0^AB = sqrt(C_8^AB / C_6^AB), and s_6, s_8, a_1, a_2 fitted per functional. It depends on the
geometry alone, so it is computed on the host per conformer, in float64, by the ``pyscf-dispersion``
package (the simple-DFTD3 library, which PySCF's own ``mf.disp`` calls), with its parameters for the
functional. The three-body term is left out, as PySCF leaves it out for ``disp = "d3bj"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .config import ConfigError
from .molecule import Molecule
from .pyscf_mole import build_mole
from .xc.functionals import Functional


@dataclass(frozen=True)
class NoDispersion:
    """No correction: the functional's energy and forces as they are."""

    name: str = "none"

    def energy_terms(self, molecule: Molecule, functional: Functional) -> dict[str, float]:
        """The terms this correction adds to the energy (Hartree): none."""
        return {}

    def gradient(self, molecule: Molecule, functional: Functional, gradient: np.ndarray) -> np.ndarray:
        """``gradient`` (natm, 3) (Hartree/Bohr) with the correction's added: as it is."""
        return gradient

    def check(self, functional: Functional) -> None:
        """Every functional takes no correction."""

    def pyscf_counterpart(self, mf):
        """PySCF's mean-field object ``mf`` with the same correction: as it is."""
        return mf


@dataclass(frozen=True)
class D3BJ:
    """Grimme's D3 with Becke-Johnson damping, two-body, with the parameters published for the
    functional (B3LYP5 takes B3LYP's, as in PySCF)."""

    name: str = "d3bj"

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

    # the library reads the atoms from a Mole; its basis is never used, def2-SVP's covers H to Rn
    mol = build_mole(molecule, "def2-svp")
    try:
        return dftd3.DFTD3Dispersion(mol, functional, version="d3bj")
    except RuntimeError:  # the library's way of saying it has no parameters for the functional
        raise ConfigError(f"D3(BJ) has no parameters for the functional {functional!r}: choose --dispersion "
                          "none") from None


DISPERSIONS: dict[str, NoDispersion | D3BJ] = {d.name: d for d in (NoDispersion(), D3BJ())}
