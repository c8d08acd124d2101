"""The generator's in-process steady state of two source trees, side by side, window by window.

    python benchmarks/steady_state.py --against DIR [--rounds 16] [--molecules 3] [--conformers 8]
                                      [--integrals jax] [--xc b3lyp5]

``DIR`` is another checkout of this repository (``git worktree add /tmp/old REV``). One worker
process runs on each tree (``PYTHONPATH`` picks it), both alive at once, and they take turns: each
window is one call of the generator's :func:`qm1b.generate.run_shard` over the same conformers
(the first ``--molecules`` 9-heavy-atom molecules of the built-in sample, ``--conformers`` each)
into a fresh output directory, while the other worker waits. Each worker's first window loads or
compiles its programs and is left out; then ``--rounds`` rounds of one window each, in the order
this tree, the other; the other, this tree; and so on. Each worker is set up as its tree's
``qm1b generate`` sets up its own process.

Both sides label the same conformers with the same settings (``--integrals``, ``--xc``; STO-3G,
grid level 0, float32), and nothing else runs in between. The machine's speed drifts over minutes,
so only neighbouring windows compare: printed per round (the two windows' seconds, CPU seconds and
page faults) and as the median of the rounds' ratios. The first window of a round tends to be the
slower one, so the ratios of a round and the next, each side first once, are also combined (their
geometric mean) and their median printed: that is the figure to quote. The geometric mean of all
rounds follows with a 95% interval, which treats the rounds as independent. Threads:
OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2, XLA's default.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
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
    """One side: a generator window over the same conformers for each ``go`` line on stdin, one JSON
    line on stdout for each (wall and CPU seconds, minor page faults, conformers); ends at end of input."""
    try:
        from pyscf_ipu.runtime import reuse_freed_memory
    except ImportError:  # a tree from before the runtime module
        try:
            from pyscf_ipu.config import reuse_freed_memory
        except ImportError:  # a tree from before it: its generator ran without
            reuse_freed_memory = None
    if reuse_freed_memory is not None:
        reuse_freed_memory()  # first, as the tree's `qm1b generate` does
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
    for window, _ in enumerate(sys.stdin):
        wall, cpu, faults = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        gen = GenerateConfig(smiles=str(smiles), out=str(work / f"w{window}"), conformers=args.conformers,
                             progress=False)  # fmt: skip
        # a tree before the settings were resolved once takes the two configs (--against)
        summary = run_shard(gen.resolved(dft)) if hasattr(gen, "resolved") else run_shard(gen, dft)
        print(json.dumps({"conformers": summary.conformers, "wall": time.perf_counter() - wall,
                          "cpu": time.process_time() - cpu,
                          "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                          "package": str(Path(pyscf_ipu.__file__).parent)}), flush=True)  # fmt: skip


class Side:
    """A worker process on ``tree``'s packages, with ``cache`` as its compilation cache."""

    def __init__(self, name: str, tree: Path, cache: Path, args: argparse.Namespace):
        self.name, self.tree = name, tree
        env = {**os.environ, "PYTHONPATH": str(tree), "PYSCF_IPU_CACHE": str(cache)}
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--molecules", str(args.molecules),
                   "--conformers", str(args.conformers), "--integrals", args.integrals, "--xc", args.xc]  # fmt: skip
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(command, env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, text=True)  # fmt: skip

    def window(self) -> dict:
        """Run one window and return its JSON record."""
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            self.log.seek(0)
            raise SystemExit(f"steady_state: the worker on {self.tree} failed:\n{self.log.read()[-2000:]}")
        out = json.loads(line)
        if Path(out["package"]).resolve() != (self.tree / "pyscf_ipu").resolve():
            raise SystemExit(f"steady_state: the worker imported {out['package']}, not {self.tree}'s package")
        return out

    def close(self) -> None:
        """End the worker (end of its input) and wait for it."""
        self.process.stdin.close()
        self.process.wait()
        self.log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", type=Path, help="the other source tree (a checkout of this repository)")
    parser.add_argument("--rounds", type=int, default=16, help="timed windows per side, after one that loads")
    parser.add_argument("--molecules", type=int, default=3)
    parser.add_argument("--conformers", type=int, default=8)
    parser.add_argument("--integrals", choices=("libcint", "jax", "auto"), default="auto")
    parser.add_argument("--xc", default="b3lyp5")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.against is None or not (args.against / "pyscf_ipu").is_dir():
        parser.error("--against must name another checkout of this repository (with a pyscf_ipu folder)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    caches = Path(tempfile.mkdtemp(prefix="qm1b-steady-caches-"))
    trees = {"this tree": REPOSITORY, "against": args.against.resolve()}
    print(f"this tree: {REPOSITORY}\nagainst:   {trees['against']}")
    print(f"{args.molecules} molecules x {args.conformers} conformers per window, {args.rounds} rounds; "
          f"integrals {args.integrals}, {args.xc}/STO-3G, grid level 0\n")  # fmt: skip
    sides = [Side(name, tree, caches / name.replace(" ", "-"), args) for name, tree in trees.items()]
    try:
        for side in sides:
            side.window()  # loads or compiles the programs: left out
        print(f"{'round':>5s} {'first':10s} {'this tree s':>11s} {'CPU s':>6s} {'against s':>9s} {'CPU s':>6s} "
              f"{'load':>5s} {'ratio':>6s} {'page faults (this tree, against)':>33s}")  # fmt: skip
        ratios, walls = [], {side.name: [] for side in sides}
        for r in range(1, args.rounds + 1):
            load = os.getloadavg()[0]
            order = sides if r % 2 else sides[::-1]
            out = {side.name: side.window() for side in order}
            mine, theirs = out["this tree"], out["against"]
            for name in walls:
                walls[name].append(out[name]["wall"])
            # throughput ratio: the same conformers on both sides
            ratios.append((theirs["wall"] / theirs["conformers"]) / (mine["wall"] / mine["conformers"]))
            print(f"{r:5d} {order[0].name:10s} {mine['wall']:11.2f} {mine['cpu']:6.2f} {theirs['wall']:9.2f} "
                  f"{theirs['cpu']:6.2f} {load:5.2f} {ratios[-1]:6.3f} {mine['faults']:16,d} {theirs['faults']:16,d}",
                  flush=True)  # fmt: skip
    finally:
        for side in sides:
            side.close()
        shutil.rmtree(caches, ignore_errors=True)
    print("\nwindows, median [min-max] s: " + "; ".join(
        f"{name} {statistics.median(w):.2f} [{min(w):.2f}-{max(w):.2f}]" for name, w in walls.items()))
    # the first window of a round tends to be the slower: pairs of rounds, each side first once, cancel that
    blocks = [(a * b) ** 0.5 for a, b in zip(ratios[0::2], ratios[1::2])]
    print(f"ratios (this tree / against, throughput) {', '.join(f'{r:.2f}' for r in ratios)}; median "
          f"{statistics.median(ratios):.3f}, {sum(r >= 1 for r in ratios)} of {len(ratios)} at least 1")
    logs = [math.log(r) for r in ratios]
    spread = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    mean = statistics.mean(logs)
    print(f"geometric mean of the rounds {math.exp(mean):.3f}, 95% interval "
          f"[{math.exp(mean - spread):.3f}, {math.exp(mean + spread):.3f}] (rounds taken as independent)")
    if blocks:
        print(f"pairs of rounds (geometric means) {', '.join(f'{b:.2f}' for b in blocks)}; median "
              f"{statistics.median(blocks):.3f}, {sum(b >= 1 for b in blocks)} of {len(blocks)} at least 1")

if __name__ == "__main__":
    main()
