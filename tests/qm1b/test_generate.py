"""The generator end to end: labels against PySCF, failures table, kill-and-resume, shards, Ray, tools."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.molecule import Molecule
from pyscf_ipu.units import HARTREE_TO_MEV
from qm1b.cli import main
from qm1b.generate import generate
from qm1b.settings import GENERATOR_DFT_DEFAULTS, GenerateConfig
from qm1b.watch import ConvergenceWatch, NotConvergingError
from qm1b.store import export_parquet, info, open_dataset
from qm1b.settings import dft_config
from ..tolerances import LABEL_MEV

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
    """4 good and 4 bad molecules, 2 conformers each, batches of 2, the generator's DFT defaults (QM1B's
    functional, B3LYP with VWN5; device integrals): shared by several tests."""
    tmp = tmp_path_factory.mktemp("gen")
    smiles = write_smiles(tmp / "in.smi", GOOD + list(BAD))
    gen = GenerateConfig(smiles=str(smiles), out=str(tmp / "out"), conformers=2, batch_size=2, progress=False)
    summary = generate(gen, RKSConfig(**GENERATOR_DFT_DEFAULTS))
    return gen, summary


def test_labels_match_pyscf(small_run, reference):
    """Every label within the 0.5 meV guard (tests/tolerances.py) of PySCF float64 with the dataset's own
    settings: B3LYP with VWN5, QM1B's functional, by default."""
    gen, summary = small_run
    assert summary.conformers == 2 * len(GOOD) and summary.failures == len(BAD)
    dataset = open_dataset(gen.out)
    config = dft_config(dataset.attrs["settings"])
    assert config.xc == "b3lyp5"
    for rec in dataset.records():
        assert_labels_match(rec, config, reference)
        assert rec["converged"] and rec["atoms"] == "".join(Molecule(np.asarray(rec["z"], int), rec["pos"]).symbols)


def assert_labels_match(rec: dict, config: RKSConfig, reference) -> None:
    """A record's energy, HOMO, LUMO and gap each within the 0.5 meV guard of PySCF float64
    (``reference``, the conftest fixture) on its own geometry with ``config``."""
    ref = reference(Molecule(np.asarray(rec["z"], int), np.asarray(rec["pos"], float)), config)
    errors = {
        "energy": rec["energy"] * 1000 - ref.energy * HARTREE_TO_MEV,
        "homo": rec["homo"] * 1000 - ref.homo * HARTREE_TO_MEV,
        "lumo": rec["lumo"] * 1000 - ref.lumo * HARTREE_TO_MEV,
        "y": rec["y"] * 1000 - ref.gap * HARTREE_TO_MEV,
    }
    assert max(abs(v) for v in errors.values()) < LABEL_MEV, (rec["molecule_id"], rec["conformer_id"], errors)


def test_a_nine_heavy_atom_molecule_at_the_generators_defaults(tmp_path, qm9_nine_heavy, reference):
    """One of the acceptance matrix's QM9 molecules (9 heavy atoms) through the generator with no
    option but its input: B3LYP5/STO-3G at grid level 0, the JAX integrals from its bucket's template
    and the ipu backend (``--jk auto``); its labels within the guard of PySCF float64."""
    from pyscf_ipu.units import BOHR_RADIUS_ANGSTROM

    molecule = qm9_nine_heavy[21989]
    rows = [f"{s} {x:.10f} {y:.10f} {z:.10f}" for s, (x, y, z) in zip(molecule.symbols,
                                                                     molecule.positions * BOHR_RADIUS_ANGSTROM)]
    xyz = tmp_path / "qm9.xyz"
    xyz.write_text("\n".join([str(molecule.natom), "qm9 21989", *rows]) + "\n")
    gen = GenerateConfig(geometries=str(xyz), out=str(tmp_path / "out"), progress=False)
    summary = generate(gen, RKSConfig(**GENERATOR_DFT_DEFAULTS))
    assert summary.conformers == summary.converged == 1 and summary.method.startswith("sto-3g, jk ipu")
    dataset = open_dataset(gen.out)
    config = dft_config(dataset.attrs["settings"])
    assert (config.xc, config.grid_level, config.integrals) == ("b3lyp5", 0, "auto")
    (rec,) = dataset.records()
    assert_labels_match(rec, config, reference)


def test_failures_are_recorded_not_raised(small_run):
    gen, _ = small_run
    failures = {f.input: f.reason for f in open_dataset(gen.out).failures()}
    for smiles, reason in BAD.items():
        assert reason in failures[smiles], (smiles, failures[smiles])
    settings = open_dataset(gen.out).attrs["settings"]
    assert settings["basis"] == "sto-3g" and settings["seed"] == 1 and settings["jk"] == "ipu"


def test_a_run_whose_every_input_fails_exits_2_and_keeps_the_failures(tmp_path, capsys):
    """Each input failing for its own reason (bad SMILES, a charge, a radical, an element the basis
    lacks) is bad input as a whole: one line, exit code 2, and every failure recorded."""
    smiles = write_smiles(tmp_path / "in.smi", list(BAD))
    out = tmp_path / "out"
    code = main(["generate", "--smiles", str(smiles), "--out", str(out), "--conformers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "no input gave a labelled conformer (4 failures" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert {f.input for f in open_dataset(out).failures()} == set(BAD)


def test_provenance_names_the_device_and_the_precision(small_run):
    """Beside the package versions: the device the labels came from and the precision of its products."""
    versions = open_dataset(small_run[0].out).attrs["versions"]
    assert versions["device"].startswith("cpu: ") and versions["device"].endswith(" cores)")
    assert versions["matmul_precision"] == "highest" and versions["jax"] == jax.__version__


def test_a_batch_that_loads_programs_is_not_counted_in_the_steady_rate(small_run):
    """The summary's steady rate counts only batches that loaded no programs: here each size bucket's
    first batch of 2 conformers loads its bucket's, so at most the rest are steady (on a CPU, whose
    stages take turns, the bucket's only batch once passed for steady with a moment's time)."""
    from rdkit import Chem

    from pyscf_ipu.resolution import resolve

    _, summary = small_run
    method = resolve(RKSConfig(**GENERATOR_DFT_DEFAULTS))
    molecules = [Chem.AddHs(Chem.MolFromSmiles(s)) for s in GOOD]
    buckets = {method.bucket(Molecule(np.array([a.GetAtomicNum() for a in m.GetAtoms()]), np.zeros((m.GetNumAtoms(), 3))))
               for m in molecules}  # fmt: skip
    assert summary.steady_conformers <= summary.conformers - 2 * len(buckets)


def test_the_convergence_watch_trips_on_a_broken_setup_not_on_hard_molecules():
    """An occasional unconverged conformer, or every conformer of one molecule, never stops a run; most
    of the last 32 (or a batch) unconverged does; a minimum of 0 never does."""
    watch = ConvergenceWatch(0.5, 32, "the settings")
    for _ in range(10):
        watch.add(8, 7)  # one hard conformer per batch
    watch.add(8, 0)  # a molecule whose 8 conformers all fail
    watch.add(8, 8)
    with pytest.raises(NotConvergingError, match=r"only 15 of the last 32 conformers converged .*check the settings"):
        watch.add(8, 0)  # a second such molecule in the last four: half of the window
    with pytest.raises(NotConvergingError, match="only 100 of the last 256"):
        ConvergenceWatch(0.5, 256, "").add(256, 100)  # one large batch is a window of its own
    off = ConvergenceWatch(0.0, 32, "")
    for _ in range(8):
        off.add(8, 0)
    off.finish(64, 0)
    with pytest.raises(NotConvergingError, match=r"only 3 of the 8 conformers converged .*check the settings"):
        ConvergenceWatch(0.5, 32, "the settings").finish(8, 3)  # a whole run, shorter than the window
    ConvergenceWatch(0.5, 32, "").finish(0, 0)  # nothing labelled: nothing to judge
    ConvergenceWatch(0.5, 32, "").finish(8, 4)


def test_a_short_run_that_does_not_converge_exits_non_zero(tmp_path):
    """Two conformers with --max-iterations 2, far fewer than the watch's window: the run ends with one
    line and exit code 4, and keeps its rows."""
    smiles = write_smiles(tmp_path / "in.smi", GOOD[:1])
    out = tmp_path / "out"
    ended = run_cli("generate", "--smiles", str(smiles), "--conformers", "2", "--max-iterations", "2",
                    "--no-progress", "--out", str(out))  # fmt: skip
    assert ended.returncode == 4, ended.stderr
    (line,) = ended.stderr.strip().splitlines()
    assert line.startswith("qm1b generate: stopped: only 0 of the 2 conformers converged"), line
    assert len(sorted_rows(out)) == 2
    checked = run_cli("validate", str(out), "--sample", "2")  # nothing converged: nothing to trust
    assert checked.returncode == 6, checked.stderr
    assert checked.stderr.strip() == "qm1b validate: none of the 2 records sampled converged"
    refused = run_cli("validate", str(out), "--tolerance", "0")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--tolerance must be a positive number of meV" in refused.stderr


def test_a_run_that_does_not_converge_stops_early_and_can_be_let_run(tmp_path):
    """--max-iterations 2 converges nothing: the run stops once 32 conformers are done, before its
    end, with one line saying what to check and exit code 4, and what it committed is merged and
    intact; resumed with the stop switched off (--min-converged 0), it labels the rest and leaves
    those rows as they were."""
    smiles = write_smiles(tmp_path / "in.smi", GOOD)
    out = tmp_path / "out"
    args = ["generate", "--smiles", str(smiles), "--conformers", "10", "--max-iterations", "2", "--no-progress",
            "--out", str(out)]  # fmt: skip
    stopped = run_cli(*args)
    assert stopped.returncode == 4, stopped.stderr
    (line,) = stopped.stderr.strip().splitlines()
    judged = re.match(r"qm1b generate: stopped: only 0 of the last (\d+) conformers converged", line)
    assert judged and "--max-iterations (2)" in line and "what was committed is kept" in line
    first = sorted_rows(out)
    assert 32 <= int(judged[1]) <= len(first) < 10 * len(GOOD) and not any(row[8] for row in first)
    assert open_dataset(out).unmerged_parts == 0
    finished = run_cli(*args, "--resume", "--min-converged", "0")
    assert finished.returncode == 0, finished.stderr
    rows = sorted_rows(out)
    assert len(rows) == 10 * len(GOOD) and set(first) <= set(rows)


def test_export_validate_info_plot(small_run, tmp_path, capsys):
    gen, _ = small_run
    import pyarrow.parquet as pq

    table = pq.read_table(export_parquet(gen.out, tmp_path / "d.parquet"))
    assert table.column_names == ["smile", "atoms", "z", "pos", "energy", "homo", "lumo", "y", "N", "std"]
    assert json.loads(table.schema.metadata[b"qm1b.settings"])["xc"] == "b3lyp5"  # the labels' functional
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


def test_validate_exits_non_zero_on_labels_shifted_past_its_tolerance(small_run, tmp_path, capsys):
    """A copy of the dataset with every energy shifted by 10 meV: ``validate`` exits 6 with one line
    naming the energy; the original exits 0 (its labels are within 0.3 meV, test_labels_match_pyscf)."""
    import shutil

    import h5py

    gen, _ = small_run
    shifted = tmp_path / "shifted"
    shutil.copytree(gen.out, shifted)
    (shard,) = shifted.glob("shard-*.h5")
    with h5py.File(shard, "r+") as f:
        f["records/energy"][...] = f["records/energy"][...] + 0.010  # eV
    capsys.readouterr()
    assert main(["validate", str(shifted), "--sample", "2"]) == 6
    (line,) = capsys.readouterr().err.strip().splitlines()
    found = re.search(r"2 of the 2 converged records sampled are more than 2 meV .*largest: energy ([+-][\d.]+)", line)
    assert found and abs(float(found[1]) - 10.0) < 0.5, line
    assert main(["validate", gen.out, "--sample", "2", "--tolerance", "1"]) == 0
    assert main(["validate", str(shifted), "--sample", "2", "--tolerance", "11"]) == 0


def test_kill_and_resume_equals_uninterrupted(tmp_path):
    smiles = write_smiles(tmp_path / "in.smi", GOOD)
    args = ["generate", "--smiles", str(smiles), "--conformers", "3", "--batch-size", "1", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "qm1b.cli", *args]
    whole = tmp_path / "whole"
    subprocess.run(command + ["--out", str(whole)], check=True, env=env, timeout=900, capture_output=True)
    killed = tmp_path / "killed"
    kill_after_commits(command + ["--out", str(killed)], env, killed, 3)
    committed = len(open_dataset(killed))
    assert 0 < committed < 12  # it really died mid-run
    subprocess.run(command + ["--out", str(killed), "--resume"], check=True, env=env, timeout=900, capture_output=True)
    assert_same_rows(killed, whole)  # nothing lost, nothing duplicated


def kill_after_commits(command: list[str], env: dict, out: Path, commits: int) -> None:
    """Run ``command`` (a generator writing shard 0 of 1 into ``out``) and SIGKILL it once it has
    committed ``commits`` parts: a process killed between two commits."""
    proc = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    parts = out / "shard-00000-of-00001.parts"
    deadline = time.time() + 600
    while time.time() < deadline and len(list(parts.glob("part-*.h5"))) < commits:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "qm1b.cli", *args], env=env, timeout=900, capture_output=True, text=True)


def test_full_disk_exits_3_with_one_line_and_resume_completes(tmp_path):
    """qm1b generate on a 300 KB disk: one line naming the directory and the cause, exit code 3, the
    committed batches intact; --resume (on a larger disk) completes the run."""
    import shutil

    from tests.qm1b.test_store import small_disk

    smiles = write_smiles(tmp_path / "in.smi", GOOD)
    args = ["--smiles", str(smiles), "--conformers", "2", "--batch-size", "1", "--no-progress"]
    with small_disk(tmp_path / "disk") as disk:
        failed = run_cli("generate", *args, "--out", str(disk / "out"))
        assert failed.returncode == 3, failed.stderr
        assert failed.stderr.splitlines() == [
            f"qm1b generate: error: cannot write to {disk / 'out'}: No space left on device; what was committed is "
            "kept: run again with --resume once that is fixed"]  # fmt: skip
        committed = len(open_dataset(disk / "out"))
        assert 0 < committed < 8
        shutil.copytree(disk / "out", tmp_path / "big")
    resumed = run_cli("generate", *args, "--out", str(tmp_path / "big"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    rows = sorted_rows(tmp_path / "big")
    assert [row[:2] for row in rows] == [(m, c) for m in range(len(GOOD)) for c in range(2)]


def test_corrupt_shard_file_named_then_redone_by_resume(small_run, tmp_path):
    """A truncated shard file: info and export exit 2 naming it; generate --resume sets it aside,
    says so, and computes its rows again, equal to what they were."""
    import shutil

    gen, _ = small_run
    out = tmp_path / "copy"
    shutil.copytree(gen.out, out)
    bad = out / "shard-00000-of-00001.h5"
    os.truncate(bad, bad.stat().st_size // 2)
    for args in (["info", str(out)], ["export", str(out), "--parquet", str(tmp_path / "x.parquet")]):
        result = run_cli(*args)
        assert result.returncode == 2 and f"{bad} is truncated or corrupt" in result.stderr
        assert len(result.stderr.splitlines()) == 1
    resumed = run_cli("generate", "--smiles", gen.smiles, "--out", str(out), "--conformers", "2", "--batch-size", "2",
                      "--no-progress", "--resume")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"{bad} could not be read; set aside as {bad.name}.corrupt" in resumed.stderr
    assert_same_rows(out, gen.out)


@pytest.mark.parametrize("command", [["qm1b.cli", "info"], ["pyscf_ipu.cli", "run", "--mol", "water"]],
                         ids=["qm1b", "pyscf-ipu"])
def test_closed_pipe_ends_quietly(small_run, command):
    """The reader of stdout gone before the first line (``| head`` that has had enough): exit 141,
    nothing on stderr."""
    args = [*command, small_run[0].out] if command[0] == "qm1b.cli" else command
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 141 and err == b""


@pytest.mark.parametrize("blocked, command, extra", [
    ("rdkit", ["qm1b.cli", "generate", "--limit", "1"], "generator"),
    ("equinox", ["schnet.cli", "--help"], "schnet"),
])
def test_a_missing_extra_is_one_line(tmp_path, blocked, command, extra):
    """Without an optional dependency (blocked in ``sys.modules``, as if never installed), the command
    names the extra that installs it in one line and exits with 2: no traceback."""
    entry = "main" if command[0] == "qm1b.cli" else "train_main"
    script = (f"import sys; sys.modules[{blocked!r}] = None\n"
              f"from {command[0]} import {entry}\nsys.exit({entry}({command[1:]!r}))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert f"{blocked} is not installed: pip install 'pyscf-ipu[{extra}]'" in proc.stderr


def test_existing_output_needs_resume(small_run, capsys):
    gen, _ = small_run
    code = main(["generate", "--smiles", gen.smiles, "--out", gen.out, "--conformers", "2", "--no-progress"])
    assert code == 2 and "--resume" in capsys.readouterr().err
    code = main(["generate", "--smiles", "/no/such.smi", "--out", gen.out + "x"])
    assert code == 2


def test_resume_ignores_the_simulated_ipus_placement(small_run, capsys):
    """The IPU placement options (tiles, IPUs, model, memory share) never change a label, so a resume
    may change them; the tile strategy orders the float32 sums, so changing it is refused."""
    gen, _ = small_run
    common = ["generate", "--smiles", gen.smiles, "--out", gen.out, "--conformers", str(gen.conformers),
              "--no-progress", "--resume"]  # fmt: skip
    assert main([*common, "--tiles", "7", "--ipus", "2", "--ipu-model", "mk2", "--ipu-memory-proportion", "0.5"]) == 0
    done = re.search(r"\): (\d+) conformers of \d+ molecules written.*; (\d+) already done", capsys.readouterr().out)
    assert done and done[1] == "0" and int(done[2]) > 0  # accepted, and nothing left to do
    assert main([*common, "--jk-strategy", "s8"]) == 2
    assert "settings differ in jk_strategy" in capsys.readouterr().err


def test_shards_partition_the_input(tmp_path):
    smiles = write_smiles(tmp_path / "in.smi", GOOD)
    ids = []
    for i in range(2):
        gen = GenerateConfig(smiles=str(smiles), out=str(tmp_path / "o"), conformers=1, shard=f"{i}/2", progress=False)
        generate(gen, RKSConfig())
    ds = open_dataset(tmp_path / "o")
    ids = sorted(np.asarray(ds.arrays().columns["molecule_id"]).tolist())
    assert ids == list(range(len(GOOD)))  # disjoint and complete


def kill_a_writing_task(out: Path, run, timeout: float = 600) -> int:
    """SIGKILL the Ray worker that holds a shard's lock (its process id is in the lock file) once that
    shard has a committed part: a task killed between commits. Returns the killed process id."""
    deadline = time.time() + timeout
    while time.time() < deadline and not run.done():
        for parts in out.glob("shard-*.parts"):
            lock = out / f".{parts.name[: -len('.parts')]}.h5.lock"
            try:
                pid = int(lock.read_text())
            except (FileNotFoundError, ValueError):
                continue
            if any(parts.glob("part-*.h5")):
                os.kill(pid, signal.SIGKILL)
                return pid
        time.sleep(0.02)
    raise AssertionError("no task was caught between two commits")


def test_ray_work_queue_equals_local_and_survives_a_killed_worker(tmp_path):
    """Ray tasks of one molecule each, read back as one dataset: the same rows as a local run. Then a
    Ray worker SIGKILLed after its task committed a batch: Ray runs the task again, the retry continues
    the task's shard, and the dataset equals the uninterrupted Ray run's (nothing lost, nothing twice).

    Ray and local runs agree to 0.1 meV, not to round-off: a task runs XLA and OpenMP on its own
    thread budget (one thread here), and the float32 SCF then sums in another order (measured: HOMO
    and LUMO 2e-5 eV apart, energies 2e-10 eV)."""
    ray = pytest.importorskip("ray")
    from concurrent.futures import ThreadPoolExecutor

    smiles = write_smiles(tmp_path / "in.smi", GOOD)
    common = dict(smiles=str(smiles), conformers=3, batch_size=1, progress=False)
    generate(GenerateConfig(out=str(tmp_path / "local"), **common), RKSConfig())
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        whole = generate(GenerateConfig(out=str(tmp_path / "whole"), executor="ray", task_molecules=1, **common),
                         RKSConfig())  # fmt: skip
        with ThreadPoolExecutor(1) as pool:
            config = GenerateConfig(out=str(tmp_path / "killed"), executor="ray", task_molecules=1, **common)
            run = pool.submit(generate, config, RKSConfig())
            kill_a_writing_task(tmp_path / "killed", run)
            summary = run.result(timeout=900)
    finally:
        ray.shutdown()
    assert whole.tasks == len(GOOD) and whole.conformers == 3 * len(GOOD)  # one summary for the whole run
    assert open_dataset(tmp_path / "whole").num_shards == len(GOOD)  # a shard per task, read as one dataset
    rows, expected = np.array(sorted_rows(tmp_path / "whole")), np.array(sorted_rows(tmp_path / "local"))
    np.testing.assert_array_equal(rows[:, :2], expected[:, :2])
    np.testing.assert_allclose(rows[:, 2:6], expected[:, 2:6], rtol=0, atol=1e-4)  # eV
    assert summary.conformers + summary.skipped == 3 * len(GOOD)
    assert summary.skipped > 0  # the retry found the killed attempt's commits and kept them
    assert_same_rows(tmp_path / "killed", tmp_path / "whole")


def test_a_lost_raylet_is_one_line_and_resume_completes(tmp_path):
    """A local Ray's raylet killed while tasks run: the driver ends with one line naming what died and
    the --resume advice (exit code 5, no traceback); the committed shards stay, and --resume
    completes the run with every conformer once."""
    pytest.importorskip("ray")
    import psutil

    smiles = write_smiles(tmp_path / "in.smi", GOOD)
    out = tmp_path / "out"
    args = ["generate", "--smiles", str(smiles), "--conformers", "4", "--batch-size", "1", "--executor", "ray",
            "--task-molecules", "1", "--no-progress", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen([sys.executable, "-m", "qm1b.cli", *args], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 600
    while time.time() < deadline and not list(out.glob("shard-*.parts/part-*.h5")) + list(out.glob("shard-*.h5")):
        time.sleep(0.05)
    (raylet,) = [p for p in psutil.Process(driver.pid).children(recursive=True) if p.name() == "raylet"]
    raylet.kill()
    _, err = driver.communicate(timeout=300)
    assert driver.returncode == 5, err
    ours = [line for line in err.splitlines() if line.startswith("qm1b")]
    assert "Traceback" not in err and len(ours) == 1
    assert ours[0].startswith("qm1b generate: error: the Ray cluster lost this node's raylet")
    assert ours[0].endswith("what was committed is kept: run again with --resume once that is fixed")
    committed = sorted_rows(out)
    assert 0 < len(committed) < 4 * len(GOOD)
    resumed = run_cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    rows = sorted_rows(out)
    assert [row[:2] for row in rows] == [(m, c) for m in range(len(GOOD)) for c in range(4)]
    assert set(committed) <= set(rows)


def pyscf_gradient(record: dict, xc: str) -> tuple[float, np.ndarray]:
    """PySCF's energy and gradient (grid response on, STO-3G, grid level 0, float64) at a stored
    record's geometry (``z``, ``pos`` in Bohr)."""
    from pyscf import dft

    from pyscf_ipu.pyscf_mole import build_mole

    molecule = Molecule(np.asarray(record["z"], int), np.asarray(record["pos"], float))
    mf = dft.RKS(build_mole(molecule, "sto-3g"), xc=xc)
    mf.grids.level = 0
    mf.conv_tol = 1e-11
    mf.kernel()
    gradient = mf.nuc_grad_method()
    gradient.grid_response = True
    return mf.e_tot, gradient.kernel()


def test_forces_column_matches_pyscf_and_survives_resume_and_merge(tmp_path):
    """--forces: a forces column (eV/Bohr, = -dE/dR) per atom, equal to PySCF's analytic gradient
    with grid response (the generator's forces are the exact derivative of its energy) within 1e-4
    Hartree/Bohr; stored, merged and read back intact; a resume with different --forces is refused."""
    from pyscf_ipu.units import HARTREE_TO_EV

    smiles = write_smiles(tmp_path / "in.smi", ["O", "CO"])
    gen = GenerateConfig(smiles=str(smiles), out=str(tmp_path / "out"), conformers=2, batch_size=2, forces=True,
                         progress=False)  # fmt: skip
    generate(gen, RKSConfig())
    rows = list(open_dataset(gen.out).records())  # read from the merged shard file
    assert len(rows) == 4 and all(r["forces"].shape == (len(r["z"]), 3) for r in rows)
    for rec in rows[::3]:  # one conformer of each molecule
        _, ref = pyscf_gradient(rec, "b3lyp")
        np.testing.assert_allclose(-np.asarray(rec["forces"], float) / HARTREE_TO_EV, ref, rtol=0, atol=1e-4)
    assert "forces" in open_dataset(gen.out).to_pandas().columns
    with pytest.raises(ValueError, match="forces"):
        generate(GenerateConfig(**{**gen.__dict__, "forces": False, "resume": True}), RKSConfig())


def test_wb97x_forces_on_the_devices_path_match_pyscf(tmp_path):
    """--xc wb97x --forces with the JAX integrals (the GPU's path, forced here): the batch's device
    program, its long-range exchange included, gives PySCF's analytic ωB97X gradient with grid response
    within the float32 tolerance (measured 1.1e-6 Hartree/Bohr on water)."""
    from pyscf_ipu.units import HARTREE_TO_EV

    from ..tolerances import FORCES_FLOAT32

    smiles = write_smiles(tmp_path / "in.smi", ["O"])
    gen = GenerateConfig(smiles=str(smiles), out=str(tmp_path / "out"), conformers=1, forces=True, progress=False)
    generate(gen, RKSConfig(xc="wb97x", integrals="jax"))
    (record,) = open_dataset(gen.out).records()
    _, reference = pyscf_gradient(record, "wb97x")
    ours = -np.asarray(record["forces"], float) / HARTREE_TO_EV
    print(f"water wb97x, generated on the device's path: max |ours - PySCF| {np.abs(ours - reference).max():.1e}")
    np.testing.assert_allclose(ours, reference, rtol=0, atol=FORCES_FLOAT32)


@pytest.mark.parametrize("converged, stops", [((9, 0), True), ((10, 2), False)], ids=["9 of 20", "12 of 20"])
def test_ray_tasks_are_judged_together(monkeypatch, converged, stops):
    """Two Ray tasks, one converging everything and one little: the run is judged on their sum once
    both have ended, against --min-converged 0.5, not task by task."""
    import qm1b.generate
    from qm1b.summary import Summary

    tasks = [Summary(out="x", shard=f"{k}/2", labelled=10, converged=c) for k, c in enumerate(converged)]
    total = Summary(out="x", shard="0/1", tasks=2)
    for task in tasks:
        total.add(task)
    monkeypatch.setattr(qm1b.generate, "run_ray", lambda run, label: total)
    gen = GenerateConfig(executor="ray", min_converged=0.5, progress=False)
    if stops:
        with pytest.raises(NotConvergingError, match="only 9 of the 20 conformers converged"):
            generate(gen, RKSConfig())
    else:
        assert generate(gen, RKSConfig()) == total


def test_batches_that_fit_only_one_at_a_time_wait_for_each_other_with_the_same_labels(tmp_path, monkeypatch):
    """A memory budget that holds one batch but not one beside the next one prepared: the batches run
    one after another (no refusal: each batch's labels are read before the next is prepared, where
    the run without a budget may prepare the next batch first), and the labels equal those of the
    overlapped run. Neither preparing nor reading a batch happens on the main thread."""
    import threading

    import qm1b.generate as generator
    from pyscf_ipu.memory import GB, batch_memory
    from pyscf_ipu.resolution import resolve
    from qm1b.batching import batch_sizes, prepares_ahead

    events, threads = [], set()
    for name, event in (("prepare_batch", "prepare"), ("_results", "read")):
        def logged(*args, _original=getattr(generator, name), _event=event, **kwargs):
            events.append(_event)
            threads.add(threading.current_thread())
            return _original(*args, **kwargs)
        monkeypatch.setattr(generator, name, logged)

    smiles = write_smiles(tmp_path / "in.smi", ["CCO"])
    common = dict(smiles=str(smiles), conformers=3, batch_size=1, progress=False)
    dft = RKSConfig()
    method = resolve(dft)
    probe = GenerateConfig(**common).resolved(dft)
    inputs = probe.inputs()
    sizes = batch_sizes(probe, method, inputs, probe.buckets(method, inputs))
    alone = max(batch_memory(bucket, method, 1).total for bucket in sizes)
    pair = min(batch_memory(bucket, method, 1, prepared_ahead=1).total for bucket in sizes)
    assert alone < pair
    budget = (alone + pair) / 2 / GB
    tight = GenerateConfig(out=str(tmp_path / "tight"), memory_budget=budget, **common)
    assert not any(prepares_ahead(tight.resolved(dft), method, sizes).values())
    generate(tight, dft)
    assert events == ["prepare", "read"] * 3
    assert len(threads) == 2 and threading.main_thread() not in threads  # a stage's thread each
    events.clear()
    threads.clear()
    generate(GenerateConfig(out=str(tmp_path / "overlapped"), **common), dft)
    # at most two batches alive (which comes first, a read or the next preparation, is the threads'
    # race where they take turns: tests/qm1b/test_pipeline.py shows the overlap itself)
    alive = np.cumsum([1 if e == "prepare" else -1 for e in events])
    assert sorted(events) == ["prepare"] * 3 + ["read"] * 3 and alive.max() <= 2
    assert len(threads) == 2 and threading.main_thread() not in threads
    assert len(sorted_rows(tight.out)) == 3
    assert_same_rows(tight.out, tmp_path / "overlapped")


@pytest.mark.parametrize("args, message", [(["--basis", "cc-pvqz"], "g functions on C"),
                                           (["--basis", "def2-svp", "--jk", "ipu"], "does not fit")],
                         ids=["g shells", "too large for the tiles"])  # fmt: skip
def test_a_method_that_cannot_run_the_molecule_is_one_line(tmp_path, capsys, args, message):
    """A basis with shells the integrals do not cover, and a 19-heavy-atom molecule the simulated
    IPU's tiles cannot hold: one line naming the cause (and for the tiles, density fitting among the
    ways out), exit code 2, no traceback."""
    smiles = write_smiles(tmp_path / "in.smi", ["CC(=O)Nc1ccc(O)cc1OCCOc1ccccc1"])
    code = main(["generate", "--smiles", str(smiles), "--out", str(tmp_path / "out"), "--conformers", "1",
                 "--no-progress", *args])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert ("--jk df" in err) == ("ipu" in args)
