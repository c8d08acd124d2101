"""How the cost grows with the molecule: the generator against PySCF from QM9 size to drug size, per level.

    python benchmarks/cost_growth.py [--bases 6-31g*,def2-svp] [--levels 0] [--conformers 2]
                                     [--molecules indole,paracetamol,aspirin,naproxen,diazepam]
                                     [--jk df] [--batch-size 1|auto] [--memory-budget 8] [--plot cost_growth.png]
    python benchmarks/cost_growth.py --presets qm9,ani1x [...]
    python benchmarks/cost_growth.py --xc wb97x --bases def2-svp [...]
    python benchmarks/cost_growth.py --xc b3lyp --dispersion d3bj --bases 6-31g* [...]

For each level of theory (each basis and grid level with ``--xc``, by default the generator's
functional; or each of ``--presets``: a dataset's functional, basis and grid, which our side gets as
``--preset NAME``) and each molecule (about 9, 11, 13, 17 and 20 heavy atoms), interleaved:

- the molecule's conformers are embedded with the generator's seeds and written to one XYZ file, so
  that both sides label the very same geometries;
- **ours, cold**: ``qm1b generate --geometries FILE`` in a new process with an empty program
  directory and compilation cache, at the level's functional (B3LYP with VWN5, the generator's, unless
  a preset names another), float32, its default integrals, ``--jk`` as given (``df`` by default: the ERI arrays of the other backends
  grow as N^4 and do not fit at these sizes), the molecule's conformers in batches of ``--batch-size``
  (1 by default: on a CPU the fastest per conformer at these sizes; ``auto``: what the generator picks
  by default, the J-K backend's batch on a CPU), or of the largest size below it whose estimated
  peak (:mod:`pyscf_ipu.memory`, the next batch prepared beside it) fits
  ``--memory-budget``, which the generator is given too;
- **ours, restarted**: the same command in a new process with the cache the cold run filled;
- **PySCF direct** and **PySCF density fitted** (``density_fit()`` in the fitting basis PySCF picks
  for the orbital basis, as ours uses), float64, default convergence, each in a new process over the
  molecule's conformers one by one (in this long-lived process PySCF ran up to 1.25 times slower).
  A user would pick the faster, so that is the anchor. ``--direct-limit`` skips direct
  above a size (shown as nan) where it is already several times slower than density fitting.

Threads: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2 everywhere (PySCF's best here); XLA's default.
Our seconds per conformer are the generator's own time (its summary line: the interpreter's start
and imports excluded) over the conformers; PySCF's each run's own, from building
its molecule to its labels. Peak memory is each process's resident peak. Labels: ours minus PySCF's
density fitting (same fitting basis: what our code adds), PySCF's density fitting minus PySCF
direct (the fitting error) and ours minus PySCF direct (what an exact-ERI run adds), the largest
over the conformers, in meV.

The log-log plot draws seconds per conformer against AOs for ours (restarted) and the faster PySCF
method, with least-squares exponents (seconds ~ AOs^p) in the legend.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import numpy as np  # noqa: E402

from common import SUMMARY  # noqa: E402
from throughput import LABELS, pyscf_labels  # noqa: E402

from pyscf_ipu.config import OWN_DISPERSION, IPUConfig, RKSConfig  # noqa: E402
from pyscf_ipu.geometries import read_frames  # noqa: E402
from pyscf_ipu.resolution import resolve  # noqa: E402
from pyscf_ipu.memory import largest_batch  # noqa: E402
from pyscf_ipu.pyscf_mole import build_mole  # noqa: E402
from pyscf_ipu.units import BOHR_RADIUS_ANGSTROM  # noqa: E402
from qm1b.conformers import embed_conformers  # noqa: E402
from qm1b.generate import GENERATOR_DFT_DEFAULTS, GenerateConfig  # noqa: E402
from qm1b.presets import PRESETS, preset_settings  # noqa: E402
from qm1b.store import open_dataset  # noqa: E402

MOLECULES = {  # name: SMILES, from QM9 size to drug size (heavy atoms in the comment)
    "indole": "c1ccc2[nH]ccc2c1",  # 9, a QM9 molecule
    "paracetamol": "CC(=O)Nc1ccc(O)cc1",  # 11
    "aspirin": "CC(=O)Oc1ccccc1C(=O)O",  # 13
    "naproxen": "COc1ccc2cc(C(C)C(=O)O)ccc2c1",  # 17
    "diazepam": "CN1C(=O)CN=C(c2ccccc2)c2cc(Cl)ccc21",  # 20
}
XC = "b3lyp5"


def write_xyz(path: Path, conformers) -> Path:
    """The conformers as one multi-frame XYZ file (Angstrom)."""
    frames = []
    for m in conformers:
        rows = [f"{s} {x:.10f} {y:.10f} {z:.10f}" for s, (x, y, z) in zip(m.symbols, m.positions * BOHR_RADIUS_ANGSTROM)]
        frames.append("\n".join([str(m.natom), m.name or ""] + rows))
    path.write_text("\n".join(frames) + "\n")
    return path


class Level(NamedTuple):
    """A level of theory both sides run: ``options`` are what our side is given for it."""

    xc: str
    basis: str
    grid_level: int
    dispersion: str
    options: tuple[str, ...]


def levels(args) -> list[Level]:
    """The benchmark's levels: each of ``--presets`` as the generator resolves it, else each basis and
    grid level with ``--xc`` and ``--dispersion``."""
    if args.presets:
        return [Level(settings["xc"], settings["basis"], settings["grid_level"], settings["dispersion"],
                      ("--preset", name)) for name in args.presets.split(",") for settings in [preset_settings(name)]]
    return [Level(args.xc, basis, level, args.dispersion, ("--xc", args.xc, "--dispersion", args.dispersion, "--basis",
                                                           basis, "--grid-level", str(level)))
            for basis in args.bases.split(",") for level in (int(v) for v in args.levels.split(","))]  # fmt: skip


def ours(xyz: Path, out: Path, cache: Path, level: Level, jk: str, batch: int, budget_gb: float
         ) -> tuple[float, float]:  # fmt: skip
    """(the generator's own seconds, the process's peak resident bytes) of one ``qm1b generate`` process."""
    command = [sys.executable, "-m", "qm1b.cli", "generate", "--geometries", str(xyz), "--out", str(out),
               *level.options, "--jk", jk, "--batch-size", str(batch),
               "--no-progress", "--memory-budget", str(budget_gb)]  # fmt: skip
    script = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
              "sys.stderr.write(p.stderr); print(p.stdout); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
              "sys.exit(p.returncode)")  # fmt: skip
    env = {**os.environ, "PYSCF_IPU_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", script, *command], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"qm1b generate failed: {done.stderr.strip().splitlines()[-1:]}")
    return float(SUMMARY.search(done.stdout).group(1)), 1024.0 * int(done.stdout.split()[-1])


def pyscf_timed(molecule, config: RKSConfig) -> tuple[float, dict]:
    """(seconds, labels in eV) of one PySCF run from scratch (:func:`throughput.pyscf_labels`)."""
    t = time.perf_counter()
    labels = pyscf_labels(molecule, config)
    return time.perf_counter() - t, labels


def pyscf_process(xyz: Path, config: RKSConfig) -> tuple[list[tuple[float, dict]], float]:
    """(:func:`pyscf_timed` of every frame of ``xyz``, the peak resident bytes), in a new process, as a
    user's PySCF script runs (in this long-lived process PySCF ran up to 1.25 times slower)."""
    done = subprocess.run([sys.executable, __file__, "--pyscf-frames", str(xyz), json.dumps(dataclasses.asdict(config))],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"PySCF failed: {done.stderr.strip().splitlines()[-1:]}")
    out = json.loads(done.stdout.splitlines()[-1])
    return [tuple(row) for row in out["runs"]], out["peak"]


def pyscf_frames(xyz: str, config: str) -> None:
    """The worker of :func:`pyscf_process`: prints {"runs": [[seconds, labels], ...], "peak": bytes}."""
    fields = json.loads(config)
    fields["ipu"] = IPUConfig(**fields["ipu"])
    config = RKSConfig(**fields)
    runs = [pyscf_timed(frame.molecule(), config) for frame in read_frames(xyz)]
    print(json.dumps({"runs": runs, "peak": 1024.0 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def largest_difference(a: list[dict], b: list[dict]) -> float:
    """meV: the largest |a - b| over the labels and conformers (nan where a side was skipped)."""
    return float(np.max([1000 * abs(x[q] - y[q]) for x, y in zip(a, b) for q in LABELS]))


def exponent(aos: list[int], seconds: list[float]) -> float:
    """p of the least-squares fit seconds ~ AOs^p on a log-log scale, over the measured sizes."""
    aos, seconds = np.asarray(aos, float), np.asarray(seconds, float)
    kept = np.isfinite(seconds)
    return float(np.polyfit(np.log(aos[kept]), np.log(seconds[kept]), 1)[0]) if kept.sum() > 1 else float("nan")


def plot(rows: list[dict], path: str) -> None:
    """Seconds per conformer against AOs, log-log, per level of theory: ours restarted and the faster PySCF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for theory, color in zip(dict.fromkeys(r["theory"] for r in rows), ("C0", "C1", "C2", "C3", "C4", "C5")):
        group = [r for r in rows if r["theory"] == theory]
        aos = [r["aos"] for r in group]
        for key, style, who in (("restarted", "-o", "ours"), ("pyscf", "--s", "PySCF (faster)")):
            seconds = [r[key] for r in group]
            p = exponent(aos, seconds)
            ax.loglog(aos, seconds, style, color=color, label=f"{who}, {theory}: N^{p:.2f}")
    ax.set_xlabel("AOs (N)")
    ax.set_ylabel("seconds per conformer")
    ax.set_title("Cost growth: qm1b generate (restarted) against PySCF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if sys.argv[1:2] == ["--pyscf-frames"]:
        return pyscf_frames(*sys.argv[2:4])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bases", default="6-31g*,def2-svp")
    parser.add_argument("--levels", default="0")
    parser.add_argument("--xc", default=XC, help="both sides' functional with --bases (default: the generator's)")
    parser.add_argument("--dispersion", default="auto", help="both sides' dispersion with --bases (default: the "
                                                             "functional's own)")  # fmt: skip
    parser.add_argument("--presets", default="", help=f"of {', '.join(PRESETS)}: run these levels of theory instead of "
                                                      "--bases and --levels")  # fmt: skip
    parser.add_argument("--conformers", type=int, default=2)
    parser.add_argument("--molecules", default=",".join(MOLECULES), help=f"of {', '.join(MOLECULES)}")
    parser.add_argument("--jk", default="df", help="our J-K backend")
    parser.add_argument("--batch-size", default="1",
                        help="our batches hold at most this many conformers (on a CPU, one is the fastest per "
                             "conformer at these sizes), fewer where the memory budget needs; auto: the generator's "
                             "own choice")
    parser.add_argument("--memory-budget", type=float, default=8.0, metavar="GB",
                        help="our runs' memory budget: each molecule's conformers go in the largest batch up to "
                             "--batch-size that fits")
    parser.add_argument("--direct-limit", type=int, default=10**9, metavar="AOS",
                        help="skip PySCF direct above this many AOs (where it is already several times slower than "
                             "its density fitting: it grows as N^4)")
    parser.add_argument("--plot", default="cost_growth.png", metavar="FILE.png")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    work = Path(tempfile.mkdtemp(prefix="cost-growth-"))
    seed = GenerateConfig().seed
    print(f"float32 ours (--jk {args.jk}), {args.conformers} conformers per molecule; "
          f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']} OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    header = (f"{'xc':7s} {'basis':12s} {'lvl':>3s} {'molecule':12s} {'heavy':>5s} {'AOs':>4s} | {'batch':>5s} "
              f"{'cold':>6s} {'restart':>7s} "
              f"{'peak GB':>7s} | {'direct':>7s} {'DF':>6s} {'peak GB':>7s} | {'x faster':>8s} | "
              f"{'ours-DF':>7s} {'DF-direct':>9s} {'ours-direct':>11s} meV")  # fmt: skip
    print(header, flush=True)
    rows = []
    for theory in levels(args):
        basis, level = theory.basis, theory.grid_level
        for name in args.molecules.split(","):  # seeds by the molecule's place in MOLECULES: any subset alike
            conformers = embed_conformers(MOLECULES[name], args.conformers, seed, list(MOLECULES).index(name))
            tag = f"{theory.xc}-{basis}-{level}-{name}".translate(str.maketrans("*(,)", "s___"))
            xyz = write_xyz(work / f"{tag}.xyz", conformers)
            cache = work / f"cache-{tag}"
            ran = RKSConfig(**{**GENERATOR_DFT_DEFAULTS, "basis": basis, "xc": theory.xc, "grid_level": level,
                               "dispersion": theory.dispersion, "jk": args.jk})  # fmt: skip
            method = resolve(ran, args.memory_budget)
            bucket = method.bucket(conformers[0])
            most = min(method.backend.cpu_batch(bucket) if args.batch_size == "auto" else int(args.batch_size),
                       len(conformers))  # fmt: skip
            # largest_batch's 0 (one at a time, or refused) runs as 1: the generator then refuses in one line
            batch = max(1, largest_batch(bucket, method, most, args.memory_budget))
            cold, cold_peak = ours(xyz, work / f"cold-{tag}", cache, theory, args.jk, batch, args.memory_budget)
            restarted, peak = ours(xyz, work / f"restarted-{tag}", cache, theory, args.jk, batch, args.memory_budget)
            with open_dataset(work / f"restarted-{tag}") as ds:
                columns = ds.arrays().columns
                order = np.argsort(columns["conformer_id"])
                labels = [{q: float(columns[q][i]) for q in LABELS} for i in order]
            aos = build_mole(conformers[0], basis).nao
            exact = ran.replace(jk="dense")  # PySCF direct: not density fitted
            fitted, fitted_peak = pyscf_process(xyz, ran.replace(jk="df"))
            direct, direct_peak = (pyscf_process(xyz, exact) if aos <= args.direct_limit
                                   else ([(float("nan"), {q: float("nan") for q in LABELS})] * len(conformers), 0.0))
            pyscf_peak = max(fitted_peak, direct_peak)
            n = len(conformers)
            suffix = "" if ran.dispersion == OWN_DISPERSION.get(theory.xc, "none") else f"-{ran.dispersion}"
            row = {
                "theory": f"{theory.xc}{suffix}/{basis} level {level}", "basis": basis, "level": level,
                "molecule": name, "aos": aos, "batch": batch,
                "heavy": sum(s != "H" for s in conformers[0].symbols), "cold": cold / n, "restarted": restarted / n,
                "peak": max(cold_peak, peak), "direct": np.mean([s for s, _ in direct]),
                "fitted": np.mean([s for s, _ in fitted]), "pyscf_peak": pyscf_peak,
                "ours_vs_df": largest_difference(labels, [l for _, l in fitted]),
                "df_vs_direct": largest_difference([l for _, l in fitted], [l for _, l in direct]),
                "ours_vs_direct": largest_difference(labels, [l for _, l in direct]),
            }  # fmt: skip
            row["pyscf"] = np.nanmin([row["direct"], row["fitted"]])
            rows.append(row)
            print(f"{theory.xc:7s} {basis:12s} {level:3d} {name:12s} {row['heavy']:5d} {row['aos']:4d} | {batch:5d} "
                  f"{row['cold']:6.1f} {row['restarted']:7.2f} {row['peak'] / 1e9:7.1f} | {row['direct']:7.2f} "
                  f"{row['fitted']:6.2f} "
                  f"{pyscf_peak / 1e9:7.1f} | {row['pyscf'] / row['restarted']:8.2f} | {row['ours_vs_df']:7.3f} "
                  f"{row['df_vs_direct']:9.3f} {row['ours_vs_direct']:11.3f}", flush=True)  # fmt: skip
            shutil.rmtree(cache, ignore_errors=True)
    print("\nfitted exponents (seconds per conformer ~ AOs^p):")
    for theory in dict.fromkeys(r["theory"] for r in rows):
        group = [r for r in rows if r["theory"] == theory]
        if len(group) > 1:
            aos = [r["aos"] for r in group]
            print(f"  {theory}: ours (restarted) {exponent(aos, [r['restarted'] for r in group]):.2f}, "
                  f"PySCF direct {exponent(aos, [r['direct'] for r in group]):.2f}, "
                  f"PySCF DF {exponent(aos, [r['fitted'] for r in group]):.2f}")  # fmt: skip
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
