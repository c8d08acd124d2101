"""The test molecules: named ones, and five 9-heavy-atom QM9 molecules with real geometries."""

from __future__ import annotations

from pyscf_ipu.molecule import Molecule, from_name

# A pyridine oxime, a fluorinated one, an aromatic bicycle (isoindole), a cage with a nitrile and an
# alkyne, and an open chain with three oxygens.
QM9_NINE_HEAVY = [21989, 22032, 24320, 33818, 53938]
SMALL = ["water", "methane", "benzene"]
QM9 = [f"qm9:{i}" for i in QM9_NINE_HEAVY]


def molecule_by_name(name: str, qm9: dict[int, Molecule]) -> Molecule:
    """'water', 'benzene', ... or 'qm9:21989' (looked up in ``qm9``)."""
    if name.startswith("qm9:"):
        return qm9[int(name[4:])]
    return from_name(name)
