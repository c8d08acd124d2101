"""qm1b warm: a run's programs built ahead and shipped to another cache, after which the run itself
traces and compiles nothing; bad archives and full disks are one line and an exit code."""

from __future__ import annotations

import os
import subprocess
import sys

from pyscf_ipu.program_archive import pack
from qm1b.cli import EXIT_STORAGE
from pyscf_ipu.cli import EXIT_BAD_INPUT

from .test_generate import ROOT, write_smiles
from .test_store import small_disk


def qm1b(*args: str, cache, log_compiles: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYSCF_IPU_CACHE": str(cache),
           "JAX_LOG_COMPILES": str(int(log_compiles))}
    return subprocess.run([sys.executable, "-m", "qm1b.cli", *args], env=env, timeout=900, capture_output=True,
                          text=True)  # fmt: skip


def test_packed_programs_spare_a_new_machine_every_trace_and_compile(tmp_path):
    """Water and methanol (two size buckets): ``warm --pack`` on one cache, ``warm --unpack`` into an
    empty one, then ``generate`` with the same options there loads every program: no function is
    traced and exported again, and every XLA compile is a hit in the persistent cache."""
    smiles = write_smiles(tmp_path / "in.smi", ["O", "CO"])
    options = ["--smiles", str(smiles), "--conformers", "2", "--batch-size", "2", "--xc", "hf", "--no-progress"]
    built = qm1b("warm", *options, "--pack", str(tmp_path / "programs.tar.gz"), cache=tmp_path / "a")
    assert built.returncode == 0, built.stderr
    assert "programs of 2 size buckets ready" in built.stdout and "programs.tar.gz:" in built.stdout
    installed = qm1b("warm", "--unpack", str(tmp_path / "programs.tar.gz"), cache=tmp_path / "b")
    assert installed.returncode == 0, installed.stderr
    assert " 0 already there" in installed.stdout
    run = qm1b("generate", *options, "--out", str(tmp_path / "out"), cache=tmp_path / "b", log_compiles=True)
    assert run.returncode == 0, run.stderr
    assert "4 conformers of 2 molecules written, 100.0% converged" in run.stdout
    compiles = run.stderr.count("Finished XLA compilation")
    assert compiles > 0 and run.stderr.count("Persistent compilation cache hit") == compiles
    assert "Compiling jit(flat)" not in run.stderr  # jit(flat): a function traced to be exported


def test_a_warmed_forces_run_on_the_devices_path_compiles_nothing(tmp_path):
    """``warm --forces`` with the JAX integrals (the GPU's path) builds the gradient programs too: the
    ``generate --forces`` run after it traces nothing and finds every compile in the persistent cache."""
    smiles = write_smiles(tmp_path / "in.smi", ["O"])
    options = ["--smiles", str(smiles), "--conformers", "2", "--batch-size", "2", "--integrals", "jax", "--forces",
               "--no-progress"]  # fmt: skip
    built = qm1b("warm", *options, cache=tmp_path / "cache")
    assert built.returncode == 0, built.stderr
    run = qm1b("generate", *options, "--out", str(tmp_path / "out"), cache=tmp_path / "cache", log_compiles=True)
    assert run.returncode == 0, run.stderr
    assert "2 conformers of 1 molecules written" in run.stdout and "forces_two_electron" in run.stdout
    compiles = run.stderr.count("Finished XLA compilation")
    assert compiles > 0 and run.stderr.count("Persistent compilation cache hit") == compiles
    assert "Compiling jit(flat)" not in run.stderr  # jit(flat): a function traced to be exported


def test_an_archive_that_is_not_one_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "p.tar.gz").write_bytes(b"not an archive")
    proc = qm1b("warm", "--unpack", str(tmp_path / "p.tar.gz"), cache=tmp_path / "cache")
    assert proc.returncode == EXIT_BAD_INPUT
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"qm1b warm: error: {tmp_path / 'p.tar.gz'} is not a readable program archive")
    assert not (tmp_path / "cache").exists()


def test_unpacking_onto_a_full_disk_is_one_line_and_exit_3(tmp_path):
    source = tmp_path / "source"
    for k in range(4):
        (source / "jax").mkdir(parents=True, exist_ok=True)
        (source / "jax" / f"f{k}-cache").write_bytes(os.urandom(120_000))  # incompressible: 480 KB
    path = pack(source, tmp_path / "p.tar.gz", {}).path
    with small_disk(tmp_path / "disk") as disk:
        proc = qm1b("warm", "--unpack", str(path), cache=disk / "cache")
        assert proc.returncode == EXIT_STORAGE, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"qm1b warm: error: cannot write {disk / 'cache' / 'jax'}/f") and line.endswith(
            ": No space left on device")  # fmt: skip
        for file in (disk / "cache" / "jax").iterdir():  # what was installed is whole, no temporary left
            assert file.read_bytes() == (source / "jax" / file.name).read_bytes()


def test_a_cache_that_cannot_be_made_is_one_line_and_exit_3_before_any_work(tmp_path):
    (tmp_path / "file").write_text("a file where the cache's directory would go")
    smiles = write_smiles(tmp_path / "in.smi", ["O"])
    proc = qm1b("warm", "--smiles", str(smiles), "--no-progress", cache=tmp_path / "file" / "cache")
    assert proc.returncode == EXIT_STORAGE, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"qm1b warm: error: cannot write {tmp_path / 'file' / 'cache'}: cannot make the program cache there"]
