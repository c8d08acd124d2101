"""The generator's host side around the device: conformers made ahead by worker threads, batches
committed by a thread of their own, and the host's CPU time, stage by stage.

The device should never wait for the host. RDKit's embedding (or reading a geometry file's frames)
runs on worker threads, ahead of the batch that needs it (:class:`ConformerSupply`; RDKit releases
Python's lock while it embeds); writing a labelled batch to its shard runs on one more thread
(:class:`CommitThread`); the main thread only assembles each batch's small inputs, dispatches its
programs and reads its labels out. :class:`HostClock` counts the CPU time each of these spends
outside compiled programs: the figure that says whether a GPU would be kept busy.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from pyscf_ipu.programs import programs_run_on_caller, thread_program_seconds


@dataclass
class HostClock:
    """The host's CPU seconds by stage, from every thread that works for the run.

    A stage's time is its thread's CPU time (``time.thread_time``), less what the thread spent
    running compiled programs where a call runs its program on the calling thread (JAX on a CPU,
    synchronously); loading, tracing and compiling programs is host work, under ``programs``.
    Worker threads add their own seconds (:meth:`add`). Time spent waiting costs no CPU time.
    """

    seconds: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def stage(self, name: str):
        """Count the calling thread's host CPU time in the block as ``name``."""
        subtract = programs_run_on_caller()
        cpu, (running, loading) = time.thread_time(), thread_program_seconds()
        try:
            yield
        finally:
            now_running, now_loading = thread_program_seconds()
            spent = time.thread_time() - cpu - (now_loading - loading) - (now_running - running if subtract else 0.0)
            self.add(name, spent)
            self.add("programs", now_loading - loading)

    def add(self, name: str, seconds: float) -> None:
        if seconds:
            with self._lock:
                self.seconds[name] += seconds


@dataclass(frozen=True)
class Supplied:
    """One input's conformers as a worker made them: ``outcome`` is what ``make(entry)`` returned, or
    the exception it raised; ``seconds`` its wall time."""

    entry: object
    outcome: object
    seconds: float


class ConformerSupply:
    """``make(entry)`` of each of ``entries``, run on ``workers`` threads ahead of the consumer, handed
    out in order: at most ``ahead`` entries are made before they are asked for. Each worker's CPU
    time goes to ``clock`` under ``stage``. Exceptions are handed out as outcomes, not raised."""

    def __init__(self, entries: Iterable, make: Callable, workers: int, ahead: int, clock: HostClock,
                 stage: str = "conformers"):  # fmt: skip
        self._entries, self._make, self._clock, self._stage = iter(entries), make, clock, stage
        self._ahead = max(1, ahead)
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="conformers")

    def _run(self, entry) -> Supplied:
        cpu, start = time.thread_time(), time.perf_counter()
        try:
            outcome = self._make(entry)
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which knows what fails
            outcome = err
        self._clock.add(self._stage, time.thread_time() - cpu)
        return Supplied(entry, outcome, time.perf_counter() - start)

    def __iter__(self) -> Iterator[Supplied]:
        pending = []
        try:
            for entry in self._entries:
                pending.append(self._pool.submit(self._run, entry))
                if len(pending) >= self._ahead:
                    yield pending.pop(0).result()
            while pending:
                yield pending.pop(0).result()
        finally:
            for future in pending:
                future.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)


class CommitThread:
    """Runs ``commit(item)`` for each :meth:`put` item on a thread of its own, in order, with at most
    one item waiting: a crash loses at most the batch being committed and the one waiting (committed
    work is published atomically, see :mod:`qm1b.store`). The first exception in ``commit`` stops
    every later commit (nothing is written out of order after a failure) and is raised once, by the
    next :meth:`put` or by :meth:`close`."""

    def __init__(self, commit: Callable, clock: HostClock, stage: str = "write"):
        self._commit, self._clock, self._stage = commit, clock, stage
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(target=self._loop, name="commit", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    cpu = time.thread_time()
                    self._commit(item)
                    self._clock.add(self._stage, time.thread_time() - cpu)
                except BaseException as err:  # noqa: BLE001 - raised again on the main thread
                    self._error = err

    def _raise(self) -> None:
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    def put(self, item) -> None:
        """Queue ``item`` (waits while one is queued already); raise the thread's error, if any."""
        self._raise()
        self._queue.put(item)

    def close(self, raise_error: bool = True) -> None:
        """Wait for every queued item to be committed; raise the thread's error, if any and if
        ``raise_error`` (not while another exception is on its way out)."""
        self._queue.put(None)
        self._thread.join()
        if raise_error:
            self._raise()
