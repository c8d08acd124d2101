"""Physical constants and unit conversions: CODATA 2018.

PySCF keeps older revisions, within 1e-8 of these (tests/test_units.py).
"""

BOHR_RADIUS_ANGSTROM = 0.529177210903
BOHR_PER_ANGSTROM = 1.0 / BOHR_RADIUS_ANGSTROM  # 1.8897261246...
HARTREE_TO_EV = 27.211386245988
HARTREE_TO_MEV = 1000.0 * HARTREE_TO_EV
