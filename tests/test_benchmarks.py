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


def test_the_gpu_benchmarks_pyscf_adds_a_correction_pyscf_lacks():
    """Its PySCF worker at ωB97X-D (the nabladft phase's level): PySCF's functional by libxc's name, and
    the Chai and Head-Gordon term added, as the references add it (``pyscf_ipu.reference.pyscf_runnable``)."""
    import numpy as np
    import pytest
    from pyscf import dft, gto

    from pyscf_ipu.dispersion import DISPERSIONS
    from pyscf_ipu.molecule import from_name
    from pyscf_ipu.units import HARTREE_TO_EV
    from pyscf_ipu.xc.functionals import FUNCTIONALS

    from .scripts import load_script

    gpu = load_script(ROOT / "benchmarks" / "gpu.py")
    water = from_name("water")
    task = (water.atomic_numbers.tolist(), water.positions.tolist(), "6-31g", True, "chg", "wb97x-d", 0)
    labels = gpu.pyscf_one(task)
    mol = gto.M(atom=water.pyscf_atom(), unit="Bohr", basis="6-31g", verbose=0)
    plain = dft.RKS(mol, xc="hyb_gga_xc_wb97x_d").density_fit()
    plain.grids.level = 0
    term = DISPERSIONS["chg"].energy_terms(water, FUNCTIONALS["wb97x-d"])["dispersion"]
    assert labels["energy"] == pytest.approx((plain.kernel() + term) * HARTREE_TO_EV, abs=1e-8)
    assert term < 0 and np.isfinite(labels["y"])
