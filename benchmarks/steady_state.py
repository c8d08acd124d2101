"""The generator's in-process steady state of two source trees, side by side.

    python benchmarks/steady_state.py --against DIR [--pairs 3] [--windows 6] [--molecules 3]
                                      [--conformers 8] [--integrals device] [--xc b3lyp5]

``DIR`` is another checkout of this repository (``git worktree add /tmp/old REV``). Each pair runs
one process on this tree, then one on ``DIR`` (``PYTHONPATH`` picks the tree); each process calls
the generator's :func:`qm1b.generate.run_shard` ``--windows`` times over the same conformers (the
first ``--molecules`` 9-heavy-atom molecules of the built-in sample, ``--conformers`` each), every
window into a fresh output directory. The first window of a process loads or compiles its programs
and is left out; the others are its warm windows. Each side keeps its own compilation cache across
its processes, so only its first process compiles.

Both sides label the same conformers with the same settings (``--integrals``, ``--xc``; STO-3G,
grid level 0, float32). Nothing else runs in between: unlike ``throughput.py``, no PySCF window
interrupts ours, so two trees' warm throughput compares directly. The machine's speed drifts, so
only the pairs' ratios compare: printed per pair (the median of each process's warm windows) and
as their median. Threads: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2, XLA's default.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parent


def worker(args: argparse.Namespace) -> None:
    """One process: ``--windows`` generator runs over the same conformers; prints one JSON line."""
    warnings.simplefilter("ignore", UserWarning)
    import pyscf_ipu
    from pyscf_ipu.config import RKSConfig
    from qm1b.generate import GenerateConfig, run_shard
    from qm1b.inputs import builtin_sample, heavy_atom_count

    work = Path(tempfile.mkdtemp(prefix="qm1b-steady-"))
    chosen = [m for m in builtin_sample() if heavy_atom_count(m.smiles) == 9][: args.molecules]
    smiles = work / "molecules.smi"
    smiles.write_text("".join(f"{m.smiles} {m.name}\n" for m in chosen))
    dft = RKSConfig(integrals=args.integrals, xc=args.xc)
    walls, cpus = [], []
    for window in range(args.windows):
        wall, cpu = time.perf_counter(), time.process_time()
        summary = run_shard(GenerateConfig(smiles=str(smiles), out=str(work / f"w{window}"),
                                           conformers=args.conformers, progress=False), dft)  # fmt: skip
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    print(json.dumps({"conformers": summary.conformers, "wall": walls, "cpu": cpus,
                      "package": str(Path(pyscf_ipu.__file__).parent)}))  # fmt: skip


def run_side(tree: Path, cache: Path, args: argparse.Namespace) -> dict:
    """One worker process on ``tree``'s packages, with ``cache`` as its compilation cache."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYSCF_IPU_CACHE": str(cache)}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--windows", str(args.windows),
               "--molecules", str(args.molecules), "--conformers", str(args.conformers),
               "--integrals", args.integrals, "--xc", args.xc]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"steady_state: the worker on {tree} failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(out["package"]).resolve() != (tree / "pyscf_ipu").resolve():
        raise SystemExit(f"steady_state: the worker imported {out['package']}, not {tree}'s package")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", type=Path, help="the other source tree (a checkout of this repository)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--windows", type=int, default=6, help="generator runs per process; the first is left out")
    parser.add_argument("--molecules", type=int, default=3)
    parser.add_argument("--conformers", type=int, default=8)
    parser.add_argument("--integrals", choices=("host", "device"), default="device")
    parser.add_argument("--xc", default="b3lyp5")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.against is None or not (args.against / "pyscf_ipu").is_dir():
        parser.error("--against must name another checkout of this repository (with a pyscf_ipu folder)")
    if args.windows < 2:
        parser.error("--windows must be at least 2: the first window of each process is left out")

    caches = Path(tempfile.mkdtemp(prefix="qm1b-steady-caches-"))
    sides = {"this tree": REPOSITORY, "against": args.against.resolve()}
    print(f"this tree: {REPOSITORY}\nagainst:   {sides['against']}")
    print(f"{args.molecules} molecules x {args.conformers} conformers per window, {args.windows - 1} warm "
          f"windows per process; integrals {args.integrals}, {args.xc}/STO-3G, grid level 0\n")  # fmt: skip
    print(f"{'pair':>4s} {'side':10s} {'load':>5s} {'warm s (median [min-max])':>28s} {'CPU s':>6s} {'conformers/h':>12s}")
    ratios = []
    for pair in range(1, args.pairs + 1):
        rate = {}
        for name, tree in sides.items():
            load = os.getloadavg()[0]
            out = run_side(tree, caches / name.replace(" ", "-"), args)
            warm, cpu = out["wall"][1:], out["cpu"][1:]
            rate[name] = 3600 * out["conformers"] / statistics.median(warm)
            spread = f"{statistics.median(warm):.2f} [{min(warm):.2f}-{max(warm):.2f}]"
            print(f"{pair:4d} {name:10s} {load:5.2f} {spread:>28s} {statistics.median(cpu):6.2f} {rate[name]:12,.0f}", flush=True)
        ratios.append(rate["this tree"] / rate["against"])
        print(f"{'':4s} ratio (this tree / against): {ratios[-1]:.3f}", flush=True)
    print(f"\nper-pair ratios {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
