"""The generator on this machine's JAX device (a GPU where there is one), as a user runs it, in one call
inside a time budget: conformers per hour, the host's work beside the device's, the device's busy
share, PySCF on every host core, and the labels against PySCF.

    python benchmarks/gpu.py [--budget 480] [--size full|tiny] [--phases a,b,...] [--json FILE]

Phases, in this order, each skipped (and said so) where the time left cannot hold it:

Every run prints its rate; a finished one also its split into compiling (XLA's seconds, from JAX's
log), the programs' calls and the host's work outside them, program by program; one that its budget
stopped, the rate of what it wrote and its compiling.

- ``sto3g``: ``qm1b generate`` over distinct molecules of 9-11 heavy atoms of the built-in sample,
  SMILES to labels, QM1B's settings (B3LYP5/STO-3G, grid level 0, float32), the device's own
  integrals (``--integrals jax``: a GPU's default, forced where the device is a CPU), every other
  setting the generator's default: cold (a new process, empty program and compilation caches), then restarted
  (a new process, the caches filled). Conformers per hour, wall time by stage, and the host's CPU time
  per conformer by stage (the generator's own clock: CPU time outside compiled programs, worker
  threads included; what a run pays once, loading programs and building templates, apart), and the
  rate over the batches that load or compile no programs (what a long run approaches). On an
  NVIDIA GPU, the utilisation that ``nvidia-smi`` samples every 0.2 s through each run.
- ``programs``: the STO-3G run once more with the caches it filled, in this process's child
  ``benchmarks/program_times.py``: every compiled program's call waited for, its wall time per
  conformer (on an accelerator, its device time) beside the host's CPU time per conformer by stage:
  where a batch's time goes, and the next bottleneck.
- ``pyscf``: PySCF (RKS, its default convergence) over every host core, one single-threaded
  process per core, on a sample of the STO-3G run's very conformers (read back from its dataset).
- ``labels``: ours minus PySCF float64 on that sample, in meV (and, once the ``def2svp`` phase has
  run, ours minus PySCF's density fitting on one conformer of each of its molecules).
- ``variants``: settings of the device's ERIs that no option of the generator offers, each over the
  first 8 of those molecules (64 conformers each) with the STO-3G phase's caches
  (``benchmarks/program_times.py``): float32 ERIs, and other numbers of ERI chunks computed at once.
  Each program's device time per conformer, and the labels against PySCF float64 on a conformer per
  host core: whether a device should take another default.
- ``d3bj``: the STO-3G run again with ``--dispersion d3bj`` and the STO-3G phase's caches (the
  correction adds no program): its rate beside the run without it, and, with ``labels``, its labels
  against PySCF's with ``mf.disp = "d3bj"`` on the same sample's size.
- ``def2svp``: cold, then restarted, for a molecule of 20-30 atoms at def2-SVP with density
  fitting, on the device's own integrals (``--integrals jax``: the path a GPU takes by default,
  forced where the device is a CPU).
- ``jk``: the STO-3G run again with each other J-K backend that suits STO-3G (cold, then restarted),
  its rate beside the default's and its labels against the same PySCF sample: which backend should
  be a device's default.
- ``forces``: single points with forces (``--forces``), cold then restarted, at STO-3G on the STO-3G
  phase's molecules, at def2-SVP on the def2-SVP molecule, and at the levels ML potentials train on
  (``--preset ani1x`` and ``--preset nabladft``) on 8 of the sample's molecules: the batch's
  gradients as device programs.
- ``relax``: ``--relax dft --trajectory`` over at least 64 conformers of 9-11 heavy atoms (cold, then
  restarted): relaxed conformers per hour, steps, the host's CPU per step in the main process and in
  geomeTRIC's workers; then PySCF with geomeTRIC (its gradient with grid response, one process per
  host core) on a sample of the same starting conformers, for the ratio.
- ``ani1x``, ``qm9`` and ``nabladft``: cold, then restarted, a dataset's level (``--preset NAME``: ANI-1x's
  ωB97X/6-31G(d); QM9's B3LYP/6-31G(2df,p), with f shells; nablaDFT's ωB97X-D/def2-SVP with its
  dispersion; density fitted, grid level 3) over 8 of
  the sample's molecules, 16 conformers each, on the device's own integrals; with ``labels``, its
  rate and labels against PySCF's density-fitted same level on a sample.
- ``gpu4pyscf``: where GPU4PySCF imports, its SCF plus gradient (one conformer at a time on the same
  GPU) on a sample of the forces phases' conformers: B3LYP5 at grid level 0 at STO-3G and def2-SVP
  (density fitted), and ANI-1x's ωB97X/6-31G(d) at its grid level, density fitted: seconds per
  conformer beside ours, and the largest force difference. Its wheels
  are larger than one call's carry: ``benchmarks/gpu4pyscf_deps.sh`` packs them in parts, one per
  call, and says how to put them together there.

It needs JAX, PySCF, RDKit, geomeTRIC and h5py, and nothing from the network: on a machine without
PySCF, RDKit and geomeTRIC, unpack the archive that ``benchmarks/gpu_deps.sh`` makes and put it on
``PYTHONPATH`` (that script's header says how). ``--size tiny`` runs two molecules of two conformers
each, the STO-3G, programs, PySCF and labels phases only (the test suite's smoke test), unless
``--phases`` names others: each then runs at its tiny size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing import TimeoutError as PoolTimeout
from multiprocessing import get_context
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LABELS = ("energy", "homo", "lumo", "y")
PRESET_PHASES = ("ani1x", "qm9", "nabladft")  # datasets' levels of theory (qm1b/presets.py), one phase each
# in the order they run: the presets' phases last but one, so that their f-shell compiles cannot use the
# budget of the STO-3G, J-K, forces and relaxation phases
PHASES = ("sto3g", "programs", "pyscf", "labels", "variants", "d3bj", "def2svp", "jk", "forces", "relax",
          *PRESET_PHASES, "gpu4pyscf")
# def2-SVP: a molecule of 20 to 30 atoms, aspirin (21 atoms, 13 heavy); each more costs a compile
DEF2SVP_SMILES = ["CC(=O)Oc1ccccc1C(=O)O"]
# settings of the JAX integrals to choose between on a device (benchmarks/program_times.py's options)
ERI_VARIANTS = (("float64 ERIs, 32 chunks at once (the default)", []),
                ("float32 ERIs", ["--eri-precision", "float32"]),
                ("128 chunks at once", ["--chunk-batch", "128"]),
                ("8 chunks at once", ["--chunk-batch", "8"]),
                ("float32 ERIs, 128 chunks at once", ["--eri-precision", "float32", "--chunk-batch", "128"]))
OTHER_JK = ("dense",)  # the J-K backends besides the default that suit STO-3G (s8 gathers, df fits)
# the phases each size runs, molecules and conformers of the STO-3G phase, its PySCF sample, the
# def2-SVP conformers per molecule and their PySCF sample (one process per conformer, so a sample no
# larger than the host's cores costs one conformer's time)
SIZES = {"full": {"phases": PHASES, "molecules": 64, "conformers": 64, "sample": 128, "def2svp": 32,
                  "def2svp_sample": 8, "forces": 16, "relax_molecules": 32, "relax_conformers": 2, "relax_sample": 16,
                  "relax_steps": 100, "gpu4pyscf_sample": 4, "variant_molecules": 8, "preset_molecules": 8,
                  "preset_conformers": 16, "preset_sample": 8},
         "tiny": {"phases": ("sto3g", "programs", "pyscf", "labels"), "molecules": 2, "conformers": 2, "sample": 4, "def2svp": 0,
                  "def2svp_sample": 0, "forces": 2, "relax_molecules": 1, "relax_conformers": 2, "relax_sample": 1,
                  "relax_steps": 2, "gpu4pyscf_sample": 1, "variant_molecules": 1, "preset_molecules": 1,
                  "preset_conformers": 1, "preset_sample": 1}}  # fmt: skip


class Budget:
    """The seconds left of the run's budget."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    @property
    def left(self) -> float:
        return self.end - time.monotonic()


class DeviceMonitor:
    """``nvidia-smi``'s GPU utilisation (percent), sampled every ``period_ms`` while the block runs;
    nothing where there is no ``nvidia-smi``."""

    def __init__(self, period_ms: int = 200):
        self.period_ms, self.samples, self._process, self._reader = period_ms, [], None, None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            command = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", f"-lms={self.period_ms}"]
            self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self):
        for line in self._process.stdout:
            try:
                self.samples.append(float(line.split(",")[0]))
            except ValueError:
                continue

    def __exit__(self, *exc):
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            self._reader.join(timeout=5)

    def summary(self) -> dict | None:
        """Mean utilisation over the whole run, and over its steady state (from the first sample
        above zero to the last: the process's start and end, loading programs, left out)."""
        if not self.samples:
            return None
        busy = [k for k, u in enumerate(self.samples) if u > 0]
        steady = self.samples[busy[0] : busy[-1] + 1] if busy else []
        return {"samples": len(self.samples), "mean_percent": statistics.fmean(self.samples),
                "steady_mean_percent": statistics.fmean(steady) if steady else 0.0,
                "steady_idle_share": sum(u == 0 for u in steady) / len(steady) if steady else 1.0}  # fmt: skip


@dataclass
class Run:
    """One ``qm1b generate`` process."""

    wall: float  # the process's seconds, its start and imports included
    summary: dict | None  # the generator's own report (None: it did not finish)
    device: dict | None  # the GPU's utilisation through it
    error: str = ""
    compiling: float = 0.0  # XLA's compile seconds, from its log (JAX_LOG_COMPILES): also for a stopped run
    written: int = 0  # conformers in its dataset: also for a stopped run


def generate(out: Path, cache: Path, smiles: Path, extra: list[str], timeout: float) -> Run:
    """``qm1b generate`` in a new process over ``smiles`` into ``out``, with the program and compilation
    caches in ``cache``; stopped after ``timeout`` seconds. Its console output goes to ``out``.log."""
    report = out.with_suffix(".json")
    command = [sys.executable, "-m", "qm1b.cli", "generate", "--smiles", str(smiles), "--out", str(out),
               "--no-progress", "--report", str(report), *extra]  # fmt: skip
    env = {**os.environ, "PYSCF_IPU_CACHE": str(cache), "JAX_LOG_COMPILES": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    start = time.perf_counter()
    with DeviceMonitor() as monitor:
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired as stopped:
            text = "".join(t.decode(errors="replace") if isinstance(t, bytes) else t or ""
                           for t in (stopped.stdout, stopped.stderr))  # fmt: skip
            out.with_suffix(".log").write_text(text)
            count = written(out)
            return Run(time.perf_counter() - start, None, monitor.summary(),
                       f"stopped after {timeout:.0f} s, {count} conformers written", compile_seconds(text), count)
    wall = time.perf_counter() - start
    text = done.stdout + done.stderr
    out.with_suffix(".log").write_text(text)  # kept where --work keeps the datasets
    if done.returncode != 0:
        return Run(wall, None, monitor.summary(), (done.stderr.strip().splitlines() or ["exit code %d" % done.returncode])[-1],
                   compile_seconds(text), written(out))  # fmt: skip
    summary = json.loads(report.read_text())[0]
    return Run(wall, summary, monitor.summary(), "", compile_seconds(text), summary["conformers"])


def compile_seconds(log: str) -> float:
    """The sum of XLA's compile seconds that JAX logged (``JAX_LOG_COMPILES``) in a run's output."""
    return sum(float(m) for m in re.findall(r"Finished XLA compilation of .* in ([0-9.eE+-]+) sec", log))


def written(out: Path) -> int:
    """How far a stopped run got: the conformers in its dataset (0 where nothing was written)."""
    from qm1b.store import open_dataset

    try:
        with open_dataset(out) as dataset:
            return len(dataset)
    except FileNotFoundError:  # stopped before its first batch was written
        return 0


def describe(name: str, run: Run) -> list[str]:
    """What one run printed to the console: rate, host work by stage, wall time by stage, device use."""
    if run.summary is None:  # the rate of what it finished, and its compiling, which the log tells
        rate = 3600 * run.written / run.wall if run.wall else 0.0
        return [f"{name}: did not finish ({run.error}); {rate:,.0f} conformers per hour from what it wrote, "
                f"{run.compiling:.1f} s of it compiling"]
    s = run.summary
    n = max(1, s["conformers"] + s["failures"])
    host = {k: 1000 * v / n for k, v in s["host"].items() if k not in s["once_seconds"]}
    lines = [f"{name}: {s['conformers']} conformers in {s['seconds']:.1f} s ({run.wall:.1f} s with the process's "
             f"start): {s['conformers_per_hour']:,.0f} conformers per hour, {s['seconds'] / n:.3f} s per conformer"
             + (f" ({s['steady_conformers_per_hour']:,.0f} per hour, {3600 / s['steady_conformers_per_hour']:.3f} s "
                "per conformer in batches that load no programs)" if s.get("steady_conformers_per_hour") else "")
             + f"; {s['converged']}/{s['conformers']} converged",
             f"  host CPU per conformer: {s['host_ms_per_conformer']:.2f} ms ("
             + ", ".join(f"{k} {v:.2f}" for k, v in sorted(host.items(), key=lambda kv: -kv[1])) + "), and once: "
             + ", ".join(f"{k} {v:.1f} s" for k, v in s["once_seconds"].items()),
             "  wall by stage per conformer: " + ", ".join(f"{k} {1000 * v / n:.1f} ms" for k, v in
                                                            sorted(s["timings"].items(), key=lambda kv: -kv[1]))]  # fmt: skip
    programs = s.get("programs") or {}
    if programs:  # the split: compiling (and loading), the programs' calls, the host's work outside them
        calls = sum(p["call_seconds"] for p in programs.values())
        loads = sum(p["load_seconds"] for p in programs.values())
        host = sum(v for k, v in s["host"].items())
        lines.append(f"  split: {run.compiling:.1f} s XLA compiling ({loads:.1f} s loading, tracing or compiling "
                     f"programs, first calls whole), {calls:.1f} s in the programs' other calls (on a CPU their run "
                     f"time, on a GPU their dispatch), {host:.1f} s host CPU outside programs; by program: "
                     + ", ".join(f"{name} {p['load_seconds']:.1f} + {p['calls']} x {p['call_seconds'] / max(1, p['calls']):.3f} s"
                                 for name, p in sorted(programs.items(), key=lambda kv: -(kv[1]['load_seconds'] + kv[1]['call_seconds']))
                                 if p["load_seconds"] + p["call_seconds"] >= 0.05))  # fmt: skip
    if run.device is not None:
        d = run.device
        lines.append(f"  GPU utilisation: {d['mean_percent']:.0f}% over the run, {d['steady_mean_percent']:.0f}% over "
                     f"its steady state ({d['steady_idle_share']:.0%} of those samples idle; {d['samples']} samples)")
    return lines


def pyscf_one(task: tuple) -> dict:
    """One conformer by PySCF (RKS at the run's settings, its default convergence), labels in eV. The
    functional by its libxc name; a dispersion correction PySCF lacks (ωB97X-D's) added to its energy
    as this package computes it (:func:`pyscf_ipu.reference.pyscf_runnable`)."""
    numbers, positions, basis, fitted, dispersion, xc, grid_level = task
    from pyscf import dft, gto

    from pyscf_ipu.config import RKSConfig
    from pyscf_ipu.molecule import Molecule
    from pyscf_ipu.reference import pyscf_runnable
    from pyscf_ipu.resolution import resolve
    from pyscf_ipu.units import HARTREE_TO_EV

    start = time.perf_counter()
    # the functional and the correction as a run resolves them (its J-K backend is not read here)
    settings = RKSConfig(basis=basis, xc=xc, dispersion=dispersion, grid_level=grid_level, jk="df", integrals="auto")
    method, added = pyscf_runnable(Molecule(np.asarray(numbers, int), np.asarray(positions, float)), resolve(settings))
    mol = gto.M(atom=[(int(z), tuple(p)) for z, p in zip(numbers, positions)], unit="Bohr", basis=basis, verbose=0)
    mf = dft.RKS(mol, xc=method.functional.libxc_code)
    mf.grids.level = grid_level
    if fitted:
        mf = mf.density_fit()
    mf = method.dispersion.pyscf_counterpart(mf)
    energy = mf.kernel() + added
    nocc = mol.nelectron // 2
    homo, lumo = mf.mo_energy[nocc - 1], mf.mo_energy[nocc]
    ev = HARTREE_TO_EV
    return {"energy": energy * ev, "homo": homo * ev, "lumo": lumo * ev, "y": (lumo - homo) * ev,
            "converged": bool(mf.converged), "seconds": time.perf_counter() - start}  # fmt: skip


def conformers_of(directory: Path) -> list[dict]:
    """The dataset's records (atomic numbers, positions in Bohr, labels), ordered by key."""
    from qm1b.store import open_dataset

    with open_dataset(directory) as dataset:
        records = sorted(dataset.records(), key=lambda r: (r["molecule_id"], r["conformer_id"]))
    return [{"z": r["z"], "pos": r["pos"].astype(float), **{q: float(r[q]) for q in LABELS}} for r in records]


def pyscf_on_every_core(records: list[dict], basis: str, fitted: bool, timeout: float, relax: bool = False,
                        dispersion: str = "none", xc: str = "b3lyp5", grid_level: int = 0
                        ) -> tuple[list[dict], float] | None:  # fmt: skip
    """PySCF over ``records``, one single-threaded process per host core: (labels, wall seconds), or
    None past ``timeout`` (the workers are then terminated); with ``relax``, each relaxed by geomeTRIC
    instead (converged, steps, seconds); with ``dispersion``, PySCF's ``mf.disp`` (or the correction's
    energy added, where PySCF lacks it: :func:`pyscf_one`); ``xc`` and
    ``grid_level`` PySCF's (relaxations: B3LYP5 at level 0)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(dict.fromkeys(saved, "1"))  # the workers inherit it before they import numpy
    pool = get_context("spawn").Pool(min(cores, len(records)))
    try:
        start = time.perf_counter()
        tasks = [(r["z"], r["pos"], basis, fitted, dispersion, xc, grid_level) for r in records]
        work = pool.map_async(pyscf_relax_one if relax else pyscf_one, tasks, chunksize=1)
        labels = work.get(timeout=max(1.0, timeout))
        return labels, time.perf_counter() - start
    except PoolTimeout:
        return None
    finally:
        pool.terminate()
        pool.join()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def spread(records: list[dict], count: int) -> list[dict]:
    """At most ``count`` of ``records``, evenly spread over them (so over their molecules)."""
    step = max(1, -(-len(records) // count))
    return records[::step][:count]


def compare(ours: list[dict], theirs: list[dict], title: str) -> dict:
    """The largest |ours - PySCF| per label (meV), and PySCF's converged count, printed after ``title``."""
    differences = {**{q: max(abs(a[q] - b[q]) * 1000 for a, b in zip(ours, theirs)) for q in LABELS},
                   "pyscf_converged": sum(b["converged"] for b in theirs), "count": len(theirs)}  # fmt: skip
    print(f"{title} (largest, meV): " + ", ".join(f"{q} {differences[q]:.3f}" for q in LABELS)
          + f"; PySCF converged {differences['pyscf_converged']}/{differences['count']}", flush=True)
    return differences


def write_smiles(path: Path, smiles: list[str]) -> Path:
    path.write_text("".join(f"{s} m{k}\n" for k, s in enumerate(smiles)))
    return path


@dataclass(frozen=True)
class Phase:
    """A generator phase: its name (of :data:`PHASES`), its title, the seconds left below which a run
    is skipped, and the seconds each run leaves the rest of the budget."""

    name: str
    title: str
    least: float
    reserve: float


def cold_then_restarted(phase: Phase, smiles: Path, extra: list[str], work: Path, budget: Budget, results: dict) -> None:
    """``phase``'s ``qm1b generate`` over ``smiles``, cold (empty caches), then restarted (the caches the
    cold run filled), each printed and kept in ``results`` as ``{name}_{cold|restarted}``."""
    cache = work / f"cache-{phase.name}"
    for window in ("cold", "restarted"):
        if budget.left < phase.least:
            print(f"{phase.name} {window}: skipped, {budget.left:.0f} s left")
            continue
        out = work / f"{phase.name}-{window}"
        shutil.rmtree(out, ignore_errors=True)
        run = generate(out, cache, smiles, extra, budget.left - phase.reserve)
        results[f"{phase.name}_{window}"] = run.__dict__
        print("\n".join(describe(f"{phase.title} {window}", run)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=480.0, help="seconds the whole run may take (default: 480)")
    parser.add_argument("--size", choices=tuple(SIZES), default="full")
    parser.add_argument("--phases", help=f"of {', '.join(PHASES)} (default: all the size's)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure here")
    parser.add_argument("--work", metavar="DIR", help="keep the datasets and caches here (default: a temporary folder)")
    args = parser.parse_args()
    budget = Budget(args.budget)
    size = SIZES[args.size]
    phases = set(args.phases.split(",")) if args.phases else set(size["phases"])  # named ones run at any size
    if phases - set(PHASES):
        parser.error(f"unknown phases {sorted(phases - set(PHASES))}: choose from {', '.join(PHASES)}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-benchmark-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    import jax

    from pyscf_ipu.programs import device_description

    device = device_description()
    print(f"device: {device}; JAX {jax.__version__}; {os.cpu_count()} host cores; budget {args.budget:.0f} s", flush=True)
    results: dict = {"device": device, "jax": jax.__version__, "size": args.size}
    try:
        run_phases(phases, size, work, budget, results)
    finally:  # what was measured, also when a phase failed
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"done, {budget.left:.0f} s of the budget left")


def run_phases(phases: set[str], size: dict, work: Path, budget: Budget, results: dict) -> None:
    """The phases of :data:`PHASES` in ``phases``, in that order, each figure printed and kept in ``results``."""
    from pyscf_ipu.config import RKSConfig
    from qm1b.inputs import builtin_sample
    from qm1b.presets import PRESETS

    sample = [m.smiles for m in builtin_sample() if m.heavy_atoms is not None and 9 <= m.heavy_atoms <= 11]
    sto3g = write_smiles(work / "sto3g.smi", sample[: size["molecules"]])
    common = ["--conformers", str(size["conformers"]), "--integrals", "jax"]
    if "sto3g" in phases:
        cold_then_restarted(Phase("sto3g", "STO-3G", 30, 20), sto3g, common, work, budget, results)
    if "programs" in phases and results.get("sto3g_restarted", {}).get("summary") and budget.left > 40:
        results["programs"] = program_times(sto3g, common, work, budget.left - 30)

    reference = None  # PySCF's labels on the sample of the STO-3G run's conformers
    if {"pyscf", "labels"} & phases and results.get("sto3g_restarted", {}).get("summary"):
        records = spread(conformers_of(work / "sto3g-restarted"), size["sample"])
        done = pyscf_on_every_core(records, "sto-3g", False, budget.left - 10) if budget.left > 30 else None
        if done is None:
            print("PySCF: skipped or stopped, the budget ran out")
        else:
            reference, seconds = done
            rate = 3600 * len(records) / seconds
            ours = results["sto3g_restarted"]["summary"]["conformers_per_hour"]
            results["pyscf_sto3g"] = {"conformers_per_hour": rate, "seconds": seconds, "count": len(records)}
            print(f"PySCF, one process per host core, {len(records)} of those conformers: {rate:,.0f} conformers "
                  f"per hour; ours restarted {ours / rate:.2f}x that", flush=True)  # fmt: skip
            if "labels" in phases:
                results["labels_sto3g_mev"] = compare(records, reference, "labels, ours - PySCF float64")

    if "variants" in phases:
        variants_phase(sample[: size["variant_molecules"]], common, work, budget, results)

    if "d3bj" in phases and results.get("sto3g_restarted", {}).get("summary") and budget.left > 30:
        out = work / "d3bj"  # the STO-3G run's programs serve it: the correction is the host's
        run = generate(out, work / "cache-sto3g", sto3g, [*common, "--dispersion", "d3bj"], budget.left - 20)
        results["d3bj_restarted"] = run.__dict__
        print("\n".join(describe("STO-3G with D3(BJ), restarted", run)), flush=True)
        if run.summary is not None:
            rate = run.summary["conformers_per_hour"] / results["sto3g_restarted"]["summary"]["conformers_per_hour"]
            print(f"  {rate:.2f}x the rate without it", flush=True)
            if "labels" in phases and budget.left > 30:
                records = spread(conformers_of(out), size["sample"])
                done = pyscf_on_every_core(records, "sto-3g", False, budget.left - 10, dispersion="d3bj")
                if done is not None:
                    results["labels_d3bj_mev"] = compare(records, done[0], "  D3(BJ) labels, ours - PySCF float64 "
                                                         "with mf.disp")  # fmt: skip

    if "def2svp" in phases:
        smiles = write_smiles(work / "def2svp.smi", DEF2SVP_SMILES)
        extra = ["--conformers", str(size["def2svp"]), "--basis", "def2-svp", "--jk", "df", "--integrals", "jax"]
        cold_then_restarted(Phase("def2svp", "def2-SVP", 60, 40), smiles, extra, work, budget, results)
        if "labels" in phases and results.get("def2svp_restarted", {}).get("summary") and budget.left > 60:
            records = spread(conformers_of(work / "def2svp-restarted"), size["def2svp_sample"])
            done = pyscf_on_every_core(records, "def2-svp", True, budget.left - 10)
            if done is not None:
                results["labels_def2svp_mev"] = compare(records, done[0], "def2-SVP labels, ours - PySCF's density "
                                                        "fitting")  # fmt: skip

    if "jk" in phases and results.get("sto3g_restarted", {}).get("summary"):
        default = results["sto3g_restarted"]["summary"]["conformers_per_hour"]
        for jk in OTHER_JK:
            phase = Phase(f"jk-{jk}", f"STO-3G --jk {jk}", 30, 10)
            cold_then_restarted(phase, sto3g, [*common, "--jk", jk], work, budget, results)
            summary = results.get(f"{phase.name}_restarted", {}).get("summary")
            if summary:
                print(f"  --jk {jk} restarted: {summary['conformers_per_hour'] / default:.2f}x the default's rate")
                if reference is not None:
                    records = spread(conformers_of(work / f"{phase.name}-restarted"), size["sample"])
                    results[f"labels_{phase.name}_mev"] = compare(records, reference, f"  --jk {jk} labels, ours - "
                                                                  "PySCF float64")  # fmt: skip

    if "forces" in phases:
        extra = ["--conformers", str(size["forces"]), "--integrals", "jax", "--forces"]
        cold_then_restarted(Phase("forces-sto3g", "STO-3G forces", 30, 20), sto3g, extra, work, budget, results)
        smiles = write_smiles(work / "def2svp.smi", DEF2SVP_SMILES)
        extra = ["--conformers", str(size["forces"]), "--basis", "def2-svp", "--jk", "df", "--integrals", "jax",
                 "--forces"]  # fmt: skip
        cold_then_restarted(Phase("forces-def2svp", "def2-SVP forces", 60, 30), smiles, extra, work, budget, results)
        for name in ("ani1x", "nabladft"):  # the levels ML potentials train on, 9-11 heavy atoms
            smiles = write_smiles(work / f"forces-{name}.smi", sample[: size["preset_molecules"]])
            extra = ["--conformers", str(size["forces"]), "--preset", name, "--integrals", "jax", "--forces"]
            cold_then_restarted(Phase(f"forces-{name}", f"--preset {name} forces", 60, 30), smiles, extra, work,
                                budget, results)  # fmt: skip

    if "relax" in phases:
        relaxed = write_smiles(work / "relax.smi", sample[: size["relax_molecules"]])
        extra = ["--conformers", str(size["relax_conformers"]), "--integrals", "jax", "--relax", "dft", "--trajectory",
                 "--max-steps", str(size["relax_steps"])]  # fmt: skip
        cold_then_restarted(Phase("relax", "relaxation, STO-3G", 60, 30), relaxed, extra, work, budget, results)
        summary = results.get("relax_restarted", {}).get("summary")
        if summary and budget.left > 60:
            starts = spread(first_frames(work / "relax-restarted"), size["relax_sample"])
            done = pyscf_on_every_core(starts, "sto-3g", False, budget.left - 10, relax=True)
            if done is not None:
                rate = 3600 * len(starts) / done[1]
                results["pyscf_relax"] = {"conformers_per_hour": rate, "seconds": done[1], "count": len(starts),
                                          "converged": sum(r["converged"] for r in done[0])}  # fmt: skip
                print(f"PySCF with geomeTRIC, one process per host core, {len(starts)} of those starts: {rate:,.0f} "
                      f"relaxed per hour; ours restarted {summary['conformers_per_hour'] / rate:.2f}x that",
                      flush=True)  # fmt: skip

    for name in PRESET_PHASES:  # a dataset's level, density fitted: cold, restarted, and PySCF's same level
        if name not in phases:
            continue
        settings = PRESETS[name].settings
        title = f"{settings['xc']}/{settings['basis']}"
        smiles = write_smiles(work / f"{name}.smi", sample[: size["preset_molecules"]])
        extra = ["--conformers", str(size["preset_conformers"]), "--preset", name, "--integrals", "jax"]
        cold_then_restarted(Phase(name, f"--preset {name}, {title}", 60, 40), smiles, extra, work, budget, results)
        if "labels" in phases and results.get(f"{name}_restarted", {}).get("summary") and budget.left > 60:
            records = spread(conformers_of(work / f"{name}-restarted"), size["preset_sample"])
            done = pyscf_on_every_core(records, settings["basis"], True, budget.left - 10, xc=settings["xc"],
                                       grid_level=settings["grid_level"],
                                       dispersion=RKSConfig(**settings).dispersion)  # fmt: skip
            if done is not None:
                rate = 3600 * len(records) / done[1]
                ours = results[f"{name}_restarted"]["summary"]["conformers_per_hour"]
                results[f"pyscf_{name}"] = {"conformers_per_hour": rate, "seconds": done[1], "count": len(records)}
                print(f"PySCF {title} density fitted, one process per host core: {rate:,.0f} conformers per "
                      f"hour; ours restarted {ours / rate:.2f}x that", flush=True)  # fmt: skip
                results[f"labels_{name}_mev"] = compare(records, done[0], f"{title} labels, ours - PySCF's density "
                                                        "fitting")  # fmt: skip

    if "gpu4pyscf" in phases:
        gpu4pyscf_phase(size, work, budget, results)


def program_times(smiles: Path, extra: list[str], work: Path, timeout: float, name: str = "programs",
                  title: str = "STO-3G") -> dict | None:  # fmt: skip
    """``benchmarks/program_times.py`` over ``smiles`` with the STO-3G phase's caches, its dataset in
    ``work``/``name``: each program's wall time per conformer, its calls waited for, beside the host's
    time; printed under ``title``."""
    out, report = work / name, work / f"{name}.json"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, str(ROOT / "benchmarks" / "program_times.py"), "--json", str(report),
               "--smiles", str(smiles), "--out", str(out), *extra]  # fmt: skip
    env = {**os.environ, "PYSCF_IPU_CACHE": str(work / "cache-sto3g"), "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        print(f"{name}: stopped after {timeout:.0f} s")
        return None
    print(f"{title}, each program waited for (benchmarks/program_times.py):\n" + done.stdout.rstrip()
          + (f"\n  failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}" if done.returncode else ""), flush=True)
    return json.loads(report.read_text()) if done.returncode == 0 else None


def variants_phase(sample: list[str], common: list[str], work: Path, budget: Budget, results: dict) -> None:
    """Each of :data:`ERI_VARIANTS` over the SMILES ``sample``: its programs' device time per conformer
    (:func:`program_times`; its new programs' compiling not counted), and its labels against PySCF
    float64 on a sample of its conformers, one per host core."""
    from pyscf_ipu.programs import usable_cores

    smiles = write_smiles(work / "variants.smi", sample)
    cores = usable_cores()
    for name, extra in ERI_VARIANTS:
        if budget.left < 60:
            print(f"variant {name}: skipped, {budget.left:.0f} s left")
            continue
        key = "variant-" + "-".join(extra[1::2] or ["default"])
        figures = program_times(smiles, [*common, *extra], work, budget.left - 30, key, f"variant: {name}")
        results[key] = {"name": name, "programs": figures}
        if figures is not None and budget.left > 40:
            records = spread(conformers_of(work / key), cores)
            done = pyscf_on_every_core(records, "sto-3g", False, budget.left - 20)
            if done is not None:
                results[key]["labels_mev"] = compare(records, done[0], f"  {name}: labels, ours - PySCF float64")


def first_frames(directory: Path) -> list[dict]:
    """Each relaxed conformer's starting geometry (its trajectory's step 0), ordered by key."""
    from qm1b.store import open_dataset

    out = []
    with open_dataset(directory) as dataset:
        for batch in dataset.frames():
            offsets = batch.atom_offsets()
            for i in np.flatnonzero(np.asarray(batch.columns["step"]) == 0):
                out.append({"z": batch.z[offsets[i]:offsets[i + 1]], "pos": batch.pos[offsets[i]:offsets[i + 1]].astype(float),
                            "key": (int(batch.columns["molecule_id"][i]), int(batch.columns["conformer_id"][i]))})  # fmt: skip
    return sorted(out, key=lambda r: r["key"])


def pyscf_relax_one(task: tuple) -> dict:
    """One conformer relaxed by PySCF with geomeTRIC (B3LYP5/STO-3G, grid level 0, its gradient with
    grid response, geomeTRIC's defaults)."""
    from pyscf import dft, gto
    from pyscf.geomopt import geometric_solver

    numbers, positions, basis, *_ = task
    start = time.perf_counter()
    mol = gto.M(atom=[(int(z), tuple(p)) for z, p in zip(numbers, positions)], unit="Bohr", basis=basis, verbose=0)
    mf = dft.RKS(mol, xc="b3lyp5")
    mf.grids.level = 0
    gradient = mf.nuc_grad_method()
    gradient.grid_response = True
    steps = []
    # geomeTRIC configures its own loggers onto the console at each call: its banner and every step
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        converged, _ = geometric_solver.kernel(gradient, maxsteps=100, callback=lambda env: steps.append(env["energy"]))
    return {"converged": bool(converged), "steps": len(steps), "seconds": time.perf_counter() - start}


def forces_of(directory: Path) -> list[dict]:
    """The dataset's records with their forces (eV/Bohr), ordered by key."""
    from qm1b.store import open_dataset

    with open_dataset(directory) as dataset:
        records = sorted(dataset.records(), key=lambda r: (r["molecule_id"], r["conformer_id"]))
    return [{"z": r["z"], "pos": r["pos"].astype(float), "forces": r["forces"].astype(float)} for r in records]


def gpu4pyscf_phase(size: dict, work: Path, budget: Budget, results: dict) -> None:
    """GPU4PySCF's SCF plus gradient, one conformer at a time, on a sample of each forces phase's
    conformers: seconds per conformer beside ours, and the largest force difference (Hartree/Bohr)."""
    try:
        import gpu4pyscf  # noqa: F401
    except ImportError as err:
        print(f"gpu4pyscf: skipped, it does not import here ({err})")
        return
    from pyscf import gto

    from pyscf_ipu.units import HARTREE_TO_EV
    from qm1b.presets import PRESETS

    for basis, phase, xc in (("sto-3g", "forces-sto3g", "b3lyp5"), ("def2-svp", "forces-def2svp", "b3lyp5"),
                             ("6-31g*", "forces-ani1x", "wb97x")):  # fmt: skip
        ours = results.get(f"{phase}_restarted", {}).get("summary")
        if not ours or budget.left < 60:
            print(f"gpu4pyscf {basis}: skipped ({'no run of ours' if not ours else 'the budget ran out'})")
            continue
        records = spread(forces_of(work / f"{phase}-restarted"), size["gpu4pyscf_sample"])
        seconds, worst = [], 0.0
        for record in records:
            from gpu4pyscf import dft as gpu_dft

            mol = gto.M(atom=[(int(z), tuple(p)) for z, p in zip(record["z"], record["pos"])], unit="Bohr",
                        basis=basis, verbose=0)  # fmt: skip
            start = time.perf_counter()
            mf = gpu_dft.RKS(mol, xc=xc)
            mf.grids.level = PRESETS["ani1x"].settings["grid_level"] if phase == "forces-ani1x" else 0
            if basis != "sto-3g":
                mf = mf.density_fit()
            mf.kernel()
            gradient = mf.nuc_grad_method()
            gradient.grid_response = True
            theirs = np.asarray(gradient.kernel())
            seconds.append(time.perf_counter() - start)
            worst = max(worst, float(np.abs(-record["forces"] / HARTREE_TO_EV - theirs).max()))
        per = statistics.median(seconds[1:] or seconds)  # the first call compiles GPU4PySCF's kernels
        ours_per = ours["seconds"] / max(1, ours["conformers"])
        results[f"gpu4pyscf_{phase}"] = {"seconds_per_conformer": per, "ours_seconds_per_conformer": ours_per,
                                         "largest_force_difference": worst, "count": len(records)}  # fmt: skip
        print(f"GPU4PySCF {xc}/{basis}, SCF and gradient: {per:.2f} s per conformer (median of {len(seconds)}); ours "
              f"{ours_per:.3f} s: {per / ours_per:.1f}x; forces within {worst:.1e} Hartree/Bohr", flush=True)


if __name__ == "__main__":
    main()
