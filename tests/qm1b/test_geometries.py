"""qm1b generate --geometries: a file's own conformers labelled like PySCF float64, bad frames in the
failures table, ids from the file, --resume after a kill, and no RDKit needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyscf_ipu.config import RKSConfig
from qm1b.generate import generate
from qm1b.settings import GENERATOR_DFT_DEFAULTS, GenerateConfig
from qm1b.store import export_parquet, open_dataset
from qm1b.settings import dft_config

from ..molecules import qm9_rows, qm9_xyz
from .test_generate import ROOT, assert_labels_match, assert_same_rows, kill_after_commits, run_cli

WATER = [("O", 0, 0, 0.1173), ("H", 0, 0.7572, -0.4692), ("H", 0, -0.7572, -0.4692)]
FORMALDEHYDE = [("C", 0, 0, -0.53), ("O", 0, 0, 0.68), ("H", 0, 0.94, -1.11), ("H", 0, -0.94, -1.11)]


def frame(atoms, comment: str, stretch: float = 1.0) -> str:
    """One XYZ frame, its coordinates scaled by ``stretch`` (another conformer of the same atoms)."""
    rows = "".join(f"{s} {x * stretch} {y * stretch} {z * stretch}\n" for s, x, y, z in atoms)
    return f"{len(atoms)}\n{comment}\n{rows}"


# A trajectory of (molecule_id, conformer_id) -> what happens: frames of one molecule in a row.
XYZ_FRAMES = [
    frame(WATER, "water 0"), frame(WATER, "water 1", 1.02), frame(WATER, "water 2", 0.98),  # molecule 0
    frame([("Xx", 0, 0, 0), ("H", 0, 0, 1)], "unknown element"),  # 1: fails
    frame([("C", 0, 0, 0), ("H", 0, 0, 1.09), ("H", 1.03, 0, -0.36), ("H", -0.51, 0.89, -0.36)], "methyl"),  # 2: fails
    frame([("H", 0, 0, 0), ("H", 0, 0, 0.05)], "clash"), frame([("H", 0, 0, 0), ("H", 0, 0, 0.74)], "H2"),  # 3: 0 fails
    frame(FORMALDEHYDE, "formaldehyde 0"), frame(FORMALDEHYDE, "formaldehyde 1", 1.03),  # 4
]  # fmt: skip
XYZ_RECORDS = [(0, 0), (0, 1), (0, 2), (3, 1), (4, 0), (4, 1)]
XYZ_FAILURES = {(1, 0): "unknown element 'Xx'", (2, 0): "9 electrons", (3, 0): "0.05 Angstrom apart"}


@pytest.fixture(scope="module")
def geometry_files(tmp_path_factory) -> dict[str, Path]:
    """Three small inputs, each with what its format brings: a multi-frame XYZ trajectory with bad
    frames; an SDF of RDKit conformers with a charged ion and a record without its hydrogens; a
    directory of QM9's own files (methane, ammonia, water)."""
    from rdkit import Chem
    from rdkit.Chem import AllChem

    folder = tmp_path_factory.mktemp("geometries")
    (folder / "traj.xyz").write_text("".join(XYZ_FRAMES))
    writer = Chem.SDWriter(str(folder / "confs.sdf"))
    for smiles, count, hydrogens in [("CCO", 2, True), ("CO", 1, True), ("C[NH3+]", 1, True), ("CC=O", 1, False)]:
        mol = Chem.MolFromSmiles(smiles)
        mol = Chem.AddHs(mol) if hydrogens else mol
        AllChem.EmbedMultipleConfs(mol, count, randomSeed=11)
        mol.SetProp("SMILES", smiles)
        for conf in mol.GetConformers():
            writer.write(mol, confId=conf.GetId())
    writer.close()
    qm9 = folder / "qm9"
    qm9.mkdir()
    for row in qm9_rows([1, 2, 3]):
        (qm9 / f"dsgdb9nsd_{int(row['Index']):06d}.xyz").write_text(qm9_xyz(row))
    return {"xyz": folder / "traj.xyz", "sdf": folder / "confs.sdf", "qm9": qm9}


EXPECTED = {  # records, failures (key -> part of the reason), SMILES per molecule
    "xyz": (XYZ_RECORDS, XYZ_FAILURES, {0: "", 3: "", 4: ""}),
    "sdf": ([(0, 0), (0, 1), (1, 0)], {(2, 0): "charged species (charge +1)", (3, 0): "implicit hydrogens"},
            {0: "CCO", 1: "CO"}),
    "qm9": ([(0, 0), (1, 0), (2, 0)], {}, {0: "C", 1: "N", 2: "O"}),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_geometries_are_labelled_like_pyscf(geometry_files, kind, tmp_path, reference):
    """Each format's good frames within 0.5 meV of PySCF float64 (B3LYP5/STO-3G, the generator's
    defaults) on the same geometries, with ids from the file and its SMILES (or none) in ``smile``;
    every bad frame in the failures table with its reason; the export keeps QM1B's columns."""
    records, failures, smiles = EXPECTED[kind]
    gen = GenerateConfig(geometries=str(geometry_files[kind]), out=str(tmp_path / "out"), batch_size=2,
                         progress=False)  # fmt: skip
    summary = generate(gen, RKSConfig(**GENERATOR_DFT_DEFAULTS))
    assert (summary.conformers, summary.failures) == (len(records), len(failures))
    dataset = open_dataset(gen.out)
    config = dft_config(dataset.attrs["settings"])
    assert dataset.attrs["settings"]["geometries"] == str(geometry_files[kind]) and config.xc == "b3lyp5"
    rows = sorted(dataset.records(), key=lambda r: (r["molecule_id"], r["conformer_id"]))
    assert [(r["molecule_id"], r["conformer_id"]) for r in rows] == records
    for rec in rows:
        assert rec["smile"] == smiles[rec["molecule_id"]] and rec["converged"]
        assert_labels_match(rec, config, reference)
    recorded = {f.key: f for f in dataset.failures()}
    assert set(recorded) == set(failures)
    for key, reason in failures.items():
        assert reason in recorded[key].reason and recorded[key].input.startswith(geometry_files[kind].name)
    import pyarrow.parquet as pq

    from schnet.data import load_qm1b

    parquet = export_parquet(gen.out, tmp_path / "d.parquet")
    assert pq.read_table(parquet).column_names == ["smile", "atoms", "z", "pos", "energy", "homo", "lumo", "y", "N",
                                                   "std"]  # fmt: skip
    # SchNet splits by molecule: the SMILES, else (none given) the molecule id, or in Parquet the atoms
    assert set(load_qm1b(gen.out).group) == {smiles[m] or f"molecule {m}" for m in smiles}
    assert set(load_qm1b(parquet).group) == {smiles[r["molecule_id"]] or f"atoms {r['atoms']}" for r in rows}


def test_geometries_without_rdkit_resume_after_a_kill(geometry_files, tmp_path):
    """With RDKit unimportable: the XYZ trajectory labelled whole, then again killed between two
    commits and resumed; the resumed dataset equals the whole one (nothing lost, nothing twice)."""
    script = "import sys; sys.modules['rdkit'] = None\nfrom qm1b.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", script, "generate", "--geometries", str(geometry_files["xyz"]),
               "--batch-size", "1", "--no-progress"]  # fmt: skip
    whole = subprocess.run([*command, "--out", str(tmp_path / "whole")], env=env, capture_output=True, text=True,
                           timeout=900)  # fmt: skip
    assert whole.returncode == 0, whole.stderr
    assert len(open_dataset(tmp_path / "whole")) == len(XYZ_RECORDS)
    killed = tmp_path / "killed"
    kill_after_commits([*command, "--out", str(killed)], env, killed, 5)
    assert 0 < len(open_dataset(killed)) < len(XYZ_RECORDS)  # it really died mid-run
    resumed = subprocess.run([*command, "--out", str(killed), "--resume"], env=env, capture_output=True, text=True,
                             timeout=900)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert_same_rows(killed, tmp_path / "whole")
    assert sorted(f.key for f in open_dataset(killed).failures()) == sorted(XYZ_FAILURES)


@pytest.mark.parametrize("args, message", [
    (["--geometries", "/no/such.xyz"], "/no/such.xyz: no such file or directory"),
    (["--geometries", "{xyz}", "--smiles", "x.smi"], "does not combine with --smiles"),
    (["--geometries", "{xyz}", "--relax", "mmff"], "does not combine with --relax"),
])  # fmt: skip
def test_bad_geometry_arguments_are_one_line(geometry_files, tmp_path, args, message):
    result = run_cli("generate", *[a.format(xyz=geometry_files["xyz"]) for a in args], "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
