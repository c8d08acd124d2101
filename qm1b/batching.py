"""Batching: how many conformers each size bucket's batches take (:func:`batch_sizes`), whether the
next batch is prepared beside the running one (:func:`prepares_ahead`), the memory check, and the
stream of batches and settled inputs that the labelling loop consumes (:func:`batches`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from pyscf_ipu.buckets import SizeBucket
from pyscf_ipu.config import RKSConfig
from pyscf_ipu.memory import GB, batch_memory, check_memory as check_batch, device_batch, largest_batch
from pyscf_ipu.method import Method
from pyscf_ipu.molecule import Molecule
from pyscf_ipu.programs import device_memory_bytes, usable_cores

from .conformers import ConformerError, ConformerSource
from .inputs import Input
from .pipeline import ConformerSupply, HostClock, Supplied
from .schema import Failure
from .settings import Run


def batch_sizes(run: Run, method: Method, inputs: list[Input], buckets: dict) -> dict[SizeBucket, int]:
    """The batch size of each size bucket of ``buckets`` (by molecule id): ``--batch-size``, or auto:
    the J-K backend's ``cpu_batch`` of the bucket on a CPU; on an accelerator the largest power of two, up to the
    bucket's conformers rounded up to one, whose arrays (with the next batch's beside them) fit :data:`~pyscf_ipu.memory.DEVICE_SHARE` of its
    memory. Auto never goes above the largest batch that fits the memory budget (nor below one:
    :func:`check_memory` then says what would fit). With ``--forces`` (and ``--relax dft``) the batch's
    gradients count too (:func:`~pyscf_ipu.memory.forces_bytes`)."""
    conformers = Counter()
    for entry in inputs:
        if buckets[entry.molecule_id] is not None:
            conformers[buckets[entry.molecule_id]] += run.source.expected(entry)
    if run.gen.batch_size is not None:
        return {bucket: run.gen.batch_size for bucket in conformers}
    memory, forces, budget = device_memory_bytes(), run.gen.stores_forces, run.budget_gb
    if memory is None:
        sizes = {bucket: method.backend.cpu_batch(bucket) for bucket in conformers}
    else:
        sizes = {bucket: device_batch(bucket, method, count, memory, forces) for bucket, count in conformers.items()}
    return {bucket: largest_batch(bucket, method, size, budget, True, forces)
            or largest_batch(bucket, method, size, budget, False, forces) or 1 for bucket, size in sizes.items()}


def prepares_ahead(run: Run, method: Method, sizes: dict[SizeBucket, int]) -> dict[SizeBucket, bool]:
    """Whether each size bucket's batches (of ``sizes``) are prepared while the one before runs: where a
    batch and the next one fit the memory budget together; else each waits for the one before."""
    budget = run.budget_gb * GB
    return {bucket: batch_memory(bucket, method, size, size, run.gen.stores_forces).total <= budget
            for bucket, size in sizes.items()}  # fmt: skip


def check_memory(run: Run, method: Method, sizes: dict[SizeBucket, int]) -> None:
    """:class:`~pyscf_ipu.memory.MemoryBudgetError` if a batch of the largest of the size buckets
    ``sizes`` (bucket: batch size) would need more than the memory budget, even without the next
    batch prepared beside it (:func:`prepares_ahead`); the message gives the largest batch size that fits."""
    largest = max(sizes, key=lambda b: b.nao_padded, default=None)
    if largest is not None:
        size = sizes[largest]
        check_batch(largest, method, size, run.budget_gb,
                    f"a batch of {size} conformers of the largest molecules, {largest.label()}", run.gen.stores_forces)


def chosen(dft: RKSConfig, sizes: dict[SizeBucket, int]) -> str:
    """What ``--jk auto`` and ``--batch-size auto`` picked, e.g. ``def2-svp, jk df, batch 1``, and how
    many size buckets the memory budget made stream their factor: the progress bar's label and the
    summary's; the backend is also in the dataset's settings."""
    low, high = min(sizes.values(), default=0), max(sizes.values(), default=0)
    streamed = sum(bucket.streams_factor for bucket in sizes)
    return (f"{dft.basis}, jk {dft.jk}, batch {low}" + (f"-{high}" if high != low else "")
            + (f", factor streamed in {streamed} of {len(sizes)} size buckets" if streamed else ""))


def bucket_order(bucket: SizeBucket | None) -> tuple:
    return (0, "") if bucket is None else (bucket.nao_padded, bucket.label())


@dataclass(frozen=True)
class Batch:
    """Conformers labelled together: of one molecule or of several of one size bucket."""

    members: list[tuple[Input, int, Molecule]]  # (input, conformer id, conformer)

    @property
    def molecules(self) -> list[Molecule]:
        return [m for _, _, m in self.members]


@dataclass(frozen=True)
class Settled:
    """Conformers of one input that need no labelling: failures to record and conformers done earlier."""

    failures: list[Failure]
    skipped: int  # conformers already committed or recorded (resume)
    progress: int  # conformers the progress bar advances by
    seconds: float = 0.0  # spent making the input's conformers


def batches(inputs: list[Input], buckets: dict, source: ConformerSource, done: set, sizes: dict[SizeBucket, int],
            supplied: Iterator[Supplied]) -> Iterator[Batch | Settled]:  # fmt: skip
    """Conformer batches still to do, in the inputs' order (grouped by their size ``buckets``, by
    molecule id), and what each input settles without labelling. A batch takes ``sizes[bucket]``
    conformers of one bucket, from one molecule or several; a molecule without a bucket (an element
    the basis lacks) goes alone, to fail as a whole. ``done``: the keys already in the shard;
    ``supplied``: the conformers of each input not done as a whole, in order (:func:`supply`)."""
    pending: list[tuple[Input, int, Molecule]] = []
    pending_bucket = None
    for entry in inputs:
        expected = source.expected(entry)
        if (entry.molecule_id, -1) in done:
            yield Settled([], expected, expected)
            continue
        made = next(supplied)
        if isinstance(made.outcome, ConformerError):
            yield Settled([Failure(entry.description, made.outcome.reason, entry.molecule_id, -1)], 0, expected,
                           made.seconds)  # fmt: skip
            continue
        if isinstance(made.outcome, BaseException):
            raise made.outcome
        conformers, failures = made.outcome
        new = [f for f in failures if f.key not in done]
        todo = [(entry, cid, m) for cid, m in conformers if (entry.molecule_id, cid) not in done]
        yield Settled(new, len(conformers) + len(failures) - len(todo) - len(new), expected - len(todo), made.seconds)
        if not todo:
            continue
        bucket = buckets[entry.molecule_id]
        if pending and (bucket is None or bucket != pending_bucket):
            yield Batch(pending)
            pending = []
        pending_bucket = bucket
        pending += todo
        size = sizes[bucket] if bucket is not None else len(pending)  # a molecule without a bucket goes alone
        while len(pending) >= size or (pending and bucket is None):
            yield Batch(pending[:size])
            pending = pending[size:]
    if pending:
        yield Batch(pending)


def supply(inputs: list[Input], source: ConformerSource, done: set, clock: HostClock) -> ConformerSupply:
    """The conformers of each input not done as a whole, made ahead by worker threads (all the cores
    but the one the main thread drives the device from), at most a few dozen molecules ahead."""
    workers = max(1, usable_cores() - 1)
    todo = [entry for entry in inputs if (entry.molecule_id, -1) not in done]
    return ConformerSupply(todo, source.conformers, workers, ahead=4 * workers + 8, clock=clock)
