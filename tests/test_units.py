"""The unit conversions against PySCF's own constants (``pyscf.data.nist``), an independent table.

Ours are CODATA 2018; PySCF 2.x keeps older recommended values (the Bohr radius of CODATA 2010, the
Hartree in eV of CODATA 2014). Between those revisions the Bohr radius moved by 3.2e-11 of itself and
the Hartree in eV by 8.3e-9, so each tolerance is a little above its revision's change: a wrong digit
in the first nine fails."""

import pytest
from pyscf.data import nist

from pyscf_ipu.units import BOHR_PER_ANGSTROM, BOHR_RADIUS_ANGSTROM, HARTREE_TO_EV, HARTREE_TO_MEV


def test_the_bohr_radius_is_pyscfs():
    assert BOHR_RADIUS_ANGSTROM == pytest.approx(nist.BOHR, rel=5e-11, abs=0)
    assert BOHR_PER_ANGSTROM * BOHR_RADIUS_ANGSTROM == pytest.approx(1.0, rel=1e-15, abs=0)


def test_the_hartree_in_ev_is_pyscfs():
    assert HARTREE_TO_EV == pytest.approx(nist.HARTREE2EV, rel=1e-8, abs=0)
    assert HARTREE_TO_MEV == pytest.approx(1000.0 * HARTREE_TO_EV, rel=1e-15, abs=0)
