"""``qm1b warm``: a run's programs built before the run, and shipped between machines.

A generator run traces and compiles each size bucket's programs when that bucket's first batch
comes up; a cold run of a few buckets spends most of its first minutes there. :func:`warm` does
that work ahead, for the run that the same options would start: it labels one batch of each size
bucket of the inputs (the first molecule of the bucket whose conformers embed, filled up to the
bucket's batch size, exactly as the run fills a batch) through the run's own programs and keeps
nothing but the programs, in the cache a later run reads (``$PYSCF_IPU_CACHE``). Its batch sizes
are the run's, decided from all of the inputs, so the programs are the ones a local run will ask
for. Not covered: a Ray run's tasks, which decide batch sizes from their own molecules (on an
accelerator, fewer conformers may mean narrower batches), and the programs that host-side
gradients (``--forces`` on a CPU) compile per composition of a bucket, beyond the first molecule's.

:func:`pyscf_ipu.program_archive.pack` and ``unpack`` turn such a cache into one file and back, for
machines of one kind (a cluster's nodes, a user's download); the archive's manifest says what it
was built for, and a machine it does not suit refuses it.
"""

from __future__ import annotations

import errno
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pyscf_ipu.gradients import gradient_source
from pyscf_ipu.optimize import relax
from pyscf_ipu.padding import fill_batch
from pyscf_ipu.problem import prepare_batch
from pyscf_ipu.program_archive import Packed, pack
from pyscf_ipu.resolution import resolve
from pyscf_ipu.rks import submit_batch
from pyscf_ipu.runtime import default_cache_dir, enable_compilation_cache

from .batching import batch_sizes, bucket_order, check_memory, chosen
from .conformers import ConformerError
from .settings import Run


@dataclass(frozen=True)
class Warmed:
    """What :func:`warm` built: each size bucket's label and batch size, the buckets none of whose
    molecules gave a conformer (their programs are left to the run), the seconds and the cache."""

    method: str
    buckets: list[tuple[str, int]]
    skipped: list[str]
    seconds: float
    cache: Path

    def lines(self) -> list[str]:
        count = len(self.buckets)
        out = [f"{self.method}: programs of {count} size bucket{'s' * (count != 1)} ready in {self.cache} "
               f"({self.seconds:.1f}s)"]  # fmt: skip
        out += [f"  {label}: batches of {size}" for label, size in self.buckets]
        out += [f"  {label}: no molecule gave a conformer; its programs are built by the run" for label in self.skipped]
        return out


def warm(run: Run, cache: Path | None = None, progress: bool = True) -> Warmed:
    """Build the programs that ``run`` will need, one batch per size bucket of its inputs, into
    ``cache`` (default: the run's, ``$PYSCF_IPU_CACHE``). Labels are computed and discarded. Once per
    process: JAX fixes its persistent cache's directory at its first compile. An OSError naming the
    cache if it cannot be made (where a run would go on without one)."""
    import jax
    from tqdm import tqdm

    start = time.perf_counter()
    cache = Path(cache) if cache is not None else default_cache_dir()
    enabled = enable_compilation_cache(cache / "jax")
    if jax.config.jax_compilation_cache_dir != str(enabled):
        raise OSError(errno.EACCES, "cannot make the program cache there", str(cache))
    method = resolve(run.dft, run.budget_gb)
    inputs = run.inputs()
    buckets = run.buckets(method, inputs)
    sizes = batch_sizes(run, method, inputs, buckets)
    check_memory(run, method, sizes)
    method.integrals.prepare_buckets(sizes, {s for entry in inputs for s in run.source.symbols(entry)})
    built, skipped = [], []
    for bucket in tqdm(sorted(sizes, key=bucket_order), unit="bucket", disable=not progress, desc="warm"):
        width = sizes[bucket]
        molecules = _first_conformers(run, [e for e in inputs if buckets[e.molecule_id] == bucket], width)
        if not molecules:
            skipped.append(bucket.label())
            continue
        molecules = fill_batch(molecules, width)  # as the run fills its batches: a full one's programs
        if run.gen.relaxes:  # one optimiser step per conformer: every program of a relaxation's step
            relax(molecules, method, max_steps=1, width=width, workers=0)
        else:
            _label_once(molecules, method, run.gen.forces)
        built.append((bucket.label(), width))
    return Warmed(chosen(run.dft, sizes), built, skipped, time.perf_counter() - start, cache)


def _first_conformers(run: Run, entries: list, width: int) -> list:
    """Up to ``width`` conformers of the first of ``entries`` whose conformers can be made."""
    for entry in entries:
        try:
            conformers, _ = run.source.conformers(entry)
        except ConformerError:
            continue
        if conformers:
            return [molecule for _, molecule in conformers[:width]]
    return []


def _label_once(molecules: list, method, forces: bool) -> None:
    """One batch through the generator's programs (``qm1b.generate``'s stages in a row), with its
    gradients where the run stores forces."""
    dispatched = submit_batch(prepare_batch(molecules, method), method)
    pending = gradient_source(method).dispatch(dispatched, method, [True] * len(molecules)) if forces else None
    results = dispatched.results()
    if pending is not None:
        pending.gradients(results)


def warm_and_pack(run: Run, path: Path, progress: bool = True) -> tuple[Warmed, Packed]:
    """:func:`warm` into a cache of its own (a temporary directory beside ``path``, on the disk the
    archive goes to), so that the archive ``path`` holds exactly the run's programs, then
    :func:`~pyscf_ipu.program_archive.pack` it; the programs are installed in the run's cache too."""
    from pyscf_ipu.program_archive import unpack

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".qm1b-warm-", dir=Path(path).parent) as scratch:
        warmed = warm(run, Path(scratch), progress)
        packed = pack(Path(scratch), path, {"settings": run.label_settings(), "method": warmed.method,
                                            "buckets": [label for label, _ in warmed.buckets]})  # fmt: skip
        unpack(path, default_cache_dir())
    return replace(warmed, cache=default_cache_dir()), packed
