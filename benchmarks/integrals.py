"""ERI speed, side by side: our device ERIs (JAX, float32, 8 conformers as one batch) against libcint.

    python benchmarks/integrals.py [--molecules 3] [--conformers 8] [--windows 3] [--basis sto-3g]

For each of the first ``--molecules`` 9-heavy-atom molecules of the built-in sample, ``--conformers``
RDKit conformers (the generator's seeds) are labelled with the full s8 ERI array:

- **ours**: :func:`pyscf_ipu.integrals.eri.eri_s8` on all conformers at once (float32, one
  compiled batch per molecule; the plan is built once per molecule, before the clock starts);
- **libcint**: ``mol.intor("int2e", aosym="s8")`` per conformer, float64, PySCF's defaults.

Threads: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2 (libcint's OpenMP uses both cores), set before
numpy is imported; ours deals its tiles out to one worker thread per core (``eri_s8``'s default).
Windows alternate ours, libcint, ours, ... after a warm-up that compiles; times are medians over
the windows with [min-max], the ratio the median of the per-window ratios (> 1: ours faster). The
largest |ours - libcint| over every ERI of every conformer is printed too (float32 against float64).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import median_range  # noqa: E402

from pyscf_ipu.pyscf_mole import build_mole  # noqa: E402
from pyscf_ipu.integrals.eri import default_workers, eri_s8
from pyscf_ipu.integrals.eri_plan import plan_eri  # noqa: E402
from qm1b.conformers import embed_conformers  # noqa: E402
from qm1b.generate import GenerateConfig  # noqa: E402
from qm1b.inputs import builtin_sample, heavy_atom_count  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--molecules", type=int, default=3)
    parser.add_argument("--conformers", type=int, default=8)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--basis", default="sto-3g")
    args = parser.parse_args()

    seed = GenerateConfig.__dataclass_fields__["seed"].default
    chosen = [m for m in builtin_sample() if heavy_atom_count(m.smiles) == 9][: args.molecules]
    print(f"{len(chosen)} molecules x {args.conformers} conformers, {args.basis}; threads: OPENBLAS_NUM_THREADS="
          f"{os.environ['OPENBLAS_NUM_THREADS']} OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; ours: {default_workers()} worker threads\n")  # fmt: skip
    print(f"{'molecule':28s} {'AOs':>4s} {'ERIs':>10s} {'compile s':>9s} | {'ours ms/conformer':>22s} | "
          f"{'libcint ms/conformer':>22s} | {'ratio':>5s} | max |d|")  # fmt: skip
    totals = {"ours": [0.0] * args.windows, "libcint": [0.0] * args.windows}
    for k, entry in enumerate(chosen):
        conformers = embed_conformers(entry.smiles, args.conformers, seed, k)
        mols = [build_mole(c, args.basis) for c in conformers]
        coords = np.stack([m.atom_coords() for m in mols])  # (C, natm, 3) Bohr
        plan = plan_eri(mols[0])
        t = time.perf_counter()
        ours = np.asarray(eri_s8(plan, coords, jnp.float32))  # compiles
        compile_s = time.perf_counter() - t
        worst = max(float(np.abs(ours[c] - m.intor("int2e", aosym="s8")).max()) for c, m in enumerate(mols))
        times = {"ours": [], "libcint": []}
        for w in range(args.windows):
            t = time.perf_counter()
            eri_s8(plan, coords, jnp.float32).block_until_ready()
            times["ours"].append((time.perf_counter() - t) / len(mols))
            t = time.perf_counter()
            for m in mols:
                m.intor("int2e", aosym="s8")
            times["libcint"].append((time.perf_counter() - t) / len(mols))
            for side in totals:
                totals[side][w] += times[side][w]
        ratio = statistics.median(b / a for a, b in zip(times["ours"], times["libcint"]))
        ms = {side: median_range([1e3 * x for x in v], ".0f") for side, v in times.items()}
        print(f"{entry.smiles[:28]:28s} {plan.nao:4d} {plan.size:10,d} {compile_s:9.1f} | {ms['ours']:>22s} | "
              f"{ms['libcint']:>22s} | {ratio:5.2f} | {worst:.1e}")  # fmt: skip
    ratio = statistics.median(b / a for a, b in zip(totals["ours"], totals["libcint"]))
    print(f"\nall molecules: ratio libcint/ours time (median of {args.windows} windows) {ratio:.2f}; > 1: ours faster")


if __name__ == "__main__":
    main()
