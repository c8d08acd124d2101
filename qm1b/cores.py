"""CPU budgets for tasks that share a node: each worker process claims its own cores.

XLA's CPU client sizes its thread pool from the cores the process may run on, and neither its
flags nor the OpenMP/BLAS variables change that; restricting the process's CPU affinity before
JAX starts does. A node's workers share it through slots: slot i is cores [i t, (i + 1) t) of
those the node allows, and a worker holds an exclusive ``flock`` on the slot's file in the
temporary directory for as long as it lives (the kernel releases it when the worker dies), so
concurrent workers never pin the same cores.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import IO


def task_environment(threads: int) -> dict[str, str]:
    """Environment variables of a task's worker: ``threads`` OpenMP threads (PySCF's parallel loops)
    and one BLAS thread, read when those libraries load, so set before the worker starts."""
    return {"OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def claim_cores(threads: int, slots_dir: Path | None = None) -> tuple[int, ...]:
    """Pin this process to a free slot of ``threads`` cores and return them; () when every slot is
    taken (more workers than the node has cores for: the process keeps its affinity). Call it before
    JAX runs anything; later calls in the same process return the same slot."""
    return _claim(threads, slots_dir or Path(tempfile.gettempdir()) / f"qm1b-core-slots-{os.getuid()}")[0]


@lru_cache(maxsize=None)
def _claim(threads: int, folder: Path) -> tuple[tuple[int, ...], IO | None]:
    """(cores, the open slot file that holds the lock): cached, so the lock lives as long as the process."""
    allowed = sorted(os.sched_getaffinity(0))
    folder.mkdir(parents=True, exist_ok=True)
    for slot in range(len(allowed) // threads):
        cores = allowed[slot * threads : (slot + 1) * threads]
        handle = open(folder / f"cores-{cores[0]}-{cores[-1]}.lock", "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        os.sched_setaffinity(0, cores)
        return tuple(cores), handle
    return (), None
