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


def qm9_rows(indices: list[int]) -> list[dict]:
    """qm9pack's CSV rows of the given QM9 indices, in that order."""
    from pyscf_ipu.qm9 import rows

    wanted, found = set(indices), {}
    for row in rows():
        if int(row["Index"]) in wanted:
            found[int(row["Index"])] = row
            if len(found) == len(wanted):
                break
    return [found[i] for i in indices]


def qm9_xyz(row: dict) -> str:
    """A qm9pack row in the layout of QM9's own ``dsgdb9nsd_NNNNNN.xyz`` files: the atom count; 'gdb N'
    and the properties; element, x, y, z and Mulliken charge per atom; the frequencies; the SMILES
    (GDB's and the relaxed geometry's); the InChIs. Numbers as qm9pack gives them ('*^' exponents)."""
    import json
    import re

    def numbers(text: str) -> list[str]:
        return re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:(?:[eE]|\*\^)[-+]?\d+)?", text)

    symbols = json.loads(row["Elements"].replace("'", '"'))
    xyz, charges = numbers(row["XYZ_Ang"]), numbers(row["Mulliken_pop"])
    keys = ["RotA_GHz", "RotB_GHz", "RotC_GHz", "Dipole_debye", "Polarizability_bohr3", "HOMO_au", "LUMO_au",
            "HOMO_LUMO_gap_au", "R2_bohr2", "ZPVE_au", "InternalEnergy_0K_au", "InternalEnergy_298K_au",
            "Enthalphy_298K_au", "GibbsFreeEnergy_298K_au", "Heatcapacity_Cv_cal_mol_K"]  # fmt: skip
    lines = [str(len(symbols)), "\t".join([f"gdb {row['Index']}", *(row[k] for k in keys)]) + "\t"]
    lines += ["\t".join([s, *xyz[3 * k : 3 * k + 3], charges[k]]) for k, s in enumerate(symbols)]
    lines += ["\t".join(numbers(row["Harmonic_Freq_cmi"])), f"{row['SMILES']}\t{row['SMILES']}",
              f"{row['InChi']}\t{row['InChi']}"]  # fmt: skip
    return "\n".join(lines) + "\n"
