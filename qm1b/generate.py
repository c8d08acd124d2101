"""The generator: SMILES -> RDKit conformers (or a file's geometries) -> batched float32 DFT -> HDF5
shard, resumable.

Molecules are ordered by size bucket (:mod:`pyscf_ipu.buckets`) and their conformers go in batches
of ``batch_size``, filled from one molecule or several of a bucket: a bucket's molecules share every
shape, so a batch runs as one vmapped program per stage, and the stored programs and persistent
compilation cache spare a restarted run the tracing and compiling. The integrals come from the
``auto`` source by default (``--integrals``): the JAX integrals assembled on the device from the
bucket's template, with libcint's density-fitting factor where the device is the CPU.

Threads share the work (:mod:`qm1b.pipeline`): worker threads embed the conformers ahead of the
device; three labelling threads prepare, dispatch and read out the batches, batch k + 1 prepared and
dispatched while batch k's labels are read, so that an accelerator always has the next batch; a
commit thread writes each labelled batch to the shard as one atomic part (see :mod:`qm1b.store`).
The main thread starts them and waits. A killed run resumes with ``--resume``: committed conformers
and recorded failures are skipped, so at most the two batches in flight, the one being committed
and the one queued for commit are computed again. A run whose conformers mostly fail to converge
stops (:class:`~qm1b.watch.ConvergenceWatch`): that is a broken setup, not hard molecules.

This module is the labelling loop and the dispatch to an executor; the rest is one module per job:
the settings (:mod:`qm1b.settings`), the batches (:mod:`qm1b.batching`), where outcomes go
(:mod:`qm1b.ledger`), the summary and the convergence watch (:mod:`qm1b.summary`,
:mod:`qm1b.watch`), and the Ray executor (:mod:`qm1b.ray_executor`).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import NamedTuple

import numpy as np

from pyscf_ipu.config import IPUConfig, RKSConfig
from pyscf_ipu.gradients import gradient_source
from pyscf_ipu.method import Method
from pyscf_ipu.resolution import resolve
from pyscf_ipu.molecule import MoleculeError
from pyscf_ipu.optimize import relax
from pyscf_ipu.padding import fill_batch
from pyscf_ipu.programs import program_times, programs_run_on_caller, thread_program_seconds
from pyscf_ipu.problem import prepare_batch
from pyscf_ipu.results import SCFResult
from pyscf_ipu.rks import BatchRun, submit_batch
from pyscf_ipu.runtime import default_cache_dir, disable_numpy_huge_pages, enable_compilation_cache

from .batching import Batch, Settled, batch_sizes, batches, bucket_order, check_memory, chosen, prepares_ahead, supply
from .inputs import Input
from .ledger import Ledger, committer
from .pipeline import MAIN_THREAD, CommitThread, HostClock, run_in_stages
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

    The conformers are made ahead by worker threads, the batches labelled by three threads
    (:func:`_label_batches`) and committed by one more (:mod:`qm1b.pipeline`)."""
    from tqdm import tqdm

    start, gen, programs = time.perf_counter(), run.gen, program_times()
    enable_compilation_cache(default_cache_dir() / "jax")
    disable_numpy_huge_pages()
    clock = HostClock()
    with clock.stage("templates"):
        method = resolve(run.dft, run.budget_gb)
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
        done = writer.done()
        supplied = iter(supply(inputs, source, done, clock))  # a generator: its workers start at its first item
        try:
            ledger = Ledger(commits, summary, bar, watch, gen.drop_unconverged, time.perf_counter())
            items = batches(inputs, buckets, source, done, sizes, supplied)
            if gen.relaxes:  # each size bucket's conformers relaxed to their minima, and labelled there
                _relax_buckets(items, buckets, sizes, method, gen, ledger, clock)
            else:
                with clock.stage(MAIN_THREAD):
                    _label_batches(items, _Buckets(buckets, sizes, ahead), method, gen, ledger, clock, supplied.close)
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
    summary.programs = {name: [a - b for a, b in zip(times, programs.get(name, [0, 0.0, 0, 0.0]))]
                        for name, times in program_times().items()}  # this shard's share of the process's
    if stop is not None:
        raise stop
    return summary


class _ProgramLoads:
    """When the labelling threads load or compile programs (a size bucket's first batch, from its
    preparation to its dispatch): a batch labelled with no loading since the one before is steady."""

    def __init__(self) -> None:
        self._lock, self._running, self._ended = threading.Lock(), 0, float("-inf")

    def begin(self) -> None:
        with self._lock:
            self._running += 1

    def end(self) -> None:
        with self._lock:
            self._running -= 1
            self._ended = time.perf_counter()

    def none_since(self, moment: float) -> bool:
        with self._lock:
            return self._running == 0 and self._ended < moment


class _Buckets(NamedTuple):
    """Each input's size bucket (by molecule id), each bucket's batch size, and whether its batches
    fit the memory budget two at a time."""

    of: dict
    sizes: dict
    ahead: dict


def _label_batches(items, buckets: _Buckets, method: Method, gen: GenerateConfig, ledger: Ledger, clock: HostClock,
                   on_end) -> None:  # fmt: skip
    """Label the batches of ``items`` (the batcher's output) in three stages on threads of their own
    (:func:`~qm1b.pipeline.run_in_stages`): preparing a batch's inputs, dispatching its programs, and
    reading its labels out for the ledger. Two batches are alive at once: batch k + 1 is prepared and
    dispatched while batch k's labels are read, so that the device always has the next batch, and the
    calling thread does nothing per conformer. Where a bucket's batches do not fit the memory budget
    two at a time (``buckets.ahead``), each runs alone. Where the device is the CPU, which runs each
    program on the thread that calls it, the stages take turns. ``on_end`` stops the conformers'
    supply."""
    loads, started = _ProgramLoads(), set()  # the size buckets whose programs are loaded

    def bucket_of(item):
        return buckets.of[item.members[0][0].molecule_id]

    def prepare(item):
        if isinstance(item, Settled):
            return item
        bucket = bucket_of(item)
        first = bucket not in started  # its programs are loaded or compiled as it is prepared and dispatched
        if first:
            loads.begin()
        try:  # a short batch is filled up: every batch of a size bucket then runs the same programs
            with clock.stage("inputs"):
                width = buckets.sizes[bucket] if bucket is not None else len(item.members)
                molecules = fill_batch(item.molecules, width)
                prepared = item, prepare_batch(molecules, method), first
        except BaseException as err:
            if first:
                loads.end()
            if isinstance(err, MoleculeError):  # e.g. an element the basis lacks: the whole molecule fails
                return _molecules_failed(item, err)
            raise
        started.add(bucket)
        return prepared

    def dispatch(prepared):
        if isinstance(prepared, Settled):
            return prepared
        item, batch, first = prepared
        try:
            with clock.stage("dispatch"):
                dispatched = submit_batch(batch, method)
                # the gradients queued right behind the labels, where the integral source computes them on
                # the device; a filled batch's copies are not wanted, and the device skips their gradients
                wanted = [k < len(item.molecules) for k in range(len(batch.members))]
                pending = gradient_source(method).dispatch(dispatched, method, wanted) if gen.forces else None
        finally:
            if first:
                loads.end()
        return item, dispatched, pending, first

    def label(dispatched):
        if isinstance(dispatched, Settled):
            return ledger.settle(dispatched)
        item, run, pending, first = dispatched
        loading = thread_program_seconds()[1]
        outcome = _results(item, run, pending, clock)  # the host's gradients may load a program per composition
        # steady: neither this batch nor anything since the last batch loaded a program
        steady = not first and loads.none_since(ledger.last_commit) and thread_program_seconds()[1] == loading
        ledger.label(item, *outcome, steady=steady)

    def weight(item):  # a batch that does not fit beside another runs alone
        return 0 if isinstance(item, Settled) else 1 if buckets.ahead.get(bucket_of(item), True) else 2

    run_in_stages(items, (prepare, dispatch, label), weight=weight, alive=2, on_end=on_end,
                  serial=programs_run_on_caller())


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
    return results, gradients, pending.dispatch_seconds + time.perf_counter() - t


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
                    method.check_elements({s for m in batch.molecules for s in m.symbols})
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
