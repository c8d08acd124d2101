"""The generator end to end: labels against PySCF, failures table, kill-and-resume, shards, Ray, tools."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.molecule import Molecule
from pyscf_ipu.units import HARTREE_TO_MEV
from qm1b.cli import main
from qm1b.generate import GenerateConfig, generate
from qm1b.store import export_parquet, info, open_dataset

ROOT = Path(__file__).resolve().parents[2]
GOOD = ["O", "CO", "C=O", "CC"]
BAD = {
    "C1CC": "bad SMILES",
    "[NH4+]": "charged",
    "[CH3]": "electron",
    "[Hg]": "not in basis",
}


def write_smiles(path: Path, smiles: list[str]) -> Path:
    path.write_text("# test molecules\n" + "".join(f"{s} m{k}\n" for k, s in enumerate(smiles)))
    return path


def sorted_rows(directory) -> list[tuple]:
    arrays = open_dataset(directory).arrays()
    cols = arrays.columns
    keys = ("molecule_id", "conformer_id", "energy", "homo", "lumo", "y", "std", "N", "converged", "iterations")
    rows = [tuple(np.asarray(cols[k])[i].item() for k in keys) for i in range(len(arrays))]
    return sorted(rows)


def assert_same_rows(directory, reference) -> None:
    """Exactly the same (molecule_id, conformer_id) keys, and the same labels to float64 round-off.

    Labels of one conformer computed in two processes agree only to round-off (PySCF's OpenMP
    reductions in the float64 finalisation do not fix their summation order), so they are compared
    to 1e-12 relative: far below any meV, far above what a different conformer or setting gives.
    """
    rows, expected = sorted_rows(directory), sorted_rows(reference)
    assert [row[:2] for row in rows] == [row[:2] for row in expected]
    np.testing.assert_allclose(np.array(rows, float), np.array(expected, float), rtol=1e-12, atol=0)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """4 good and 4 bad molecules, 2 conformers each, batches of 2: shared by several tests."""
    tmp = tmp_path_factory.mktemp("gen")
    smiles = write_smiles(tmp / "in.smi", GOOD + list(BAD))
    gen = GenerateConfig(smiles=str(smiles), out=str(tmp / "out"), conformers=2, batch_size=2, progress=False)
    (summary,) = generate(gen, RKSConfig())
    return gen, summary


def test_labels_match_pyscf(small_run, reference):
    gen, summary = small_run
    assert summary.conformers == 2 * len(GOOD) and summary.failures == len(BAD)
    for rec in open_dataset(gen.out).records():
        molecule = Molecule(np.asarray(rec["z"], int), np.asarray(rec["pos"], float))
        ref = reference(molecule, RKSConfig())
        errors = {
            "energy": rec["energy"] * 1000 - ref.energy * HARTREE_TO_MEV,
            "homo": rec["homo"] * 1000 - ref.homo * HARTREE_TO_MEV,
            "lumo": rec["lumo"] * 1000 - ref.lumo * HARTREE_TO_MEV,
            "y": rec["y"] * 1000 - ref.gap * HARTREE_TO_MEV,
        }
        assert max(abs(v) for v in errors.values()) < 2.0, errors
        assert rec["converged"] and rec["atoms"] == "".join(molecule.symbols)


def test_failures_are_recorded_not_raised(small_run):
    gen, _ = small_run
    failures = {f.input: f.reason for f in open_dataset(gen.out).failures()}
    for smiles, reason in BAD.items():
        assert reason in failures[smiles], (smiles, failures[smiles])
    settings = open_dataset(gen.out).attrs["settings"]
    assert settings["basis"] == "sto-3g" and settings["seed"] == 1 and settings["jk"] == "ipu"


def test_export_validate_info_plot(small_run, tmp_path, capsys):
    gen, _ = small_run
    import pyarrow.parquet as pq

    table = pq.read_table(export_parquet(gen.out, tmp_path / "d.parquet"))
    assert table.column_names == ["smile", "atoms", "z", "pos", "energy", "homo", "lumo", "y", "N", "std"]
    arrays = open_dataset(gen.out).arrays()
    np.testing.assert_array_equal(table.column("energy").to_numpy(), arrays.columns["energy"])
    stats = info(gen.out)
    assert stats["records"] == 8 and stats["failures"] == len(BAD)
    # the records' seconds share out the generator's wall time (setup and the final merge aside)
    spent = stats["throughput"]["worker_hours"] * 3600
    assert 0.5 * small_run[1].seconds < spent <= small_run[1].seconds
    capsys.readouterr()
    assert main(["info", gen.out]) == 0
    shown = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines() if " " in line.strip())
    assert shown["records"] == "8" and shown["failures"] == str(len(BAD))
    assert main(["validate", gen.out, "--sample", "2"]) == 0
    assert main(["plot", gen.out, "--png", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 5000


def test_kill_and_resume_equals_uninterrupted(tmp_path):
    smiles = write_smiles(tmp_path / "in.smi", GOOD)
    args = ["generate", "--smiles", str(smiles), "--conformers", "3", "--batch-size", "1", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "qm1b.cli", *args]
    whole = tmp_path / "whole"
    subprocess.run(command + ["--out", str(whole)], check=True, env=env, timeout=900, capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command + ["--out", str(killed)], env=env, stderr=subprocess.DEVNULL)
    parts = killed / "shard-00000-of-00001.parts"
    deadline = time.time() + 600
    while time.time() < deadline and len(list(parts.glob("part-*.h5"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = len(open_dataset(killed))
    assert 0 < committed < 12  # it really died mid-run
    subprocess.run(command + ["--out", str(killed), "--resume"], check=True, env=env, timeout=900, capture_output=True)
    assert_same_rows(killed, whole)  # nothing lost, nothing duplicated


def test_existing_output_needs_resume(small_run, capsys):
    gen, _ = small_run
    code = main(["generate", "--smiles", gen.smiles, "--out", gen.out, "--conformers", "2", "--no-progress"])
    assert code == 2 and "--resume" in capsys.readouterr().err
    code = main(["generate", "--smiles", "/no/such.smi", "--out", gen.out + "x"])
    assert code == 2


def test_shards_partition_the_input(tmp_path):
    smiles = write_smiles(tmp_path / "in.smi", GOOD)
    ids = []
    for i in range(2):
        gen = GenerateConfig(smiles=str(smiles), out=str(tmp_path / "o"), conformers=1, shard=f"{i}/2", progress=False)
        generate(gen, RKSConfig())
    ds = open_dataset(tmp_path / "o")
    ids = sorted(np.asarray(ds.arrays().columns["molecule_id"]).tolist())
    assert ids == list(range(len(GOOD)))  # disjoint and complete


def test_ray_executor_equals_local(tmp_path):
    ray = pytest.importorskip("ray")
    smiles = write_smiles(tmp_path / "in.smi", GOOD[:2])
    common = dict(smiles=str(smiles), conformers=2, batch_size=2, progress=False)
    local = [generate(GenerateConfig(out=str(tmp_path / "local"), shard=f"{i}/2", **common), RKSConfig()) for i in range(2)]
    assert sum(s[0].conformers for s in local) == 4
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        summaries = generate(GenerateConfig(out=str(tmp_path / "ray"), executor="ray", ray_shards=2, **common), RKSConfig())
    finally:
        ray.shutdown()
    assert len(summaries) == 2
    assert_same_rows(tmp_path / "ray", tmp_path / "local")


def test_forces_column_matches_pyscf_and_survives_resume_and_merge(tmp_path):
    """--forces: a forces column (eV/Bohr, = -dE/dR) per atom, equal to PySCF's analytic gradient
    with grid response (the generator's forces are the exact derivative of its energy) within 1e-4
    Hartree/Bohr; stored, merged and read back intact; a resume with different --forces is refused."""
    from pyscf import dft

    from pyscf_ipu.host import build_mole
    from pyscf_ipu.units import HARTREE_TO_EV

    smiles = write_smiles(tmp_path / "in.smi", ["O", "CO"])
    gen = GenerateConfig(smiles=str(smiles), out=str(tmp_path / "out"), conformers=2, batch_size=2, forces=True,
                         progress=False)  # fmt: skip
    generate(gen, RKSConfig())
    rows = list(open_dataset(gen.out).records())  # read from the merged shard file
    assert len(rows) == 4 and all(r["forces"].shape == (len(r["z"]), 3) for r in rows)
    for rec in rows[::3]:  # one conformer of each molecule
        molecule = Molecule(np.asarray(rec["z"], int), np.asarray(rec["pos"], float))
        mf = dft.RKS(build_mole(molecule, "sto-3g"), xc="b3lyp")
        mf.grids.level = 0
        mf.conv_tol = 1e-11
        mf.kernel()
        grad = mf.nuc_grad_method()
        grad.grid_response = True
        ref = grad.kernel()
        np.testing.assert_allclose(-np.asarray(rec["forces"], float) / HARTREE_TO_EV, ref, rtol=0, atol=1e-4)
    assert "forces" in open_dataset(gen.out).to_pandas().columns
    with pytest.raises(ValueError, match="forces"):
        generate(GenerateConfig(**{**gen.__dict__, "forces": False, "resume": True}), RKSConfig())
