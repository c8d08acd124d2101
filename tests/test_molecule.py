"""Molecule parsing and validation: every bad input gives a MoleculeError naming the problem."""

import numpy as np
import pytest

from pyscf_ipu.geometries import from_xyz, parse_molecule
from pyscf_ipu.molecule import NAMED_MOLECULES, MoleculeError, from_atom_string, from_name
from pyscf_ipu.units import BOHR_PER_ANGSTROM


def test_atom_string_in_angstrom_and_bohr():
    ang = from_atom_string("O 0 0 0; H 0 0.76 0.59\nh 0 -0.76 0.59")
    bohr = from_atom_string("O 0 0 0; H 0 0.76 0.59; H 0 -0.76 0.59", unit="bohr")
    assert ang.symbols == ("O", "H", "H")
    assert ang.nelectron == 10
    np.testing.assert_allclose(ang.positions[1], np.array([0, 0.76, 0.59]) * BOHR_PER_ANGSTROM)
    np.testing.assert_allclose(bohr.positions[1], [0, 0.76, 0.59])


def test_atomic_numbers_accepted_as_symbols():
    assert from_atom_string("8 0 0 0; 1 0 0.76 0.59; 1 0 -0.76 0.59").formula == "OHH"


def test_xyz_file(tmp_path):
    path = tmp_path / "w.xyz"
    path.write_text("3\nwater\nO 0 0 0\nH 0 0.76 0.59\nH 0 -0.76 0.59\n")
    mol = from_xyz(path)
    assert mol.formula == "OHH" and mol.name == "w" and mol.comment == "water"
    np.testing.assert_allclose(mol.positions[2], np.array([0, -0.76, 0.59]) * BOHR_PER_ANGSTROM)


@pytest.mark.parametrize("name", list(NAMED_MOLECULES))
def test_named_molecules_are_closed_shell_and_sensible(name):
    mol = from_name(name)
    assert mol.nelectron % 2 == 0
    dist = np.linalg.norm(mol.positions[:, None] - mol.positions[None], axis=-1) / BOHR_PER_ANGSTROM
    nearest = np.min(dist + 1e9 * np.eye(mol.natom), axis=1)
    assert np.all((nearest > 0.7) & (nearest < 1.6)), nearest  # bonded neighbours, in Angstrom


@pytest.mark.parametrize(
    "atoms, message",
    [
        ("Xx 0 0 0", "unknown element 'Xx'"),
        ("", "no atoms"),
        ("H 0 0 0", "even electron count"),
        ("H 0 0 0; H 0 0 0.05", "0.05 Angstrom apart"),
        ("H 0 0 nan; H 0 0 1", "NaN or infinite"),
        ("H 0 0 inf; H 0 0 1", "NaN or infinite"),
        ("H 0 0; H 0 0 1", "expected 'symbol x y z'"),
        ("H 0 0 a; H 0 0 1", "coordinates must be numbers"),
    ],
)
def test_bad_atom_strings(atoms, message):
    with pytest.raises(MoleculeError, match=message):
        from_atom_string(atoms)


def test_spin_and_charge():
    with pytest.raises(MoleculeError, match="closed shell"):
        parse_molecule(mol="water", spin=2)
    with pytest.raises(MoleculeError, match="even electron count"):
        parse_molecule(mol="water", charge=1)
    assert parse_molecule(mol="water", charge=2).nelectron == 8


def test_bad_xyz_files(tmp_path):
    bad = tmp_path / "bad.xyz"
    bad.write_text("4\n\nO 0 0 0\nH 0 0.76 0.59\n")
    with pytest.raises(MoleculeError, match="header says 4 atoms but 2"):
        from_xyz(bad)
    bad.write_text("water\nO 0 0 0\n")
    with pytest.raises(MoleculeError, match="atom count"):
        from_xyz(bad)
    with pytest.raises(MoleculeError, match="cannot read"):
        from_xyz(tmp_path / "missing.xyz")


def test_exactly_one_source():
    with pytest.raises(MoleculeError, match="exactly one"):
        parse_molecule(mol="water", atoms="H 0 0 0; H 0 0 1")
    with pytest.raises(MoleculeError, match="exactly one"):
        parse_molecule()
    with pytest.raises(MoleculeError, match="unknown molecule name"):
        parse_molecule(mol="unobtainium")
