"""The memory estimate against measured peaks, and the refusal of a run that would not fit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pyscf_ipu.buckets import SizeBucket
from pyscf_ipu.config import RKSConfig
from pyscf_ipu.memory import GB, batch_memory
from pyscf_ipu.resolution import resolve
from pyscf_ipu.molecule import from_name

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "1"}


def peak_of(args: list[str]) -> float:
    """Bytes: the peak resident memory of ``pyscf-ipu`` run with ``args`` in a child process of its own."""
    script = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script, sys.executable, "-m", "pyscf_ipu.cli", *args],
                         capture_output=True, text=True, env=ENV, timeout=600, check=True)  # fmt: skip
    return 1024.0 * int(out.stdout.split()[-1])  # ru_maxrss is in KiB on Linux


def test_the_estimate_bounds_the_measured_peak_from_above_and_closely():
    """Paracetamol at 6-31G (119 AOs): the J-K rows layout dominates, as it does at every larger size.
    The estimate must not fall below the real peak (a run it lets through must fit), and must not
    exceed it by much (it would refuse runs that fit): 1.93 GB estimated, measured 1.73 GB with an
    empty compilation cache (a fresh clone's CI) and 1.54 GB with a filled one (1.12 and 1.25 times;
    the rows built on the host; 1.31 when XLA built them), bounded at 1.35."""
    config = RKSConfig(basis="6-31g", xc="b3lyp5")
    estimate = batch_memory(SizeBucket.of(from_name("paracetamol"), config.basis, config.grid_level), resolve(config), 1).total
    measured = peak_of(["run", "--mol", "paracetamol", "--basis", "6-31g", "--xc", "b3lyp5", "--jk", "ipu"])
    assert measured <= estimate <= 1.35 * measured, (measured / GB, estimate / GB)


def test_a_single_point_that_cannot_fit_is_refused_with_the_numbers_at_once():
    proc = subprocess.run([sys.executable, "-m", "pyscf_ipu.cli", "run", "--mol", "paracetamol", "--basis", "def2-svp",
                           "--jk", "ipu", "--memory-budget", "8"], capture_output=True, text=True, env=ENV, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("pyscf-ipu: error: paracetamol at def2-svp (199 AOs")
    assert "above the memory budget of 8 GB" in line and "J-K arrays" in line


def test_the_generator_refuses_a_batch_that_cannot_fit_before_writing_anything(tmp_path):
    smiles = tmp_path / "in.smi"
    smiles.write_text("CC(=O)Nc1ccc(O)cc1 paracetamol\nCCO ethanol\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "qm1b.cli", "generate", "--smiles", str(smiles), "--basis", "6-31g",
                           "--jk", "ipu", "--batch-size", "8", "--out", str(out), "--memory-budget", "5", "--no-progress"],
                          capture_output=True, text=True, env=ENV, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "a batch of 8 conformers of the largest molecules, 6-31g:H10C11 (119 AOs" in line
    assert "above the memory budget of 5 GB" in line and "--batch-size 3 fits" in line
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("budget", ["0", "-1"])
def test_a_budget_must_be_positive(tmp_path, budget):
    proc = subprocess.run([sys.executable, "-m", "qm1b.cli", "generate", "--out", str(tmp_path / "o"),
                           "--memory-budget", budget], capture_output=True, text=True, env=ENV, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "--memory-budget is in GB and must be positive" in proc.stderr


def test_the_automatic_batch_is_the_largest_that_fits_the_budget(tmp_path):
    """``auto`` takes the J-K backend's batch on a CPU (8 for paracetamol's exact STO-3G ERIs), or the
    largest batch below it that fits with the next one prepared beside it; density fitting takes one
    conformer at a time on a CPU."""
    from qm1b.batching import batch_sizes
    from qm1b.settings import GenerateConfig

    smiles = tmp_path / "in.smi"
    smiles.write_text("CC(=O)Nc1ccc(O)cc1 paracetamol\nCCO ethanol\n")
    for jk in ("ipu", "df"):
        dft = RKSConfig(basis="sto-3g" if jk == "ipu" else "6-31g", xc="b3lyp5", jk=jk)
        method = resolve(dft)

        def sizes(budget: float) -> tuple:
            run = GenerateConfig(smiles=str(smiles), memory_budget=budget, progress=False).resolved(dft)
            inputs = run.inputs()
            chosen = batch_sizes(run, method, inputs, run.buckets(method, inputs))
            largest = max(chosen, key=lambda bucket: bucket.nao_padded)
            return largest, chosen[largest]

        largest, size = sizes(5)
        if jk == "df":
            assert size == 1
            continue
        assert size == method.backend.cpu_batch(largest) == 8
        pair = lambda n: batch_memory(largest, method, n, prepared_ahead=n).total  # noqa: E731
        assert sizes((pair(3) + pair(4)) / 2 / GB)[1] == 3


def test_large_exact_buckets_take_one_conformer_at_a_time_on_a_cpu():
    """A CPU's automatic batch for the exact ERIs: 8 conformers while one conformer's float32 s8 array
    is below 16 MB (aspirin, 13 heavy atoms, at STO-3G: 15 MB, where 8 conformers took as long in
    batches of 8 as in batches of one), one from there (naproxen's 17 heavy atoms: 49 MB, where the
    batches of 6 the budget let through took 1.4 times as long: benchmarks/RESULTS.md)."""
    from pyscf_ipu.jk.exact import ONE_AT_A_TIME_BYTES
    from pyscf_ipu.packed import s8_size
    from qm1b.conformers import embed_conformers

    method = resolve(RKSConfig(basis="sto-3g", jk="ipu"))
    for smiles, expected in (("CC(=O)Oc1ccccc1C(=O)O", 8), ("COc1ccc2cc(C(C)C(=O)O)ccc2c1", 1)):
        bucket = method.same_bucket(embed_conformers(smiles, 1, 0, 0))
        assert (4 * s8_size(bucket.nao_padded) >= ONE_AT_A_TIME_BYTES) == (expected == 1)
        assert method.backend.cpu_batch(bucket) == expected


def test_a_bucket_whose_batches_fit_only_one_at_a_time_runs_them_so(tmp_path):
    """Diazepam at def2-SVP and grid level 3 under an 8 GB budget: one conformer fits (measured 5.5 GB),
    one beside the next one prepared does not, so its batches wait for the one before instead of the
    run being refused; a budget that holds two lets them overlap."""
    import numpy as np

    from pyscf_ipu.molecule import Molecule
    from qm1b.batching import check_memory, prepares_ahead
    from qm1b.settings import GenerateConfig

    charges = [6] * 16 + [1] * 13 + [17] + [7] * 2 + [8]  # C16H13ClN2O: a size bucket needs only the atoms
    diazepam = Molecule(np.array(charges), np.arange(3 * len(charges), dtype=float).reshape(-1, 3) * 2.0)
    dft = RKSConfig(basis="def2-svp", xc="b3lyp5", jk="df", grid_level=3, integrals="auto")
    method = resolve(dft, 8)  # its factor held whole under 8 GB
    bucket = method.bucket(diazepam)
    assert not bucket.streams_factor
    assert batch_memory(bucket, method, 1).total <= 8 * GB < batch_memory(bucket, method, 1, prepared_ahead=1).total
    tight, roomy = GenerateConfig(memory_budget=8).resolved(dft), GenerateConfig(memory_budget=16).resolved(dft)
    check_memory(tight, method, {bucket: 1})  # not refused
    assert prepares_ahead(tight, method, {bucket: 1}) == {bucket: False}
    assert prepares_ahead(roomy, method, {bucket: 1}) == {bucket: True}


def test_the_device_gradients_count_in_the_batch_memory_and_narrow_a_gpu_batch():
    """With forces on the device's programs (the JAX integrals), a batch's estimate holds the gradients'
    part (the XC block per conformer, the two-electron part of one conformer at a time) and an
    accelerator's batch narrows to fit it; the host's gradients, a conformer at a time after the batch,
    add nothing to the batch."""
    from pyscf_ipu.memory import DEVICE_SHARE, PROCESS_BYTES, device_batch, forces_bytes

    molecule = from_name("benzene")
    device = resolve(RKSConfig(basis="def2-svp", jk="df", integrals="jax"))
    host = resolve(RKSConfig(basis="def2-svp", jk="df", integrals="auto"))
    bucket = device.bucket(molecule)
    labels, forces = batch_memory(bucket, device, 8), batch_memory(bucket, device, 8, forces=True)
    assert forces.total - labels.total == forces_bytes(bucket, device, 8) > 0
    assert batch_memory(bucket, host, 8, forces=True).total == batch_memory(bucket, host, 8).total
    # an accelerator on which 8 conformers' labels just fit: their gradients do not fit beside them
    memory = int((batch_memory(bucket, device, 8, 8).total - PROCESS_BYTES) / DEVICE_SHARE) + 1
    assert device_batch(bucket, device, 1024, memory) == 8
    assert device_batch(bucket, device, 1024, memory, forces=True) == 4
