"""The device's time per conformer in each compiled program of the generator, beside the host's time
per conformer by stage: where a batch's time goes, in one run.

    python benchmarks/program_times.py --smiles FILE --out DIR [--json FILE] [any qm1b generate option]

Runs ``qm1b generate`` in this process with every compiled program's call (``pyscf_ipu.programs``)
waited for until its outputs are ready, and its wall time added to the program's name: on an
accelerator, that is the program's device time and its launch. A call that loads, traces or
compiles its program is timed apart (``loading``) and the program run once more for its own time;
run it with the caches a restarted run has (``PYSCF_IPU_CACHE``). The waits take away the overlap
between the host and the device, so this run's own rate is not the generator's: the host's figures
are its clock (CPU time outside compiled programs, every thread), the device's the sum of the
programs' times.

Two variants of the JAX integrals, for choosing their settings on a device (neither is a generator
option): ``--eri-precision float32|float64`` computes the ERIs in that precision (the JAX source's
default is float64), and ``--chunk-batch N`` computes N ERI chunks at once on an accelerator in place
of ``pyscf_ipu.integrals.eri.GPU_CHUNK_BATCH``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed_programs(device: Counter, loading: Counter, calls: Counter):
    """Wrap every :class:`~pyscf_ipu.programs.CompiledFunction`'s call: outputs waited for, wall
    seconds added to ``device`` under the program's name. A call that loads, traces or compiles its
    program adds that time to ``loading`` and runs the program once more for ``device``. The calls of
    every thread are timed one at a time, so that none waits in another's time. Calls inside a
    transformation pass through untimed."""
    import jax

    from pyscf_ipu.programs import CompiledFunction

    original = CompiledFunction.__call__
    one_at_a_time = threading.Lock()  # the threads' calls timed one after another, none counted twice

    def call(self, *args):
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args)):
            return original(self, *args)
        with one_at_a_time:
            return timed(self, *args)

    def timed(self, *args):
        name = self.name.rsplit(".", 1)[-1]
        before, start = self.traced + self.loaded, time.perf_counter()
        out = jax.block_until_ready(original(self, *args))
        if self.traced + self.loaded != before:  # loaded, traced or compiled: timed apart, then run again
            loading[name] += time.perf_counter() - start
            start = time.perf_counter()
            out = jax.block_until_ready(original(self, *args))  # a pure function: the same outputs
        device[name] += time.perf_counter() - start
        calls[name] += 1
        return out

    CompiledFunction.__call__ = call


def vary(eri_precision: str | None, chunk_batch: int | None) -> None:
    """This process's variant of the JAX integrals: their ERI precision, the ERI chunks an accelerator
    computes at once (each read when a program is built, so set before the run)."""
    if eri_precision is not None:
        from pyscf_ipu.integral_sources import INTEGRAL_SOURCES, JaxIntegrals

        INTEGRAL_SOURCES["jax"] = JaxIntegrals(eri_precision=eri_precision)
    if chunk_batch is not None:
        if chunk_batch < 1:
            sys.exit("program_times.py: --chunk-batch must be at least 1")
        from pyscf_ipu.integrals import eri

        eri.GPU_CHUNK_BATCH = chunk_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    parser.add_argument("--eri-precision", choices=("float32", "float64"), help="the JAX integrals' ERI precision")
    parser.add_argument("--chunk-batch", type=int, help="ERI chunks computed at once on an accelerator")
    args, generate = parser.parse_known_args()
    sys.path.insert(0, str(ROOT))
    vary(args.eri_precision, args.chunk_batch)
    from pyscf_ipu.runtime import reuse_freed_memory

    reuse_freed_memory()  # as qm1b generate does, before JAX runs anything
    from qm1b.cli import main as qm1b

    device, loading, calls = Counter(), Counter(), Counter()
    timed_programs(device, loading, calls)
    report = Path(generate[generate.index("--out") + 1] + ".report.json") if "--out" in generate else None
    code = qm1b(["generate", "--no-progress", *generate, *(["--report", str(report)] if report else [])])
    if code or report is None:
        sys.exit(code or "program_times.py: --out DIR is needed")
    summary = json.loads(report.read_text())[0]
    conformers = max(1, summary["conformers"] + summary["failures"])
    host = {k: 1000 * v / conformers for k, v in summary["host"].items() if k not in summary["once_seconds"]}
    programs = {name: {"calls": calls[name], "ms_per_conformer": 1000 * device[name] / conformers} for name in device}
    print(f"{conformers} conformers; programs' wall time per conformer, waited for (the device's share):")
    for name, figure in sorted(programs.items(), key=lambda kv: -kv[1]["ms_per_conformer"]):
        print(f"  {name:24s} {figure['ms_per_conformer']:9.2f} ms  ({figure['calls']} calls)")
    print(f"  {'all programs':24s} {sum(f['ms_per_conformer'] for f in programs.values()):9.2f} ms")
    print("host CPU per conformer by stage (every thread, outside programs): "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(host.items(), key=lambda kv: -kv[1]))
          + f"; all {summary['host_ms_per_conformer']:.2f} ms")  # fmt: skip
    if loading:
        print("loading, tracing or compiling (not counted above): "
              + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(loading.items(), key=lambda kv: -kv[1])))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"conformers": conformers, "programs": programs, "host_ms": host,
                                               "loading_seconds": dict(loading)}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
