"""benchmarks/gpu.py, the one call a GPU machine gets, runs end to end on this machine's JAX device at
its tiny size: two molecules of two conformers, cold and restarted, each program's time, PySCF on
every core, labels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_benchmark_runs_at_its_tiny_size(tmp_path):
    report = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--size", "tiny", "--budget", "400",
                           "--json", str(report), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(report.read_text())
    for window in ("sto3g_cold", "sto3g_restarted"):
        summary = results[window]["summary"]
        assert summary["conformers"] == 4 and summary["converged"] == 4
        # the host's CPU time per conformer, by stage, beside what a run pays once
        assert summary["host_ms_per_conformer"] > 0 and {"inputs", "results", "write"} <= set(summary["host"])
        assert "programs" in summary["once_seconds"]
    programs = results["programs"]  # each program waited for: its time per conformer, beside the host's
    assert programs["conformers"] == 4 and {"scf_program", "assemble"} <= set(programs["programs"])
    assert all(p["calls"] > 0 and p["ms_per_conformer"] > 0 for p in programs["programs"].values())
    assert programs["host_ms"]["inputs"] > 0
    assert results["pyscf_sto3g"]["count"] == 4 and results["pyscf_sto3g"]["conformers_per_hour"] > 0
    labels = results["labels_sto3g_mev"]
    assert labels["pyscf_converged"] == 4 and max(labels[q] for q in ("energy", "homo", "lumo", "y")) < 0.3
    assert "host CPU per conformer" in done.stdout and "PySCF, one process per host core" in done.stdout
