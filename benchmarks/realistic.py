"""The generator as users run it: `qm1b generate` in a fresh process over distinct molecules, against
a plain PySCF loop over the very same conformers.

    python benchmarks/realistic.py [--molecules 16] [--conformers 8] [--rounds 2] [--growth 25,50,100]
                                   [--xc wb97x --basis 6-31g*]

Each round runs, in this order:

- **cold**: ``qm1b generate`` over the first ``--molecules`` molecules of the built-in sample with
  its default settings (B3LYP with VWN5/STO-3G, grid level 0, float32; ``--integrals``, ``--xc`` and
  ``--basis`` override), in a new process with an empty compilation cache and program directory;
- **restarted**: the same command again in a new process, with the cache the cold run filled;
- **PySCF**: ``dft.RKS(mol, xc)`` with ``grids.level = 0`` and its default convergence, float64,
  over the same conformers (embedded with the generator's seeds before the clock starts).

Threads: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2 everywhere (PySCF's best here); XLA's default.
Two figures per run of ours: the whole process's wall time, and the generator's own time as it
reports it (from the start of ``run_shard``: the interpreter's start and the imports subtracted).
Conformers per hour are medians over the rounds with [min-max]; ratios are medians of per-round
ratios. Label differences are ours (the last restarted run) minus PySCF, in meV, with the
generator's functional.

Program counts: the stored programs (``pyscf_ipu.programs``) after runs over the first 25, 50 and
100 molecules (``--growth``; one conformer each, the same batch size, resumed into one output
directory), beside the size buckets those molecules span: programs <= buckets x stages.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

from common import SUMMARY, median_range, print_label_differences  # noqa: E402
from throughput import LABELS, pyscf_labels  # noqa: E402

from pyscf_ipu.config import RKSConfig  # noqa: E402
from pyscf_ipu.resolution import resolve  # noqa: E402
from qm1b.conformers import embed_conformers  # noqa: E402
from qm1b.generate import GENERATOR_DFT_DEFAULTS, GenerateConfig  # noqa: E402
from qm1b.inputs import builtin_sample  # noqa: E402
from qm1b.presets import PRESETS, preset_settings  # noqa: E402
from qm1b.store import open_dataset  # noqa: E402



def generate(out: Path, cache: Path, molecules: int, conformers: int, options: list[str],
             resume: bool = False) -> tuple[float, float]:  # fmt: skip
    """(whole-process seconds, the generator's own seconds) of one ``qm1b generate`` process with
    ``options`` beside its defaults."""
    command = [sys.executable, "-m", "qm1b.cli", "generate", "--out", str(out), "--limit", str(molecules),
               "--conformers", str(conformers), "--no-progress"] + (["--resume"] if resume else [])  # fmt: skip
    command += options
    env = {**os.environ, "PYSCF_IPU_CACHE": str(cache)}
    t = time.perf_counter()
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t
    return wall, float(SUMMARY.search(done.stdout).group(1))


def programs(cache: Path) -> Counter:
    """Stored programs by stage (the file name's prefix)."""
    return Counter(p.name.rsplit("-", 1)[0] for p in (cache / "jax-programs").glob("*.program"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--molecules", type=int, default=16)
    parser.add_argument("--conformers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--growth", default="25,50,100", help="molecule counts for the program counts ('' skips)")
    parser.add_argument("--integrals", choices=("libcint", "jax", "auto"), help="our side's integrals (default: the generator's)")
    parser.add_argument("--xc", help="both sides' functional (default: the generator's)")
    parser.add_argument("--basis", help="both sides' basis (default: the generator's)")
    parser.add_argument("--preset", choices=tuple(PRESETS), help="both sides' level of theory (--xc and --basis win)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    work = Path(tempfile.mkdtemp(prefix="qm1b-realistic-"))
    given = {k: v for k, v in (("integrals", args.integrals), ("xc", args.xc), ("basis", args.basis)) if v}
    options = [part for k, v in given.items() for part in (f"--{k}", v)]
    options += ["--preset", args.preset] if args.preset else []
    dft = RKSConfig(**{**GENERATOR_DFT_DEFAULTS, **preset_settings(args.preset), **given})
    chosen = builtin_sample()[: args.molecules]
    gen = GenerateConfig()
    conformers = [c for m in chosen for c in embed_conformers(m.smiles, args.conformers, gen.seed, m.molecule_id)]
    count = len(conformers)
    method = resolve(dft)
    buckets = {gen.source.bucket(m, method) for m in chosen}
    print(f"qm1b generate over {args.molecules} molecules x {args.conformers} conformers of the built-in sample "
          f"({len(buckets)} size buckets); defaults: {dft.xc}/{dft.basis}, grid level {dft.grid_level}, "
          f"{dft.precision}, {dft.integrals} integrals; OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']} "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, XLA default\n")  # fmt: skip

    rates: dict[str, list[float]] = {}
    last = None
    for r in range(args.rounds):
        cache = work / f"cache-{r}"
        for window in ("cold", "restarted"):
            out = work / f"{window}-{r}"
            load = os.getloadavg()[0]
            wall, own = generate(out, cache, args.molecules, args.conformers, options)
            rates.setdefault(f"{window} (process)", []).append(3600 * count / wall)
            rates.setdefault(f"{window} (imports subtracted)", []).append(3600 * count / own)
            print(f"  round {r}: {window:9s} {wall:6.1f} s process, {own:6.1f} s generator  (load {load:.1f})", flush=True)
            last = out
        load = os.getloadavg()[0]
        t = time.perf_counter()
        reference = [pyscf_labels(m, dft) for m in conformers]
        seconds = time.perf_counter() - t
        rates.setdefault("PySCF", []).append(3600 * count / seconds)
        print(f"  round {r}: PySCF     {seconds:6.1f} s  (load {load:.1f})", flush=True)

    print(f"\n{'':34s} {'conformers per hour':>26s} {'x PySCF':>8s}")
    for name, values in rates.items():
        ratio = statistics.median(v / p for v, p in zip(values, rates["PySCF"]))
        print(f"{name:34s} {median_range(values, ',.0f', 9):>26s} {ratio:8.2f}")

    with open_dataset(last) as ds:
        print_label_differences(ds.arrays().columns, reference, LABELS)
    print(f"\nprograms after the {args.molecules}-molecule runs: {sum(programs(work / 'cache-0').values())} "
          f"({dict(programs(work / 'cache-0'))})")  # fmt: skip

    if args.growth:
        cache, out = work / "cache-growth", work / "growth"
        sample = builtin_sample()
        print("\nprogram growth (one conformer per molecule, resumed into one directory):")
        print(f"  {'molecules':>9s} {'buckets':>8s} {'stages':>7s} {'programs':>9s} {'bound':>6s}")
        for n in (int(x) for x in args.growth.split(",")):
            generate(out, cache, n, 1, options, resume=out.exists())
            spanned = len({gen.source.bucket(m, method) for m in sample[:n]})
            stages = programs(cache)
            print(f"  {n:9d} {spanned:8d} {len(stages):7d} {sum(stages.values()):9d} {spanned * len(stages):6d}",
                  flush=True)  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
