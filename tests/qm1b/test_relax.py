"""``qm1b generate --relax dft``: relaxed records, trajectory frames against PySCF's gradient, the
extended XYZ export read by ASE, failures with their reasons, and kill-and-resume."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.units import BOHR_PER_ANGSTROM, HARTREE_TO_EV
from qm1b.cli import main
from qm1b.generate import generate
from qm1b.settings import GENERATOR_DFT_DEFAULTS, GenerateConfig
from qm1b.store import open_dataset

from .test_generate import kill_after_commits, pyscf_gradient, write_smiles

ROOT = Path(__file__).resolve().parents[2]
# The frames' forces against PySCF's float64 gradient (grid response on) at the frame's geometry: the
# float32 SCF is refined in float64 before the gradient (tests/tolerances.py FORCES_FLOAT32 is the
# bound at 20 heavy atoms); measured 4e-7 Hartree/Bohr on methanol.
FRAME_FORCES = 1e-5


@pytest.fixture(scope="module")
def relaxed(tmp_path_factory):
    """Water and methanol, 2 conformers each, relaxed with their trajectories at the generator's defaults."""
    tmp = tmp_path_factory.mktemp("relax")
    gen = GenerateConfig(smiles=str(write_smiles(tmp / "in.smi", ["O", "CO"])), out=str(tmp / "out"), conformers=2,
                         relax="dft", trajectory=True, progress=False)  # fmt: skip
    summary = generate(gen, RKSConfig(**GENERATOR_DFT_DEFAULTS))
    return gen, summary


def frames_by_conformer(directory) -> dict[tuple[int, int], list[dict]]:
    out: dict[tuple[int, int], list[dict]] = {}
    with open_dataset(directory) as ds:
        for batch in ds.frames():
            off = batch.atom_offsets()
            for i in range(len(batch)):
                row = {k: v[i].item() if hasattr(v[i], "item") else v[i] for k, v in batch.columns.items()}
                row.update(z=batch.z[off[i]:off[i + 1]], pos=batch.pos[off[i]:off[i + 1]],
                           forces=batch.forces[off[i]:off[i + 1]])  # fmt: skip
                out.setdefault((row["molecule_id"], row["conformer_id"]), []).append(row)
    return out


def test_relaxed_records_end_their_trajectories(relaxed):
    gen, summary = relaxed
    assert summary.conformers == 4 and summary.failures == 0
    frames = frames_by_conformer(gen.out)
    records = list(open_dataset(gen.out).records())
    assert len(records) == 4 and set(frames) == {(r["molecule_id"], r["conformer_id"]) for r in records}
    for record in records:
        steps = frames[(record["molecule_id"], record["conformer_id"])]
        assert [f["step"] for f in steps] == list(range(record["optimizer_steps"]))
        last = steps[-1]
        assert last["energy"] == record["energy"] and np.array_equal(last["pos"], record["pos"])
        np.testing.assert_array_equal(last["forces"], record["forces"])
        assert record["seconds"] > sum(f["seconds"] for f in steps) * 0.5  # the whole relaxation's share
        assert steps[0]["energy"] > record["energy"]  # it went down
        assert np.abs(record["forces"]).max() < 4.5e-4 * HARTREE_TO_EV  # geomeTRIC's gmax, in eV/Bohr
    assert summary.optimizer_steps == sum(r["optimizer_steps"] for r in records)


def test_frames_forces_match_pyscf(relaxed):
    """A sample of frames (the start and a middle step of methanol's first conformer): their stored
    forces against PySCF's gradient at the stored geometry."""
    gen, _ = relaxed
    steps = frames_by_conformer(gen.out)[(1, 0)]
    worst = 0.0
    for frame in (steps[0], steps[len(steps) // 2]):
        energy, reference = pyscf_gradient(frame, "b3lyp5")
        worst = max(worst, np.abs(-np.asarray(frame["forces"], float) / HARTREE_TO_EV - reference).max())
        assert abs(frame["energy"] / HARTREE_TO_EV - energy) < 1e-5  # 0.3 meV: the labels' own bound
    print(f"largest frame force difference: {worst:.2e} Hartree/Bohr")
    assert worst < FRAME_FORCES


def test_extended_xyz_reads_with_ase(relaxed, tmp_path):
    import ase.io

    gen, _ = relaxed
    assert main(["export", gen.out, "--extxyz", str(tmp_path / "frames.xyz"), "--frames"]) == 0
    assert main(["export", gen.out, "--extxyz", str(tmp_path / "relaxed.xyz")]) == 0
    frames = [f for rows in frames_by_conformer(gen.out).values() for f in rows]
    read = ase.io.read(tmp_path / "frames.xyz", index=":")
    assert len(read) == len(frames)
    for atoms, frame in zip(read, frames):
        assert atoms.info["step"] == frame["step"] and atoms.info["smiles"] == frame["smile"]
        np.testing.assert_allclose(atoms.get_positions(), frame["pos"] / BOHR_PER_ANGSTROM, rtol=0, atol=1e-9)
        assert atoms.get_potential_energy() == pytest.approx(frame["energy"], abs=1e-9)  # eV
        np.testing.assert_allclose(atoms.get_forces(), np.asarray(frame["forces"], float) * BOHR_PER_ANGSTROM,
                                   rtol=0, atol=1e-9)  # fmt: skip
    records = ase.io.read(tmp_path / "relaxed.xyz", index=":")
    assert len(records) == 4 and all(np.abs(a.get_forces()).max() < 4.5e-4 * HARTREE_TO_EV * BOHR_PER_ANGSTROM
                                     for a in records)  # fmt: skip
    assert main(["export", gen.out, "--parquet", str(tmp_path / "x.parquet"), "--frames"]) == 2


def test_unconverged_relaxations_are_failures_with_their_frames(tmp_path):
    gen = GenerateConfig(smiles=str(write_smiles(tmp_path / "in.smi", ["CO"])), out=str(tmp_path / "out"),
                         conformers=1, relax="dft", max_steps=2, trajectory=True, progress=False)  # fmt: skip
    summary = generate(gen, RKSConfig(**GENERATOR_DFT_DEFAULTS))
    assert summary.conformers == 0 and summary.failures == 1
    (failure,) = open_dataset(gen.out).failures()
    assert failure.reason == "relaxation: not converged in 2 steps"
    assert [f["step"] for f in frames_by_conformer(gen.out)[(0, 0)]] == [0, 1, 2]


@pytest.mark.parametrize("given, message", [
    (dict(trajectory=True), "--trajectory stores the steps of --relax dft"),
    (dict(relax="dft", max_steps=0), "--max-steps must be at least 1"),
    (dict(geometries="x.xyz", relax="mmff"), "does not combine with --relax mmff"),
], ids=["trajectory alone", "no steps", "mmff on geometries"])  # fmt: skip
def test_bad_relax_settings_are_refused(given, message):
    with pytest.raises(ValueError, match=message):
        GenerateConfig(**given)


def test_kill_and_resume_relaxing_loses_and_repeats_nothing(tmp_path):
    """Geometry input, relaxed one conformer per batch, killed after two commits: the resumed run has
    the uninterrupted run's records and frames, none twice."""
    import subprocess

    from .test_generate import assert_same_rows

    xyz = tmp_path / "in.xyz"
    rng = np.random.default_rng(1)
    water = np.array([[0.0, 0.0, 0.1173], [0.0, 0.7572, -0.4692], [0.0, -0.7572, -0.4692]])
    xyz.write_text("".join("3\nwater\n" + "".join(f"{s} {x:.6f} {y:.6f} {z:.6f}\n" for s, (x, y, z) in
                                                    zip("OHH", water + rng.normal(scale=0.05, size=(3, 3)))) for _ in range(4)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "qm1b.cli", "generate", "--geometries", str(xyz), "--relax", "dft",
               "--trajectory", "--batch-size", "1", "--no-progress"]  # fmt: skip
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(command + ["--out", str(whole)], check=True, env=env, timeout=900, capture_output=True)
    kill_after_commits(command + ["--out", str(killed)], env, killed, 2)
    assert 0 < len(open_dataset(killed)) < 4  # it really died mid-run
    subprocess.run(command + ["--out", str(killed), "--resume"], check=True, env=env, timeout=900, capture_output=True)
    assert_same_rows(killed, whole)
    frames, expected = frames_by_conformer(killed), frames_by_conformer(whole)
    assert sorted(frames) == sorted(expected)
    for key, rows in frames.items():
        assert [f["step"] for f in rows] == [f["step"] for f in expected[key]]  # each step once
        np.testing.assert_allclose([f["energy"] for f in rows], [f["energy"] for f in expected[key]], rtol=1e-12)


def test_plot_draws_energy_against_step(relaxed, tmp_path, drawn):
    gen, _ = relaxed
    assert main(["plot", gen.out, "--png", str(tmp_path / "d.png")]) == 0
    panel = drawn[-1].axes[3]
    lines = panel.get_lines()
    trajectories = frames_by_conformer(gen.out)
    assert len(lines) == len(trajectories) == 4 and panel.get_xlabel() == "optimiser step"
    for line, rows in zip(lines, trajectories.values()):
        energies = np.array([f["energy"] for f in rows])
        np.testing.assert_allclose(line.get_ydata(), np.maximum((energies - energies.min()) * 1000, 1e-3))


def test_each_relaxed_conformer_is_committed_as_it_finishes(tmp_path, monkeypatch):
    """Three conformers through a batch of two: each is handed to the commit thread on its own, as it
    finishes, so that a kill loses only those in flight."""
    from qm1b.ledger import Ledger

    handed = []
    relaxed = Ledger.relaxed
    monkeypatch.setattr(Ledger, "relaxed", lambda self, conformers, *a, **k: handed.append(len(conformers))
                        or relaxed(self, conformers, *a, **k))  # fmt: skip
    gen = GenerateConfig(smiles=str(write_smiles(tmp_path / "in.smi", ["O", "CO"])), out=str(tmp_path / "out"),
                         conformers=2, batch_size=2, relax="dft", max_steps=3, progress=False)  # fmt: skip
    summary = generate(gen, RKSConfig(**GENERATOR_DFT_DEFAULTS))
    assert handed == [1] * 4 and summary.conformers + summary.failures == 4


def test_info_counts_failures_by_kind():
    from qm1b.store.info import failure_kind

    assert failure_kind("relaxation: atoms collided: C1 and H5 0.31 Angstrom apart") == "relaxation: atoms collided"
    assert failure_kind("relaxation: SCF not converged at step 3") == "relaxation: SCF not converged"
    assert failure_kind("relaxation: not converged in 100 steps") == "relaxation: not converged in 100 steps"
    assert failure_kind("element Xe not in basis sto-3g") == "element Xe not in basis sto-3g"
