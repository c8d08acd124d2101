"""Which integrals should the generator default to? libcint against JAX, side by side,
over many distinct molecules: the figure that counts for a run over a SMILES file, where every new
molecule may need compiled code of its own.

    python benchmarks/generator_cold.py [--molecules 16] [--conformers 8] [--rounds 1]

Each side is ``qm1b generate`` over the first ``--molecules`` molecules of the built-in sample
(9-11 heavy atoms, ``--conformers`` each, the generator's defaults otherwise: B3LYP/STO-3G, grid
level 0, float32), in a process of its own:

- **cold**: with an empty persistent compilation cache: everything compiles (the SCF loops on both
  sides; the ERI and one-electron programs on the JAX side, shared by molecules whose bucketed
  shapes agree, see :mod:`pyscf_ipu.integrals.eri`);
- **restarted**: the same run again in a new process with the cache the cold run filled.

The sides alternate (libcint, jax, libcint, jax per round). Threads: OPENBLAS_NUM_THREADS=1
OMP_NUM_THREADS=2 for both (the generator's PySCF preparation), XLA's default. Conformers per hour
are whole-process wall times, imports included; the ratio is JAX over libcint (> 1: JAX faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import median_range


def run(side: str, work: Path, cache: Path, args) -> float:
    """Seconds of one ``qm1b generate`` process with ``--integrals side`` and the cache in ``cache``."""
    out = Path(tempfile.mkdtemp(prefix=f"{side}-", dir=work))
    command = [sys.executable, "-m", "qm1b.cli", "generate", "--out", str(out), "--limit", str(args.molecules),
               "--conformers", str(args.conformers), "--integrals", side, "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYSCF_IPU_CACHE": str(cache), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "2"}
    t = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--molecules", type=int, default=16)
    parser.add_argument("--conformers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="cold + restarted runs per side")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qm1b-cold-"))
    count = args.molecules * args.conformers
    print(f"qm1b generate over {args.molecules} molecules x {args.conformers} conformers of the built-in sample; "
          f"B3LYP/STO-3G, grid level 0, float32; OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2, XLA default\n")  # fmt: skip
    rates: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for side in ("libcint", "jax"):
            cache = work / f"cache-{side}-{r}"  # new and empty: the first run compiles everything
            for window in ("cold", "restarted"):
                load = os.getloadavg()[0]
                seconds = run(side, work, cache, args)
                rate = 3600 * count / seconds
                rates.setdefault((side, window), []).append(rate)
                print(f"  round {r}: {side:6s} {window:9s} {seconds:7.1f} s  {rate:8,.0f} conformers/hour  (load {load:.1f})",
                      flush=True)  # fmt: skip
    print(f"\n{'':18s} {'libcint':>24s} {'jax':>24s} {'jax/libcint':>12s}")
    for window in ("cold", "restarted"):
        libcint, jax = rates[("libcint", window)], rates[("jax", window)]
        ratio = statistics.median(j / c for j, c in zip(jax, libcint))
        print(f"{window:18s} {median_range(libcint, ',.0f', 8):>24s} {median_range(jax, ',.0f', 8):>24s} {ratio:12.2f}")


if __name__ == "__main__":
    main()
