"""Compiled programs that a new process loads instead of tracing: exported StableHLO on disk.

:func:`compiled` wraps a function like ``jax.jit`` does. The first call with a new signature (its
static arguments, and the shapes and dtypes of the others) traces the function and exports it
(``jax.export``) to the program directory; a later process with the same signature reads the
exported module and runs it without tracing the Python code again (tracing the SCF loop, the
integral kernels and the finalisation is the slow part of a new process's start), and JAX's
persistent compilation cache supplies its compiled code. The directory sits beside JAX's cache
(:func:`pyscf_ipu.runtime.enable_compilation_cache`); where none is set, programs live in memory only.

Every program is traced with full float32 precision in its products (:func:`full_precision`):
left to itself, JAX lets an NVIDIA GPU compute float32 matrix products in TF32, with a 10-bit
mantissa, which no SCF loop survives. An exported module is valid only for the code that made it,
so its key includes a fingerprint of this package's source, the matmul precision, the versions of
jax and jaxlib, the backend, the device count and the x64 mode. A file holds data only, never
pickled objects (:mod:`pyscf_ipu.program_files`): one that cannot be read back (truncated, from an
incompatible jax, or not a program file at all) is exported anew and replaced. Inside a transformation
(``jax.grad`` of the forces) the function is traced as usual.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import re
import stat
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import jax
import numpy as np

from .program_files import ProgramFileError, program_bytes, read_program

PROGRAM_DIRECTORY_SUFFIX = "-programs"
MATMUL_PRECISION = "highest"  # jax.default_matmul_precision of every program: full float32 products
# XLA's CPU options for a program that runs once per batch and briefly (CompiledFunction's
# quick_compile): the older elemental emitters compile such programs faster and run them as fast
# (docs/decisions/quick-compile.md)
QUICK_COMPILE_CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def precision_scope(precision: str):
    """A context in which JAX computes in ``precision`` ("float32" or "float64"): float64 needs JAX's
    64-bit mode, switched on for the block only, never globally."""
    return jax.enable_x64(True) if precision == "float64" else contextlib.nullcontext()


def full_precision(fun):
    """``fun``, traced with every matrix product at full precision (:data:`MATMUL_PRECISION`).

    JAX's default lets a backend pick a faster, lower precision for float32 products (TF32 on NVIDIA
    GPUs, bfloat16 passes on TPUs); a float32 SCF loop needs every bit of float32. The setting holds
    while ``fun`` is traced, so it is written into the program (each dot product's precision
    attribute), whatever the caller's setting.
    """

    @functools.wraps(fun)
    def traced(*args, **kwargs):
        with jax.default_matmul_precision(MATMUL_PRECISION):
            return fun(*args, **kwargs)

    return traced


def over_batch(kernel):
    """``kernel`` (of one conformer) over the leading axis of its array arguments: ``jax.vmap``, except
    that a batch of one runs ``kernel`` itself and adds the axis to its results. XLA's CPU backend
    runs the batched matrix products of a one-member batch up to twice as slow as the plain ones."""

    @functools.wraps(kernel)
    def batched(*args):
        if {leaf.shape[0] for leaf in jax.tree.leaves(args)} == {1}:
            result = kernel(*jax.tree.map(lambda a: a[0], args))
            return jax.tree.map(lambda a: a[None], result)
        return jax.vmap(kernel)(*args)

    return batched


@lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """A hash of every Python file of this package (sorted by path): a new version never loads an
    old version's programs."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def program_directory() -> Path | None:
    """Where serialised programs live: beside JAX's compilation cache directory, or None if unset."""
    cache = jax.config.jax_compilation_cache_dir
    return Path(str(cache).rstrip("/") + PROGRAM_DIRECTORY_SUFFIX) if cache else None


def stable_repr(value) -> str:
    """``repr(value)`` without the memory addresses of functions (the same in every process)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def _signature(leaves) -> tuple:
    out = []
    for leaf in leaves:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            raise TypeError(f"compiled programs take arrays, got {type(leaf).__name__}")
        out.append((tuple(np.shape(leaf)), np.dtype(dtype).name, bool(getattr(leaf, "weak_type", False))))
    return tuple(out)


@dataclass(frozen=True)
class MappingBudget:
    """When a :class:`CompiledFunction` lets go of its compiled programs to stay within the process's
    memory-mapping limit.

    Each compiled program holds its machine code in memory mappings for as long as it is kept,
    against the kernel's limit per process (``vm.max_map_count``; past it LLVM aborts the process).
    Before a function compiles or loads a new program while the process uses more than ``share`` of
    that limit, it drops its own earlier programs; the program directory and JAX's persistent cache
    bring one back cheaply if it returns. Where /proc does not tell, at most ``fallback`` are kept.
    """

    share: float = 0.5
    fallback: int = 3

    def exhausted(self, programs: int) -> bool:
        """Whether a function holding ``programs`` programs should drop them before adding one."""
        mappings = memory_mappings()
        return programs >= self.fallback if mappings is None else mappings[0] > self.share * mappings[1]


def memory_mappings() -> tuple[int, int] | None:
    """(memory mappings this process uses, the kernel's limit), or None where /proc does not say."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return None


class CompiledFunction:
    """A function traced once per signature, its exported programs shared by every process (see
    module doc). With a ``budget``, it drops its in-memory programs when the process runs short of
    memory mappings; without, it keeps them for the process's life. With ``quick_compile`` (a
    program that runs once per batch and briefly), XLA's CPU backend compiles it with
    :data:`QUICK_COMPILE_CPU_OPTIONS`, loaded or exported alike: a new process's first batch waits
    less for it. Inside a transformation it is traced into the caller's program, with the caller's
    options."""

    def __init__(self, fun, static_argnums: int | tuple[int, ...] = (), name: str | None = None,
                 budget: MappingBudget | None = None, quick_compile: bool = False):  # fmt: skip
        self.fun = full_precision(fun)
        self.budget = budget
        self.quick_compile = quick_compile
        self.static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self.name = name or f"{fun.__module__}.{fun.__qualname__}"
        self._jitted = jax.jit(self.fun, static_argnums=self.static_argnums)
        self._programs: dict = {}  # stable key -> (jitted function, output tree)
        self._seen: dict = {}  # the same, by the calls' own static values, trees and dtypes
        self._lock = threading.Lock()
        self.traced = 0  # signatures this process traced and exported (not loaded)
        self.loaded = 0  # signatures this process read from disk
        self.times = ProgramTimes()
        _INSTANCES.add(self)

    def __call__(self, *args):
        static = tuple(args[i] for i in self.static_argnums)
        dynamic = [a for i, a in enumerate(args) if i not in self.static_argnums]
        leaves, tree = jax.tree.flatten(dynamic)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):  # inside a transformation: trace through
            return self._jitted(*args)
        x64 = bool(jax.config.jax_enable_x64)
        # looked up by the arguments' own (hashable) static values, tree and dtypes first: the stable key
        # (reprs and dtype names, which name a program's file) is made on a miss only
        quick = (static, tree, tuple((np.shape(leaf), getattr(leaf, "dtype", None), bool(getattr(leaf, "weak_type", False)))
                                     for leaf in leaves), x64)  # fmt: skip
        program = self._seen.get(quick)
        fresh = False  # the first call compiles (or loads from JAX's cache): its time is the loading's
        start, wall = time.thread_time(), time.perf_counter()
        if program is None:
            key = (stable_repr(static), str(tree), _signature(leaves), x64)
            with self._lock:
                program = self._programs.get(key)
                if program is None:
                    if self.budget is not None and self._programs and self.budget.exhausted(len(self._programs)):
                        self._programs.clear()
                        self._seen.clear()
                    program = self._programs[key] = self._load_or_export(key, static, tree, leaves)
                    fresh = True
                self._seen[quick] = program
        run, out_tree = program
        host = [i for i, leaf in enumerate(leaves) if isinstance(leaf, np.ndarray)]
        if host:  # host arrays copied before the program runs (see on_device); device arrays pass as they are
            for i, copy in zip(host, on_device([leaves[i] for i in host])):
                leaves[i] = copy
        ran, wall_ran = time.thread_time(), time.perf_counter()
        try:
            return out_tree.unflatten(run(*leaves))
        finally:
            now, wall_now = time.thread_time(), time.perf_counter()
            if fresh:
                _THREAD_CLOCK.loading = getattr(_THREAD_CLOCK, "loading", 0.0) + now - start
            else:
                _THREAD_CLOCK.running = getattr(_THREAD_CLOCK, "running", 0.0) + now - ran
            self.times.add(fresh, wall_now - wall, wall_now - wall_ran)

    def clear(self) -> None:
        """Drop this process's compiled programs (the files stay): gives their memory back."""
        with self._lock:
            self._programs.clear()
            self._seen.clear()

    @property
    def signatures(self) -> int:
        """Distinct signatures (programs) this process has run."""
        return len(self._programs)

    def _file(self, key) -> Path | None:
        directory = program_directory()
        if directory is None:
            return None
        text = "\n".join([self.name, repr(key), source_fingerprint(), MATMUL_PRECISION, jax.__version__,
                          jax.lib.__version__, jax.default_backend(), str(jax.device_count())])  # fmt: skip
        digest = hashlib.sha256(text.encode()).hexdigest()[:32]
        return directory / f"{self.short_name}-{digest}.program"

    def _load_or_export(self, key, static, tree, leaves):
        """(a jitted function of the flat arguments, the output's tree), from disk or exported now."""
        from jax import export

        path = self._file(key)
        if path is not None and path.exists():
            try:
                exported, out_tree = read_program(_read_regular_file(path))
                if [(a.shape, a.dtype) for a in exported.in_avals] != [(np.shape(x), x.dtype) for x in leaves] or (
                        len(exported.out_avals) != out_tree.num_leaves):  # fmt: skip
                    raise ProgramFileError("a program file for other arguments or another output")
                self.loaded += 1
                return self._jit(exported), out_tree
            except (OSError, ProgramFileError):  # truncated, from an incompatible jax, or not ours: export anew
                pass
        out_trees = []

        def flat(*flat_leaves):
            arguments = list(tree.unflatten(flat_leaves))
            for position, value in sorted(zip(self.static_argnums, static)):
                arguments.insert(position, value)
            out, out_tree = jax.tree.flatten(self.fun(*arguments))
            out_trees.append(out_tree)
            return out

        exported = export.export(jax.jit(flat))(*leaves)
        self.traced += 1
        if path is not None:
            try:
                data = program_bytes(exported.serialize(), out_trees[0])
            except TypeError:  # an output this package's file format cannot describe: kept in memory only
                data = None
            if data is not None:
                _save_program(path, data)
        return self._jit(exported), out_trees[0]

    def _jit(self, exported):
        """``exported`` as a jitted function, compiled with the options its backend takes for it."""
        quick = self.quick_compile and jax.default_backend() == "cpu"

        def call(*args):
            return exported.call(*args)

        call.__name__ = call.__qualname__ = self.short_name  # what JAX's logs and profiles name the program
        return jax.jit(call, compiler_options=QUICK_COMPILE_CPU_OPTIONS if quick else None)

    @property
    def short_name(self) -> str:
        """The program's name without its module: its file's prefix, and what JAX's logs show."""
        return self.name.rsplit(".", 1)[-1].strip("_<>")


@dataclass
class ProgramTimes:
    """One program's wall seconds in this process: loading, tracing and compiling its signatures (each
    one's first call, counted whole), and its other calls: on a CPU, where a call runs the program,
    its run time; on an accelerator only its dispatch."""

    loads: int = 0
    load_seconds: float = 0.0
    calls: int = 0
    call_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, fresh: bool, whole: float, running: float) -> None:
        with self._lock:
            if fresh:
                self.loads, self.load_seconds = self.loads + 1, self.load_seconds + whole
            else:
                self.calls, self.call_seconds = self.calls + 1, self.call_seconds + running

    def as_list(self) -> list:
        return [self.loads, self.load_seconds, self.calls, self.call_seconds]


# Every CompiledFunction of this process, for :func:`program_times` (module-level programs live as
# long as the process; a weak set lets any other go).
_INSTANCES: weakref.WeakSet = weakref.WeakSet()


def program_times() -> dict[str, list]:
    """Per program that loaded or ran in this process: [signatures loaded or compiled, their seconds,
    other calls, their seconds] (:class:`ProgramTimes`), by the program's short name."""
    out: dict[str, list] = {}
    for program in list(_INSTANCES):
        times = program.times.as_list()
        if times[0] or times[2]:
            previous = out.get(program.short_name, [0, 0.0, 0, 0.0])
            out[program.short_name] = [a + b for a, b in zip(previous, times)]
    return out


# Each thread's CPU seconds inside compiled programs' calls ("running") and in loading, tracing and
# compiling them, their first call included ("loading"): :func:`thread_program_seconds`. Thread-local
# by nature, so one object.
_THREAD_CLOCK = threading.local()


def thread_program_seconds() -> tuple[float, float]:
    """(running, loading): the CPU seconds this thread has spent so far inside compiled programs'
    calls (:class:`CompiledFunction`), and in loading, tracing and compiling them (a program's first
    call, which compiles it, counted whole)."""
    return getattr(_THREAD_CLOCK, "running", 0.0), getattr(_THREAD_CLOCK, "loading", 0.0)


def programs_run_on_caller() -> bool:
    """Whether a compiled program's call runs it on the calling thread (JAX on a CPU without
    asynchronous dispatch, :func:`pyscf_ipu.runtime.reuse_freed_memory`): then the CPU time of the
    call is the program's, not the host's; elsewhere a call only dispatches it."""
    return jax.default_backend() == "cpu" and not jax.config.read("jax_cpu_enable_async_dispatch")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def device_description() -> str:
    """What the programs run on, for the record: the accelerator's name, or the CPU's model and the
    cores this process may use."""
    device, count = jax.devices()[0], jax.device_count()
    if device.platform != "cpu":
        return f"{device.platform}: {device.device_kind}" + (f" x{count}" if count > 1 else "")
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:  # not Linux
        pass
    return f"cpu: {model or platform.machine()} ({usable_cores()} cores)"


def device_memory_bytes() -> int | None:
    """The default device's memory in bytes, where it is an accelerator that says (JAX's
    ``memory_stats``); None on a CPU, whose memory is the host's."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    return (device.memory_stats() or {}).get("bytes_limit")


MAP_SHARE = 0.2  # of an accelerator's memory, what a program's conformers computed together may hold at once


def members_at_once(members: int, member_bytes: int) -> int:
    """How many of a batch's ``members`` conformers a program's per-conformer map computes together
    (:func:`map_members`): one on a CPU, where each conformer's temporaries then stay cache-sized; on
    an accelerator, which needs the parallel work, all of them, or as many as fit :data:`MAP_SHARE`
    of its memory at ``member_bytes`` of temporaries each (at least one)."""
    memory = device_memory_bytes()
    if memory is None:
        return 1
    return int(max(1, min(members, MAP_SHARE * memory // max(member_bytes, 1))))


def map_members(kernel, members, at_once: int):
    """``kernel`` over the leading axis of the pytree ``members``: ``lax.map``, ``at_once`` conformers
    vmapped together (:func:`members_at_once`; one after another at 1)."""
    return jax.lax.map(kernel, members, batch_size=at_once if at_once > 1 else None)


def on_device(tree, may_alias: bool | None = None):
    """``jax.device_put(tree, may_alias=...)``, returned once the copies of its host (numpy) arrays
    are done, so that the programs that read them run on the calling thread; device arrays pass as
    they are, without waiting for the programs that make them.

    XLA's CPU client copies a large host array on one of its own threads, and a program called on
    the copy before it is done runs on that thread once it is: its outputs and temporaries then come
    from that thread's malloc heap, of at most 64 MB, which larger blocks bypass for fresh pages
    every time. Run on the calling thread, a program reuses the memory its last run freed
    (:func:`pyscf_ipu.runtime.reuse_freed_memory`, ``docs/decisions/memory-reuse.md``).
    """
    out = jax.device_put(tree, may_alias=may_alias)
    copies = [o for o, leaf in zip(jax.tree.leaves(out), jax.tree.leaves(tree)) if isinstance(leaf, np.ndarray)]
    jax.block_until_ready(copies)
    return out


def _read_regular_file(path: Path) -> bytes:
    """``path``'s bytes, where it is a regular file and not a link (a FIFO or a device planted under a
    program's name would block or never end); :class:`OSError` otherwise."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(descriptor, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return file.read()


def _save_program(path: Path, data: bytes) -> None:
    """Write a program's ``data`` to ``path`` through a temporary file and a rename (readers never
    see a part); a failure to write (full disk, read-only cache) leaves the program in memory only."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as out:
            temporary = out.name
            out.write(data)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)


def compiled(fun=None, *, static_argnums: int | tuple[int, ...] = (), name: str | None = None,
             budget: MappingBudget | None = None, quick_compile: bool = False):  # fmt: skip
    """Decorator: ``fun`` as a :class:`CompiledFunction` (``@compiled`` or ``@compiled(static_argnums=...)``)."""
    if fun is None:
        return lambda f: CompiledFunction(f, static_argnums, name, budget, quick_compile)
    return CompiledFunction(fun, static_argnums, name, budget, quick_compile)
