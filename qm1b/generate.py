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

import itertools
import sys
import time

import numpy as np

from pyscf_ipu.config import IPUConfig, RKSConfig
from pyscf_ipu.gradients import gradient_source
from pyscf_ipu.method import Method
from pyscf_ipu.resolution import resolve
from pyscf_ipu.molecule import MoleculeError
from pyscf_ipu.optimize import relax
from pyscf_ipu.pyscf_mole import check_basis
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
from .summary import OPTIMIZER_WORKERS, Summary
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
        inflight: tuple | None = None  # (Batch, BatchRun, its pending gradients or None, whether its bucket's first)
        started: set = set()  # the size buckets whose programs are loaded
        done = writer.done()
        supplied = iter(supply(inputs, source, done, clock))  # a generator: its workers start at its first item
        try:
            ledger = Ledger(commits, summary, bar, watch, gen.drop_unconverged, time.perf_counter())
            items = batches(inputs, buckets, source, done, sizes, supplied)
            if gen.relaxes:  # each size bucket's conformers relaxed to their minima, and labelled there
                _relax_buckets(items, buckets, sizes, method, gen, ledger, clock)
                items = ()
            for item in items:
                if isinstance(item, Settled):
                    ledger.settle(item)
                    continue
                bucket = buckets[item.members[0][0].molecule_id]
                if inflight is not None and not ahead.get(bucket, True):  # the two would not fit together
                    ledger.label(inflight[0], *_results(*inflight[:3], clock), steady=not inflight[3])
                    inflight = prepared = dispatched = pending = None  # its arrays freed before the next batch's are made
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
                    # the gradients queued right behind the labels, where the integral source computes them on the device
                    pending = gradient_source(method).dispatch(dispatched, method) if gen.forces else None
                if inflight is not None:  # the device worked on it while this batch was prepared
                    ledger.label(inflight[0], *_results(*inflight[:3], clock), steady=not (first or inflight[3]))
                inflight = (item, dispatched, pending, first)
            if inflight is not None:
                ledger.label(inflight[0], *_results(*inflight[:3], clock), steady=not inflight[3])
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


def _results(batch: Batch, dispatched: BatchRun, pending, clock: HostClock
             ) -> tuple[list[SCFResult], list[np.ndarray] | None, float]:  # fmt: skip
    """The batch's results (its filling members' dropped), the gradients where ``pending`` is the
    batch's gradients in flight (with the grid's response: the exact derivative of the stored
    energy), and their seconds."""
    with clock.stage("results"):
        results = dispatched.results()[: len(batch.members)]
    if pending is None:
        return results, None, 0.0
    t = time.perf_counter()
    with clock.stage("forces"):
        gradients = pending.gradients(results)
    return results, gradients, time.perf_counter() - t


def _relax_buckets(items, buckets: dict, sizes: dict, method: Method, gen: GenerateConfig, ledger: Ledger,
                   clock: HostClock) -> None:  # fmt: skip
    """Relax the conformers of ``items`` (the batcher's output, in bucket order), each size bucket's as
    one stream through a batch of its width (:func:`~pyscf_ipu.optimize.relax`); each conformer is
    committed as it finishes, a failure with its reason where it did not converge."""
    def batches_only():
        for item in items:
            if isinstance(item, Settled):
                ledger.settle(item)
            else:
                yield item

    for bucket, group in itertools.groupby(batches_only(), key=lambda b: buckets[b.members[0][0].molecule_id]):
        members: list[tuple] = []  # (input, conformer id) of each conformer of the stream, in order
        width = sizes[bucket] if bucket is not None else 1
        finished = [0]

        def conformers(group=group, members=members):
            for batch in group:
                try:
                    check_basis({s for m in batch.molecules for s in m.symbols}, method.config.basis)
                except MoleculeError as err:
                    ledger.settle(_molecules_failed(batch, err))
                    continue
                for entry, cid, molecule in batch.members:
                    members.append((entry, cid))
                    yield molecule

        def done(index: int, relaxation, members=members, finished=finished, width=width) -> None:
            finished[0] += 1  # the first batch's worth compiled the bucket's programs
            clock.add(OPTIMIZER_WORKERS, relaxation.optimizer_seconds)
            ledger.relaxed([(*members[index], relaxation)], gen.trajectory, steady=finished[0] > width)

        with clock.stage("relaxation"):
            relax(conformers(), method, max_steps=gen.max_steps, width=width, on_done=done,
                  on_step=lambda index, frame: ledger.stepped())  # fmt: skip


__all__ = ["GENERATOR_DFT_DEFAULTS", "GenerateConfig", "NotConvergingError", "Summary", "generate", "label_molecules",
           "run_shard"]
