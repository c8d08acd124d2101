"""CPU budgets of Ray tasks: workers on one node claim disjoint cores, and XLA then runs on them only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CLAIM = """
import sys, time
from pathlib import Path
from qm1b.cores import claim_cores
print(",".join(map(str, claim_cores(1, Path(sys.argv[1])))), flush=True)
time.sleep(float(sys.argv[2]))
"""

BUSY = """
import sys, time
from pathlib import Path
from qm1b.cores import claim_cores
cores = claim_cores(1, Path(sys.argv[1]))
import jax.numpy as jnp
x = jnp.ones((1500, 1500))
(x @ x).block_until_ready()
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(10):
    (x @ x).block_until_ready()
print(len(cores), (time.process_time() - cpu) / (time.perf_counter() - wall))
"""

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs at least 2 cores")


def python(script: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE, text=True)


def test_workers_claim_disjoint_cores(tmp_path):
    """Two live workers get different cores; once one has exited, its slot is free again."""
    first = python(CLAIM, str(tmp_path), "3")
    a = first.stdout.readline().strip()
    second = python(CLAIM, str(tmp_path), "0")
    b = second.stdout.readline().strip()
    assert a and b and set(a.split(",")).isdisjoint(b.split(","))
    for proc in (first, second):
        proc.wait(timeout=60)
        proc.stdout.close()
    third = python(CLAIM, str(tmp_path), "0")
    assert third.stdout.readline().strip() == a  # the lowest slot, released by its dead holder
    third.wait(timeout=60)
    third.stdout.close()


def test_xla_runs_on_the_claimed_core(tmp_path):
    """Matrix products after claiming one core use one core: CPU time about the wall time (on 2 free
    cores XLA's pool would make it about twice that)."""
    proc = python(BUSY, str(tmp_path))
    out, _ = proc.communicate(timeout=300)
    cores, ratio = out.split()
    assert cores == "1" and float(ratio) < 1.25
