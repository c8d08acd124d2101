"""benchmarks/qm9_published.py at a short slice: two small QM9 molecules labelled by the generator at
QM9's level (``--preset qm9``), against PySCF's labels at the same settings and QM9's published values."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .scripts import load_script
from .tolerances import LABEL_MEV

ROOT = Path(__file__).resolve().parent.parent
BENCHMARK = ROOT / "benchmarks" / "qm9_published.py"


def test_no_test_uses_the_benchmarks_held_out_molecules():
    """The benchmark draws from QM9's indices from HELD_OUT_FROM on, leaving out the built-in sample's:
    every QM9 index a test names (a number of four or more digits on a line that mentions QM9) is
    below it, and the sample's are known to the benchmark."""
    benchmark = load_script(BENCHMARK)
    named = {int(n) for path in ROOT.glob("tests/**/*.py") for line in path.read_text().splitlines()
             if "qm9" in line.lower() for n in re.findall(r"\b\d{4,6}\b", line)}  # fmt: skip
    assert 21989 in named and max(named) < benchmark.HELD_OUT_FROM
    sample = benchmark.sample_indices()
    assert len(sample) == 64 and max(sample) >= benchmark.HELD_OUT_FROM  # some of the sample is that far on


def test_the_qm9_benchmark_runs_at_a_short_slice(tmp_path):
    """HCN-sized molecules (at most 3 heavy atoms, from index 4: the tests' own are 1 to 3): every
    label within the 0.5 meV guard of PySCF's, both converged, and both within 0.1 eV of QM9's
    published values (Gaussian 09 on its own grid; measured: at most 34 meV on these two)."""
    report, figure = tmp_path / "qm9.json", tmp_path / "qm9.png"
    command = [sys.executable, str(BENCHMARK), "--molecules", "2", "--first-index", "4", "--max-heavy-atoms", "3",
               "--json", str(report), "--plot", str(figure)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(report.read_text())
    assert results["settings"]["basis"] == "6-31g(2df,p)" and results["settings"]["preset"] == "qm9"
    assert results["converged"] == {"ours": 2, "pyscf": 2}
    assert all(row["index"] >= 4 for row in results["molecules"])
    diffs = results["differences_mev"]
    for label in ("homo", "lumo", "gap"):
        assert diffs["ours_minus_pyscf"][label]["max_abs"] < LABEL_MEV, diffs["ours_minus_pyscf"]
        assert diffs["ours_minus_qm9"][label]["max_abs"] < 100 and diffs["pyscf_minus_qm9"][label]["max_abs"] < 100
    assert figure.stat().st_size > 10_000
    assert "ours_minus_qm9" in done.stdout
