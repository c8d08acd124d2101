"""The generator's host side around the device: conformers made ahead by worker threads, batches
prepared, dispatched and read out by threads of their own, committed by one more, and the host's
CPU time, stage by stage.

The device should never wait for the host. RDKit's embedding (or reading a geometry file's frames)
runs on worker threads, ahead of the batch that needs it (:class:`ConformerSupply`; RDKit releases
Python's lock while it embeds); assembling each batch's small inputs, dispatching its programs and
reading its labels out are stages on threads of their own (:func:`run_in_stages`), each a batch
apart; writing a labelled batch to its shard runs on one more thread (:class:`CommitThread`). The
main thread starts them and waits. :class:`HostClock` counts the CPU time each of these spends
outside compiled programs: the figure that says whether a GPU would be kept busy.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from dataclasses import dataclass, field

from pyscf_ipu.programs import programs_run_on_caller, thread_program_seconds

MAIN_THREAD = "main thread"  # the host stage of the thread that starts the labelling threads and waits for them


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


class _Stopped(Exception):
    """Raised inside a stage thread once another thread has failed: it ends without a word."""


def run_in_stages(items: Iterable, stages: Sequence[Callable], weight: Callable = lambda item: 1, alive: int = 2,
                  on_end: Callable[[], None] = lambda: None, serial: bool = False) -> None:  # fmt: skip
    """Pass each of ``items`` through ``stages`` in order, each stage on a thread of its own: stage i
    works on item k while stage i + 1 works on item k - 1, and the calling thread only waits.

    Stage 0 iterates ``items`` (and calls ``on_end`` when it stops, on its own thread); each stage
    hands what it returns to the next; the last stage's return value is dropped. Items in flight are
    bounded by weight: an item takes ``weight(item)`` of ``alive`` tokens as it enters stage 0 and gives
    them back as it leaves the last stage (an item of weight ``alive`` runs alone; one of weight 0
    waits for nothing). The first exception in any stage, or in the calling thread (an interrupt),
    stops every stage after the item in hand; it is raised here once every stage thread has ended.

    ``serial``: one stage works at a time (a lock held while it works), for a device that runs each
    program on the thread that calls it: there the stages would only compete for the same cores, and
    two programs run at once from two threads can deadlock XLA's CPU client."""
    stop, errors = threading.Event(), []
    working = threading.Lock() if serial else contextlib.nullcontext()
    tokens = threading.Semaphore(alive)
    queues = [queue.Queue(maxsize=1) for _ in stages[1:]]  # queues[i] feeds stage i + 1
    end = object()

    def waited(attempt, busy: type[Exception]):  # attempt(timeout=...) until it succeeds or the run stops
        while not stop.is_set():
            try:
                return attempt(timeout=0.05)
            except busy:
                pass
        raise _Stopped

    def hand_on(index: int, value) -> None:  # waits for room in the next stage's queue
        if index < len(queues):
            waited(partial(queues[index].put, value), queue.Full)

    def take(index: int):
        return waited(queues[index - 1].get, queue.Empty)

    def acquire(count: int) -> None:
        for _ in range(count):
            while not stop.is_set() and not tokens.acquire(timeout=0.05):
                pass
            if stop.is_set():
                raise _Stopped

    def passed(index: int, value, taken: int) -> None:  # stage index is done with an item
        hand_on(index, (value, taken))
        if index == len(queues):  # the last stage: the item's tokens come back
            for _ in range(taken):
                tokens.release()

    def first() -> None:
        try:
            for item in items:
                if stop.is_set():
                    raise _Stopped
                taken = min(weight(item), alive)
                acquire(taken)
                with working:
                    value = stages[0](item)
                item = None  # no reference kept while the next item is waited for
                passed(0, value, taken)
                value = None
            hand_on(0, end)
        finally:
            try:
                on_end()
            except BaseException as err:  # noqa: BLE001 - after the error in hand, if any
                errors.append(err)
                stop.set()

    def later(index: int) -> None:
        while (got := take(index)) is not end:
            item, taken = got
            got = None  # no stage keeps a batch (and its device arrays) once it has handed it on
            with working:
                value = stages[index](item)
            item = None
            passed(index, value, taken)
            value = None
        hand_on(index, end)

    def guarded(body, *args) -> None:
        try:
            body(*args)
        except _Stopped:
            pass
        except BaseException as err:  # noqa: BLE001 - raised again on the calling thread
            errors.append(err)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(first,), name="stage-0", daemon=True)]
    threads += [threading.Thread(target=guarded, args=(later, i), name=f"stage-{i}", daemon=True)
                for i in range(1, len(stages))]  # fmt: skip
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()  # an interrupt (KeyboardInterrupt) ends the wait
    except BaseException:
        stop.set()
        while any(thread.is_alive() for thread in threads):  # a second interrupt does not end the wait
            try:
                for thread in threads:
                    thread.join()
            except KeyboardInterrupt:
                pass
        raise
    if errors:
        raise errors[0]
