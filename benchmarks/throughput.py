"""Generator throughput, side by side: `qm1b generate` against a plain PySCF loop, same conformers.

    python benchmarks/throughput.py [--molecules 3] [--conformers 8] [--windows 3] [--batch-size 8]
                                    [--integrals libcint|jax]

Both sides label the same RDKit conformers (the first ``--molecules`` 9-heavy-atom molecules of the
built-in sample, ``--conformers`` each, embedded with the generator's own seeds) with RKS
B3LYP (with VWN5, QM1B's)/STO-3G at grid level 0:

- **ours**: :func:`qm1b.generate.run_shard`, the whole generator (conformer embedding, host
  preparation, batched float32 SCF with the default ``ipu`` J-K backend, float64 finalisation and
  the HDF5 writes), into a fresh output directory each window;
- **PySCF**: for each conformer ``dft.RKS(mol, xc)`` with the generator's functional,
  ``grids.level = 0`` and PySCF's default convergence (conv_tol 1e-9), float64; the conformers are
  embedded before the clock starts.

Threads: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2 for both sides (our host preparation and
finalisation use PySCF too), set before numpy is imported; XLA uses its default CPU thread pool.
The process is set up as ``qm1b generate`` sets up its own
(:func:`pyscf_ipu.runtime.reuse_freed_memory`: glibc's malloc thresholds, which the PySCF side runs
under too, and XLA's synchronous dispatch).
"cold" is the first window of ours, in a process with an empty persistent compilation cache; the
timed windows follow, interleaved ours, PySCF, ours, PySCF, ... with the 1-minute load average of
each. Conformers per hour are medians over the windows with [min-max]; the ratio is the median of
the per-window ratios. Label differences are ours minus this PySCF run, in meV.

Two time splits of ours follow. The generator's own (its last warm window) is pipelined: a batch is
prepared while the device still runs the previous one, so a preparation stage that waits for the
device is charged for that batch's SCF too. The stage split runs the same batches with every stage
waiting for its result before the next starts (``--split-repeats`` times, medians), with the CPU
time of each: where the time goes, without the overlap.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from common import median_range, print_label_differences  # noqa: E402

import jax  # noqa: E402
from pyscf_ipu.config import RKSConfig  # noqa: E402
from pyscf_ipu.programs import precision_scope  # noqa: E402
from pyscf_ipu.runtime import reuse_freed_memory  # noqa: E402
from pyscf_ipu.resolution import resolve  # noqa: E402
from pyscf_ipu.reference import pyscf_method, pyscf_runnable  # noqa: E402
from pyscf_ipu.finalisation import dispatch_finalisation, finalise  # noqa: E402
from pyscf_ipu.padding import fill_batch  # noqa: E402
from pyscf_ipu.problem import prepare_batch  # noqa: E402
from pyscf_ipu.scf import scf_program  # noqa: E402
from pyscf_ipu.units import HARTREE_TO_EV  # noqa: E402
from qm1b.conformers import embed_conformers  # noqa: E402
from qm1b.generate import GENERATOR_DFT_DEFAULTS, GenerateConfig, run_shard  # noqa: E402
from qm1b.inputs import builtin_sample, heavy_atom_count  # noqa: E402
from qm1b.store import open_dataset  # noqa: E402

LABELS = ("energy", "homo", "lumo", "y")


def pyscf_labels(molecule, config: RKSConfig) -> dict[str, float]:
    """One PySCF run from scratch (:func:`~pyscf_ipu.reference.pyscf_method`: default convergence,
    density fitted where ``config`` is, a dispersion correction PySCF lacks added to its energy:
    :func:`~pyscf_ipu.reference.pyscf_runnable`); labels in eV."""
    method, added = pyscf_runnable(molecule, resolve(config))
    mf = pyscf_method(molecule, method)
    energy = mf.kernel() + added
    nocc = mf.mol.nelectron // 2
    homo, lumo = mf.mo_energy[nocc - 1], mf.mo_energy[nocc]
    return {"energy": energy * HARTREE_TO_EV, "homo": homo * HARTREE_TO_EV, "lumo": lumo * HARTREE_TO_EV,
            "y": (lumo - homo) * HARTREE_TO_EV, "converged": mf.converged}  # fmt: skip


def stage_split(batches: list[list], config: RKSConfig, batch_size: int, repeats: int) -> None:
    """Print where our time goes, stage by stage, each waiting for its result (see the module doc):
    wall and CPU ms per conformer, medians over ``repeats`` passes over ``batches`` (after one pass
    that compiles nothing new, the generator's windows having run)."""
    method = resolve(config)
    count = sum(len(b) for b in batches)

    def one_pass() -> tuple[dict[str, list[float]], dict[str, float]]:
        stages: dict[str, list[float]] = {}  # name -> [wall, CPU] seconds
        parts: dict[str, float] = {}  # of the integrals' stage, wall (the integral source's own timings)

        def timed(name, work):
            wall, cpu = time.perf_counter(), time.process_time()
            out = jax.block_until_ready(work())
            total = stages.setdefault(name, [0.0, 0.0])
            total[0] += time.perf_counter() - wall
            total[1] += time.process_time() - cpu
            return out

        for molecules in batches:
            batch = timed("integrals and problem", lambda: prepare_batch(fill_batch(molecules, batch_size), method))
            for key, seconds in batch.timings.items():
                parts[key] = parts.get(key, 0.0) + seconds * len(molecules)
            with precision_scope(config.precision):
                trace = timed("SCF loop", lambda: scf_program(batch.problem, method.loop))
                final = timed("float64 finalisation", lambda: dispatch_finalisation(method, batch, trace))
            trace, final = jax.device_get((trace, final))
            timed("host finalise", lambda: [finalise(m, *jax.tree.map(lambda a: a[i], (trace, final)), method,
                                                     batch.shapes)
                                            for i, m in enumerate(batch.members[: len(molecules)])])  # fmt: skip
        return stages, parts

    one_pass()
    passes = [one_pass() for _ in range(repeats)]
    ms = lambda seconds: statistics.median(seconds) * 1000 / count  # noqa: E731  per conformer
    print(f"\nour stage split, stages one after another (median of {repeats}; ms per conformer):")
    print(f"  {'':24s} {'wall':>7s} {'CPU':>7s}")
    for name in passes[0][0]:
        print(f"  {name:24s} {ms(p[name][0] for p, _ in passes):7.1f} {ms(p[name][1] for p, _ in passes):7.1f}")
        if name == "integrals and problem":
            for key in passes[0][1]:
                print(f"    {key:22s} {ms(q[key] for _, q in passes):7.1f}")
    print(f"  {'total':24s} {ms(sum(v[0] for v in p.values()) for p, _ in passes):7.1f} "
          f"{ms(sum(v[1] for v in p.values()) for p, _ in passes):7.1f}")  # fmt: skip


def main() -> None:
    reuse_freed_memory()  # as `qm1b generate` does, before JAX runs anything
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--molecules", type=int, default=3)
    parser.add_argument("--conformers", type=int, default=8)
    parser.add_argument("--windows", type=int, default=3, help="timed windows per side, after the cold one")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--split-repeats", type=int, default=3, help="passes of the stage split (0: none)")
    parser.add_argument("--integrals", choices=("libcint", "jax", "auto"), default=GENERATOR_DFT_DEFAULTS["integrals"],
                        help="our side's integrals: libcint's, or the JAX kernels (default: the generator's)")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    work = Path(tempfile.mkdtemp(prefix="qm1b-throughput-"))
    os.environ["PYSCF_IPU_CACHE"] = str(work / "cache")  # empty: the cold window really compiles

    chosen = [m for m in builtin_sample() if heavy_atom_count(m.smiles) == 9][: args.molecules]
    smiles_file = work / "molecules.smi"
    smiles_file.write_text("".join(f"{m.smiles} {m.name}\n" for m in chosen))
    # b3lyp5/sto-3g, grid level 0, float32, ipu J-K, at most 20 iterations
    dft_config = RKSConfig(**{**GENERATOR_DFT_DEFAULTS, "integrals": args.integrals})

    def generator_config(window: str) -> GenerateConfig:
        return GenerateConfig(smiles=str(smiles_file), out=str(work / window), conformers=args.conformers,
                              batch_size=args.batch_size, progress=False)  # fmt: skip

    # The PySCF side labels exactly the generator's conformers: same SMILES, ids and seeds.
    gen = generator_config("unused")
    per_molecule = [embed_conformers(m.smiles, gen.conformers, gen.seed, k) for k, m in enumerate(chosen)]
    conformers = [c for molecule in per_molecule for c in molecule]
    count = len(conformers)
    print(f"{len(chosen)} molecules x {args.conformers} conformers = {count} conformers "
          f"({', '.join(m.smiles for m in chosen)}); {dft_config.xc}/STO-3G, grid level 0; our integrals: {args.integrals}")  # fmt: skip
    print(f"threads: OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']} "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; XLA default\n")  # fmt: skip

    t = time.perf_counter()
    cold_summary = run_shard(generator_config("cold").resolved(dft_config))
    cold = time.perf_counter() - t
    ours, theirs, loads, summary, reference = [], [], [], None, None
    for w in range(args.windows):
        loads.append(os.getloadavg()[0])
        t = time.perf_counter()
        summary = run_shard(generator_config(f"warm{w}").resolved(dft_config))
        ours.append(3600 * summary.conformers / (time.perf_counter() - t))
        t = time.perf_counter()
        reference = [pyscf_labels(m, dft_config) for m in conformers]
        theirs.append(3600 * count / (time.perf_counter() - t))
    assert summary.conformers == count == cold_summary.conformers, "the generator dropped conformers"

    ratios = [a / b for a, b in zip(ours, theirs)]
    print(f"{'':22s} {'conformers per hour':>30s}")
    print(f"{'ours, cold (compiles)':22s} {3600 * count / cold:9,.0f}")
    print(f"{'ours, warm':22s} {median_range(ours, ',.0f', 9)}")
    print(f"{'PySCF':22s} {median_range(theirs, ',.0f', 9)}")
    print(f"ratio ours/PySCF (median of {args.windows} windows): {statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}-{max(ratios):.2f}]; load average {min(loads):.1f}-{max(loads):.1f}")  # fmt: skip

    with open_dataset(work / f"warm{args.windows - 1}") as ds:
        print_label_differences(ds.arrays().columns, reference, LABELS)

    total = sum(summary.timings.values())
    print(f"\nour time split, last warm window ({total:.1f} s of {3600 * count / ours[-1]:.1f} s wall):")
    for key, seconds in sorted(summary.timings.items(), key=lambda kv: -kv[1]):
        print(f"  {key:16s} {seconds:7.2f} s  {seconds / total:6.1%}  {1000 * seconds / count:7.1f} ms/conformer")
    if args.split_repeats > 0:
        batches = [b[i : i + args.batch_size] for b in per_molecule for i in range(0, len(b), args.batch_size)]
        stage_split(batches, dft_config, args.batch_size, args.split_repeats)


if __name__ == "__main__":
    main()
