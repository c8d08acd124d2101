"""Geometry files: multi-frame XYZ, QM9's XYZ, qm9pack's CSV and SDF (V2000 and V3000), against the
writers that made them (RDKit for SDF, qm9pack's own numbers for QM9)."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
from rdkit import Chem
from rdkit.Chem import AllChem

from pyscf_ipu.geometries import from_xyz, read_frames
from pyscf_ipu.molecule import MoleculeError
from pyscf_ipu.qm9 import qm9_molecules
from pyscf_ipu.units import BOHR_PER_ANGSTROM

from .molecules import qm9_rows, qm9_xyz

WATER = "O 0 0 0.1173\nH 0 0.7572 -0.4692\nH 0 -0.7572 -0.4692\n"


def embedded(smiles: str, count: int, seed: int = 7) -> Chem.Mol:
    mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
    AllChem.EmbedMultipleConfs(mol, count, randomSeed=seed)
    return mol


def test_multi_frame_xyz(tmp_path):
    """Frames one after another, blank lines between them, extra columns ignored, every frame
    located by its first line."""
    path = tmp_path / "traj.xyz"
    path.write_text(f"3\nframe 0\n{WATER}\n\n3\nframe 1 energy=-76.4\n" + WATER.replace("0.1173", "0.2000 0.5 x")
                    + "2\nH2\nH 0 0 0\nH 0 0 0.74\n")  # fmt: skip
    frames = read_frames(path)
    assert [f.title for f in frames] == ["frame 0", "frame 1 energy=-76.4", "H2"]
    assert [f.source for f in frames] == ["traj.xyz:1", "traj.xyz:8", "traj.xyz:13"]
    assert frames[0].symbols == ("O", "H", "H") and frames[0].identity == frames[1].identity != frames[2].identity
    np.testing.assert_allclose(frames[1].positions[0], [0, 0, 0.2])
    molecule = frames[2].molecule()
    np.testing.assert_allclose(molecule.positions[1], [0, 0, 0.74 * BOHR_PER_ANGSTROM])


def test_qm9_xyz_files_one_by_one_and_concatenated(tmp_path):
    """QM9's own layout (tab-separated, Mulliken charges, '*^' exponents, three lines after the atoms):
    the geometry equals pyscf_ipu.qm9's reading of qm9pack, and the GDB SMILES is kept."""
    indices = [1, 21989, 53938]
    rows = qm9_rows(indices)
    texts = [qm9_xyz(row) for row in rows]
    # QM9's files write some small numbers as Mathematica does (qm9pack's CSV has them converted)
    texts[0] = texts[0].replace("\t0.002150416\t", "\t2.150416*^-3\t")
    assert "*^" in texts[0]
    expected = qm9_molecules(indices)
    for k, text in enumerate(texts):
        (tmp_path / f"dsgdb9nsd_{indices[k]:06d}.xyz").write_text(text)
        frame, = read_frames(tmp_path / f"dsgdb9nsd_{indices[k]:06d}.xyz")
        assert frame.title.startswith(f"gdb {indices[k]}\t") and frame.smiles == rows[k]["SMILES"]
        np.testing.assert_allclose(frame.molecule().positions, expected[k].molecule.positions, rtol=0, atol=1e-12)
    (tmp_path / "all.xyz").write_text("".join(texts))
    assert [f.smiles for f in read_frames(tmp_path / "all.xyz")] == [r["SMILES"] for r in rows]


def test_qm9pack_csv_rows_are_frames(tmp_path):
    """qm9pack's own rows, and one with a garbled cell: that frame keeps the problem, the rest read."""
    import csv

    rows = qm9_rows([1, 2, 3])
    rows.append({**rows[0], "Index": "4", "Elements": "['C', 'H'"})
    with (tmp_path / "part.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    frames = read_frames(tmp_path / "part.csv")
    assert [f.title for f in frames] == ["gdb 1", "gdb 2", "gdb 3", "gdb 4"] and frames[1].smiles == "N"
    assert [f.source for f in frames] == ["part.csv:2", "part.csv:3", "part.csv:4", "part.csv:5"]
    np.testing.assert_allclose(frames[2].molecule().positions, qm9_molecules([3])[0].molecule.positions)
    with pytest.raises(MoleculeError, match="cannot read its Elements and XYZ_Ang cells"):
        frames[3].molecule()
    (tmp_path / "other.csv").write_text("smiles,name\nCCO,x\n")
    with pytest.raises(MoleculeError, match="qm9pack's columns"):
        read_frames(tmp_path / "other.csv")


@pytest.mark.parametrize("v3000", [False, True], ids=["V2000", "V3000"])
def test_sdf_conformers_charges_bonds_and_smiles(tmp_path, v3000):
    """An RDKit-written SDF: every conformer of every record with RDKit's coordinates (to the file's
    four decimals), its bonds, formal charges (a zwitterion: +1 and -1, net 0) and SMILES item."""
    path = tmp_path / "confs.sdf.gz"
    molecules = {"CCO": embedded("CCO", 3), "[NH3+]CC(=O)[O-]": embedded("[NH3+]CC(=O)[O-]", 2)}
    with gzip.open(path, "wt") as handle:
        writer = Chem.SDWriter(handle)
        writer.SetForceV3000(v3000)
        for smiles, mol in molecules.items():
            mol.SetProp("SMILES", smiles)
            for conf in mol.GetConformers():
                writer.write(mol, confId=conf.GetId())
        writer.close()
    frames = read_frames(path)
    assert len(frames) == 5 and [f.smiles for f in frames] == ["CCO"] * 3 + ["[NH3+]CC(=O)[O-]"] * 2
    for frame, (mol, conf) in zip(frames, [(m, c) for m in molecules.values() for c in m.GetConformers()]):
        assert frame.symbols == tuple(a.GetSymbol() for a in mol.GetAtoms()) and frame.charge == 0
        np.testing.assert_allclose(frame.positions, conf.GetPositions(), rtol=0, atol=5e-5)
        assert sorted(frame.bonds) == sorted((b.GetBeginAtomIdx(), b.GetEndAtomIdx(), int(b.GetBondTypeAsDouble()))
                                             for b in mol.GetBonds())  # fmt: skip
        assert frame.problem == ""
    assert frames[0].identity == frames[2].identity != frames[3].identity


def test_sdf_problems_are_kept_per_frame(tmp_path):
    """A charged ion, a record without its hydrogens and a radical: each frame says what it is, and
    the file still reads."""
    ion = embedded("C[NH3+]", 1)
    bare = Chem.MolFromSmiles("CCO")
    AllChem.EmbedMolecule(bare, randomSeed=3)
    radical = Chem.MolFromSmiles("[CH3]")
    radical = Chem.AddHs(radical)
    AllChem.EmbedMolecule(radical, randomSeed=3)
    (tmp_path / "bad.sdf").write_text("$$$$\n".join(Chem.MolToMolBlock(m) for m in (ion, bare, radical)) + "$$$$\n")
    ion_frame, bare_frame, radical_frame = read_frames(tmp_path / "bad.sdf")
    assert ion_frame.charge == 1 and ion_frame.problem == ""
    assert "implicit hydrogens: atom 1 (C)" in bare_frame.problem
    assert "radical" in radical_frame.problem
    with pytest.raises(MoleculeError, match="implicit hydrogens"):
        bare_frame.molecule()


def test_bad_frames_and_broken_files(tmp_path):
    """A frame that cannot be a molecule fails alone (the reader goes on); a broken layout fails the
    file, naming the line."""
    path = tmp_path / "mixed.xyz"
    path.write_text(f"3\nok\n{WATER}2\nunknown\nXx 0 0 0\nH 0 0 1\n2\nnot a number\nH 0 0 a\nH 0 0 1\n"
                    "2\nclash\nH 0 0 0\nH 0 0 0.05\n")  # fmt: skip
    ok, unknown, garbled, clash = read_frames(path)
    ok.molecule()
    with pytest.raises(MoleculeError, match="unknown element 'Xx'"):
        unknown.molecule()
    with pytest.raises(MoleculeError, match="atom 1: expected 'symbol x y z'"):
        garbled.molecule()
    with pytest.raises(MoleculeError, match="0.05 Angstrom apart"):
        clash.molecule()
    path.write_text(f"3\nok\n{WATER}H 0 0 0\n")
    with pytest.raises(MoleculeError, match=r"mixed.xyz:6: each frame's first line must be the atom count"):
        read_frames(path)
    path.write_text(f"4\ncut short\n{WATER}")
    with pytest.raises(MoleculeError, match=r"mixed.xyz:1: the header says 4 atoms but 3 atom lines follow"):
        read_frames(path)
    with pytest.raises(MoleculeError, match="unknown geometry format"):
        read_frames(tmp_path / "x.pdb")
    with pytest.raises(MoleculeError, match="cannot read"):
        read_frames(tmp_path / "missing.sdf")


def test_from_xyz_takes_one_frame(tmp_path):
    path = tmp_path / "two.xyz"
    path.write_text(f"3\na\n{WATER}3\nb\n{WATER}")
    with pytest.raises(MoleculeError, match="holds 2 frames"):
        from_xyz(path)
