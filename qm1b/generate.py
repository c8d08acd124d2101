"""The generator: SMILES -> RDKit conformers (or a file's geometries) -> batched float32 DFT -> HDF5
shard, resumable.

Molecules are ordered by size bucket (:mod:`pyscf_ipu.buckets`) and their conformers go in batches
of ``batch_size``, filled from one molecule or several of a bucket: a bucket's molecules share every
shape, so a batch runs as one vmapped program per stage, and the stored programs and persistent
compilation cache spare a restarted run the tracing and compiling. The integrals come from the
``auto`` source by default (``--integrals``): the JAX integrals assembled on the device from the
bucket's template, with libcint's density-fitting factor where the device is the CPU.

Three kinds of thread share the work (:mod:`qm1b.pipeline`): worker threads embed the conformers
ahead of the device; the main thread sends batch k + 1's positions and dispatches its programs
before it reads batch k's labels, so that an accelerator always has the next batch; a commit thread
writes each labelled batch to the shard as one atomic part (see :mod:`qm1b.store`). A killed run
resumes with ``--resume``: committed conformers and recorded failures are skipped, so at most the
batch in flight, the one being committed and the one queued for commit are computed again. A run
whose conformers mostly fail to converge stops (:class:`~qm1b.watch.ConvergenceWatch`): that is a
broken setup, not hard molecules.

This module is the labelling loop and the dispatch to an executor; the rest is one module per job:
the settings (:mod:`qm1b.settings`), the batches (:mod:`qm1b.batching`), where outcomes go
(:mod:`qm1b.ledger`), the summary and the convergence watch (:mod:`qm1b.summary`,
:mod:`qm1b.watch`), and the Ray executor (:mod:`qm1b.ray_executor`).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from pyscf_ipu.config import IPUConfig, RKSConfig
from pyscf_ipu.forces import nuclear_gradient
from pyscf_ipu.method import Method, resolve
from pyscf_ipu.molecule import MoleculeError
from pyscf_ipu.optimize import relax
from pyscf_ipu.padding import fill_batch
from pyscf_ipu.problem import prepare_batch
from pyscf_ipu.results import SCFResult
from pyscf_ipu.rks import BatchRun, submit_batch
from pyscf_ipu.runtime import default_cache_dir, disable_numpy_huge_pages, enable_compilation_cache

from .batching import Batch, Settled, batch_sizes, batches, bucket_order, check_memory, chosen, prepares_ahead, supply
from .inputs import Input
from .ledger import Ledger, committer
from .pipeline import CommitThread, HostClock
from .ray_executor import run_ray
from .schema import Failure
from .settings import GENERATOR_DFT_DEFAULTS, GenerateConfig, Run, provenance
from .store import ShardWriter
from .summary import Summary
from .watch import NotConvergingError, convergence_watch


def generate(gen: GenerateConfig, dft: RKSConfig) -> Summary:
    """Run the generator with the configured executor; :class:`~qm1b.watch.NotConvergingError` once it
    has ended (what it labelled is kept) if its converged share is below ``--min-converged``."""
    run = gen.resolved(dft)
    summary = run_ray(run, label_molecules) if gen.executor == "ray" else run_shard(run)
    # the watch (which names the device) built only for a run that fails: asking JAX for the device
    # would start its backend in a Ray driver, on a GPU node taking that GPU's memory
    if summary.labelled and summary.converged < gen.min_converged * summary.labelled:
        convergence_watch(run, 1, provenance()["device"]).finish(summary.labelled, summary.converged)
    return summary


def run_shard(run: Run) -> Summary:
    """Generate one shard (``--shard i/n``) in this process: the ``local`` executor."""
    return label_molecules(run, run.inputs(), run.shard, run.gen.resume)


def label_molecules(run: Run, inputs: list[Input], shard: tuple[int, int], resume: bool) -> Summary:
    """Label ``inputs`` into shard ``shard`` = (i, n) of
    ``--out``, continuing what it holds if ``resume``: a local run, and each Ray task.
    :class:`NotConvergingError` once most recent conformers fail to converge
    (:class:`ConvergenceWatch`), after what was committed is merged.

    The conformers are made ahead by worker threads and the batches committed by a thread of their
    own (:mod:`qm1b.pipeline`); the main thread assembles batch k + 1's inputs and dispatches its
    programs before it reads batch k's labels, so that an accelerator always has the next batch."""
    from tqdm import tqdm

    start, gen = time.perf_counter(), run.gen
    enable_compilation_cache(default_cache_dir() / "jax")
    disable_numpy_huge_pages()
    clock = HostClock()
    with clock.stage("templates"):
        method = resolve(run.dft)
        buckets = run.buckets(method, inputs)
        sizes = batch_sizes(run, method, inputs, buckets)
        check_memory(run, method, sizes)
        ahead = prepares_ahead(run, method, sizes)
        method.integrals.prepare_buckets(sizes, {s for entry in inputs for s in run.source.symbols(entry)})
    source = run.source
    shard, num_shards = shard
    inputs = sorted(inputs, key=lambda m: (bucket_order(buckets[m.molecule_id]), m.molecule_id))
    summary = Summary(out=gen.out, shard=f"{shard}/{num_shards}", molecules=len(inputs), method=chosen(run.dft, sizes))
    versions = provenance()
    watch = convergence_watch(run, max(sizes.values(), default=1), versions["device"])
    stop = None
    with ShardWriter(gen.out, shard, num_shards, settings=run.label_settings(), versions=versions, resume=resume,
                     ignored_settings=IPUConfig.PLACEMENT, layout=gen.layout) as writer:  # fmt: skip
        for path, aside in writer.set_aside:
            print(f"qm1b: {path} could not be read; set aside as {aside.name}, its rows are computed again",
                  file=sys.stderr)
        bar = tqdm(total=sum(source.expected(m) for m in inputs), unit="conf", disable=not gen.progress,
                   smoothing=0.1, desc=summary.method)  # fmt: skip
        commits = CommitThread(committer(writer), clock)
        inflight: tuple[Batch, BatchRun, bool] | None = None  # and whether it was its bucket's first
        started: set = set()  # the size buckets whose programs are loaded
        done = writer.done()
        supplied = iter(supply(inputs, source, done, clock))  # a generator: its workers start at its first item
        try:
            ledger = Ledger(commits, summary, bar, watch, gen.drop_unconverged, time.perf_counter())
            for item in batches(inputs, buckets, source, done, sizes, supplied):
                if isinstance(item, Settled):
                    ledger.settle(item)
                    continue
                bucket = buckets[item.members[0][0].molecule_id]
                if gen.relaxes:  # relaxed to their minima batch by batch, and labelled there
                    try:
                        with clock.stage("relaxation"):
                            relaxations = relax(item.molecules, method, max_steps=gen.max_steps)
                    except MoleculeError as err:
                        ledger.settle(_molecules_failed(item, err))
                        continue
                    ledger.relaxed(item, relaxations, gen.trajectory, steady=bucket in started)
                    started.add(bucket)
                    continue
                if inflight is not None and not ahead.get(bucket, True):  # the two would not fit together
                    ledger.label(inflight[0], *_results(*inflight[:2], method, gen.forces, clock), steady=not inflight[2])
                    inflight = prepared = dispatched = None  # its arrays freed before the next batch's are made
                try:  # a short batch is filled up: every batch of a size bucket then runs the same programs
                    with clock.stage("inputs"):
                        molecules = fill_batch(item.molecules, sizes[bucket] if bucket is not None else len(item.members))
                        prepared = prepare_batch(molecules, method)
                except MoleculeError as err:  # e.g. an element the basis lacks: the whole molecule fails
                    ledger.settle(_molecules_failed(item, err))
                    continue
                first = bucket not in started  # its programs are loaded or compiled as it is dispatched
                started.add(bucket)
                with clock.stage("dispatch"):
                    dispatched = submit_batch(prepared, method)
                if inflight is not None:  # the device worked on it while this batch was prepared
                    ledger.label(inflight[0], *_results(*inflight[:2], method, gen.forces, clock),
                                 steady=not (first or inflight[2]))  # fmt: skip
                inflight = (item, dispatched, first)
            if inflight is not None:
                ledger.label(inflight[0], *_results(*inflight[:2], method, gen.forces, clock), steady=not inflight[2])
        except NotConvergingError as err:
            stop = err  # the shard closes as usual below: what was committed is merged and kept
        except BaseException:
            supplied.close()  # its workers stop after the conformers they are making
            commits.close(raise_error=False)  # what was queued is committed; the error in hand is the one to tell
            raise
        commits.close()
        bar.close()
    summary.seconds = time.perf_counter() - start
    summary.host.update(clock.seconds)
    if stop is not None:
        raise stop
    return summary


def _molecules_failed(batch: Batch, err: MoleculeError) -> Settled:
    """Each molecule of ``batch`` failed as a whole, for ``err`` (e.g. an element the basis lacks)."""
    entries = {e.molecule_id: e for e, _, _ in batch.members}
    return Settled([Failure(e.description, str(err), e.molecule_id, -1) for e in entries.values()], 0, len(batch.members))


def _results(batch: Batch, dispatched: BatchRun, method: Method, forces: bool, clock: HostClock
             ) -> tuple[list[SCFResult], list[np.ndarray] | None, float]:  # fmt: skip
    """The batch's results (its filling members' dropped), the gradients where ``forces`` asks for
    them (with the grid's response: the exact derivative of the stored energy), and their seconds."""
    with clock.stage("results"):
        results = dispatched.results()[: len(batch.members)]
    if not forces:
        return results, None, 0.0
    t = time.perf_counter()
    with clock.stage("forces"):
        gradients = [nuclear_gradient(m, r, method, grid_response=True)
                     for m, r in zip(batch.molecules, results)]  # fmt: skip
    return results, gradients, time.perf_counter() - t


__all__ = ["GENERATOR_DFT_DEFAULTS", "GenerateConfig", "NotConvergingError", "Summary", "generate", "label_molecules",
           "run_shard"]
