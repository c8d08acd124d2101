"""Wall time of one J-K build per backend and tile strategy, side by side, float32 on this CPU.

    python benchmarks/jk_backends.py [--repeats 7] [--skip-dense-above 200]

Molecules: benzene/STO-3G (N=36), QM9 22040/STO-3G (N=56), paracetamol/STO-3G (N=64) and QM9
22076/6-31G* (N=150). The density is the initial guess (a superposition of atomic densities).
Each backend's contraction is jitted and run once to compile; then the backends are timed round-robin (A B C ... A B C ...) and the median
with [min, max] is printed. XLA uses its default CPU thread pool; PySCF is not involved in the
timing. Preparation (host layout + transfer) is printed separately: it happens once per molecule.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.resolution import resolve
from pyscf_ipu.prepare import prepare
from pyscf_ipu.ipu import IPUJK, ipu_model
from pyscf_ipu.molecule import from_name
from pyscf_ipu.packed import batch_eris
from pyscf_ipu.qm9 import qm9_molecules

CASES = [
    ("benzene", "sto-3g"),
    ("qm9:22040", "sto-3g"),
    ("paracetamol", "sto-3g"),
    ("qm9:22076", "6-31g*"),
]


def backends(nao: int, skip_dense_above: int) -> dict:
    out = {} if nao > skip_dense_above else {"dense": resolve(RKSConfig(jk="dense")).backend}
    out["s8"] = resolve(RKSConfig(jk="s8")).backend
    # enough IPUs for the largest case; the planner uses as few as fit
    model = ipu_model("bow", num_ipus=16)
    for strategy in ("auto", "rows", "s8"):
        out[f"ipu-{strategy}"] = IPUJK(model, strategy)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-dense-above", type=int, default=200, help="dense needs 2 N^4 floats")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    qm9 = {f"qm9:{r.index}": r.molecule for r in qm9_molecules([22040, 22076])}
    print(f"one J-K build, float32, XLA default threads, {args.repeats} round-robin repeats; "
          f"load {os.getloadavg()[0]:.1f}\n")  # fmt: skip
    print(f"{'molecule':12s} {'basis':7s} {'N':>4s} | {'backend':10s} {'plan':>22s} | {'prepare s':>9s} | "
          f"{'J-K build ms: median [min-max]':>32s} | {'vs fastest non-ipu':>18s}")  # fmt: skip
    for name, basis in CASES:
        molecule = qm9[name] if name.startswith("qm9:") else from_name(name)
        host = prepare([molecule], resolve(RKSConfig(basis=basis, xc="hf")))[0]
        n = host.nao
        dm = jnp.asarray(host.density_guess, jnp.float32)
        runs, plans, prep = {}, {}, {}
        for label, backend in backends(n, args.skip_dense_above).items():
            t = time.perf_counter()
            stacked = backend.prepare(batch_eris([host.eri_s8], n, np.float32), n, np.float32)  # a batch of one
            data = jax.block_until_ready(jax.tree.map(lambda a: a[0], stacked))
            prep[label] = time.perf_counter() - t
            fn = jax.jit(backend.contract)
            jax.block_until_ready(fn(data, dm))  # compile
            runs[label] = (fn, data)
            if isinstance(backend, IPUJK):
                real = backend.plans(host.eri, n, np.float32)[1]
                plans[label] = f"{real.strategy.name} {real.num_ipus} IPU {real.tiles_used} tiles"
        times = {label: [] for label in runs}
        for _ in range(args.repeats):
            for label, (fn, data) in runs.items():
                t = time.perf_counter()
                jax.block_until_ready(fn(data, dm))
                times[label].append(time.perf_counter() - t)
        med = {label: statistics.median(v) for label, v in times.items()}
        fastest_other = min(v for k, v in med.items() if not k.startswith("ipu"))
        for label, values in times.items():
            ms = [1e3 * v for v in values]
            ratio = med[label] / fastest_other
            print(f"{name:12s} {basis:7s} {n:4d} | {label:10s} {plans.get(label, ''):>22s} | {prep[label]:9.2f} | "
                  f"{statistics.median(ms):10.2f} [{min(ms):8.2f}-{max(ms):8.2f}] | {ratio:17.2f}x")  # fmt: skip
        print()
        del runs


if __name__ == "__main__":
    main()
