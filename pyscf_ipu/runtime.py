"""Process set-up for the command-line entry points, the generator and Ray tasks.

Each function changes the whole process (JAX's compilation cache, numpy's huge pages, glibc's
allocator), so none of them runs at import: the entry points call them, once, before they compute.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Where the persistent JAX compilation cache lives: $PYSCF_IPU_CACHE or ~/.cache/pyscf-ipu."""
    return Path(os.environ.get("PYSCF_IPU_CACHE", Path.home() / ".cache" / "pyscf-ipu"))


def enable_compilation_cache(path: str | Path | None = None) -> Path:
    """Turn on JAX's persistent compilation cache, so a new process does not recompile.

    Every program is kept, however quickly it compiled: below JAX's default threshold (1 s) a
    program compiled again in every new process. XLA's own extra caches, which JAX would switch on
    beside it (a GPU's autotuning results), stay off: JAX writes their directory, under this one,
    into every compiled program's key, so a cache moved to another path (another user's home, a
    node of a cluster, an unpacked archive of programs) would never hit
    (``docs/decisions/relocatable-cache.md``). Called by the command-line entry points and the
    tests, never at import. A cache directory that cannot be made (a read-only shared cache without
    it) leaves the cache off: the run compiles what it needs and stores nothing.
    """
    import jax

    cache = Path(path) if path is not None else default_cache_dir() / "jax"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        return cache
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_enable_xla_caches", "")
    return cache


def disable_numpy_huge_pages() -> bool:
    """Stop numpy from asking the kernel for transparent huge pages for its large arrays.

    With the kernel's THP in ``madvise`` mode (common on cloud VMs), numpy's ``madvise(MADV_HUGEPAGE)``
    on every large allocation makes first writes to fresh arrays several times slower, and host
    preparation allocates such arrays for every batch (``docs/decisions/numpy-huge-pages.md``). This is numpy's documented
    ``NUMPY_MADVISE_HUGEPAGE=0``, applied after numpy is imported; it changes the process, so only
    the command-line entry points and the generator call it, never an import. Returns False when
    this numpy has no such switch.
    """
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 moved np.core to np._core
    switch = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if switch is None:
        return False
    switch(False)
    return True


MMAP_THRESHOLD = 2**30  # bytes: smaller blocks come from the allocating thread's heap
TRIM_THRESHOLD = 2**31 - 1  # bytes of free memory a heap keeps (mallopt takes a C int)


def reuse_freed_memory() -> bool:
    """Let each run of a compiled program reuse the memory of the last; call it before JAX runs
    anything (XLA's CPU client reads the dispatch setting when it starts).

    XLA's CPU runtime allocates the arrays of a batch (AO values, the J-K row blocks, each program's
    temporaries: tens of MB) anew every time it runs a program. By default glibc gives every block
    above its mmap threshold (at most 32 MB) fresh pages from the kernel and hands them back when it
    is freed, so each run writes those arrays into new pages, which the kernel faults in 4 KB at a
    time (``docs/decisions/memory-reuse.md``). Two settings keep them instead:

    - glibc's mmap threshold above any one array, and a trim threshold that keeps freed memory, so
      a freed block stays in its thread's heap for the next allocation;
    - XLA's CPU programs run on the thread that calls them (``jax_cpu_enable_async_dispatch``
      off): the main thread's heap grows without limit, while XLA's own threads, which otherwise
      allocate some of a program's blocks, have heaps of at most 64 MB, which larger blocks bypass.

    The process then keeps its peak memory. It changes the process, so only the command-line entry
    points and Ray tasks call it, never an import. Returns False where the C library is not glibc or
    glibc refuses a setting (the dispatch is then left alone); True once every setting holds.
    """
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    # M_MMAP_THRESHOLD and M_TRIM_THRESHOLD (malloc.h); mallopt returns 1 on success
    if mallopt(-3, MMAP_THRESHOLD) != 1 or mallopt(-1, TRIM_THRESHOLD) != 1:
        return False
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True
