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
whose conformers mostly fail to converge stops (:class:`ConvergenceWatch`): that is a broken setup,
not hard molecules.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pyscf_ipu.buckets import SizeBucket
from pyscf_ipu.config import COMMAND_LINE_DEFAULTS, IPUConfig, RKSConfig, option
from pyscf_ipu.runtime import default_cache_dir, disable_numpy_huge_pages, enable_compilation_cache, reuse_freed_memory
from pyscf_ipu.forces import nuclear_gradient
from pyscf_ipu.memory import GB, batch_memory, check_budget, default_budget, device_batch, largest_batch
from pyscf_ipu.method import Method, resolve
from pyscf_ipu.padding import fill_batch
from pyscf_ipu.problem import prepare_batch
from pyscf_ipu.molecule import Molecule, MoleculeError
from pyscf_ipu.programs import MATMUL_PRECISION, device_description, device_memory_bytes, usable_cores
from pyscf_ipu.results import SCFResult
from pyscf_ipu.rks import BatchRun, submit_batch

from .conformers import ConformerError, ConformerSource, EmbeddedConformers, FileConformers
from .cores import claim_cores, task_environment
from .inputs import Input, parse_range, parse_shard
from .pipeline import CommitThread, ConformerSupply, HostClock, Supplied
from .schema import Failure, RecordBatch
from .store import ShardWriter, shard_count

EXECUTORS = ("local", "ray")
# The generator's own DFT defaults where they differ from a single point's:
# - QM1B's functional, B3LYP with the VWN5 correlation term (PySCF 2.2's "b3lyp"; since PySCF 2.3
#   "b3lyp" means the VWN-RPA variant, which single points keep as PySCF's default);
# - the JAX integrals, assembled on the device batch by batch, which label a stream of conformers faster
#   than libcint's, cold and restarted (benchmarks/realistic.py), with libcint's density-fitting factor
#   where the device is this CPU (``auto``); a single point keeps libcint's, the reference;
# - and, as ``pyscf-ipu run``, ``--jk auto`` (:func:`pyscf_ipu.config.auto_jk`).
GENERATOR_DFT_DEFAULTS: dict = {**COMMAND_LINE_DEFAULTS, "integrals": "auto", "xc": "b3lyp5"}
# Host stages that a run pays once, not per conformer: compiling or loading its programs, and the
# size buckets' templates.
ONCE_PER_RUN = ("programs", "templates")
AUTO_BATCH_ON_A_CPU = 8  # conformers: a CPU's cores are as busy with 8 as with more
# ... but density fitting's loop (larger bases) keeps both cores busy with one conformer: a batch
# would multiply the memory, not the speed (docs/decisions/jk-auto.md)
AUTO_FITTED_BATCH_ON_A_CPU = 1
# Conformers the convergence watch judges together (or a batch, if larger): four molecules' worth at
# the default 8 conformers, so that one molecule whose conformers all fail cannot stop a run.
CONVERGENCE_WINDOW = 32


@dataclass(frozen=True)
class GenerateConfig:
    """What to generate and how; the DFT settings are a separate :class:`RKSConfig`."""

    smiles: str | None = option(None, "SMILES file (.smi: 'SMILES [id]' per line; or .csv with a smiles column); "
                              "default: the built-in sample of ~100 GDB-like molecules", metavar="FILE")  # fmt: skip
    geometries: str | None = option(None, "label these geometries instead of SMILES: an XYZ file (one frame per "
                                    "conformer, frames of one molecule in a row; QM9's files too), an SDF file, "
                                    "qm9pack's CSV, or a directory of XYZ and SDF files; no RDKit needed",
                                    metavar="FILE")  # fmt: skip
    out: str = option("data/generated", "output directory (one HDF5 file per shard)", metavar="DIR")
    conformers: int = option(8, "RDKit ETKDG conformers per molecule (SMILES input)")
    seed: int = option(1, "seed; each molecule's conformer seed is derived from it (never 0; SMILES input)")
    batch_size: int | None = option(None, "conformers per vmapped DFT batch; auto (the default): 8 on a CPU (1 "
                                    "with --jk df), and on a GPU the most whose arrays fit its memory, up to the "
                                    "size bucket's conformers; either at most what fits --memory-budget",
                                    auto=True)  # fmt: skip
    limit: int | None = option(None, "at most this many molecules (of this shard, after filtering)")
    heavy_atoms: str | None = option(None, "keep molecules with this many heavy atoms, e.g. 9-11")
    relax: str | None = option(None, "force-field relaxation of the conformers (QM1B: none)", choices=("mmff",))
    shard: str = option("0/1", "process shard i of n (i/n), e.g. for job arrays")
    resume: bool = option(False, "continue an interrupted run in --out")
    drop_unconverged: bool = option(False, "drop conformers that did not converge (recorded as failures)")
    min_converged: float = option(0.5, "stop the run (exit code 4) once fewer than this share of the last conformers "
                                  f"converged (at least {CONVERGENCE_WINDOW} of them, or a batch): a broken setup, "
                                  "not hard molecules; 0 never stops (fixed iteration counts)")  # fmt: skip
    forces: bool = option(False, "add a forces column (eV/Bohr, -dE/dR of the energy as computed, exact or density "
                                 "fitted; the SCF continues in float64 to converged orbitals first, --refine-commutator)")  # fmt: skip
    executor: str = option("local", "run in this process, or as many small Ray tasks that free workers pull",
                           choices=EXECUTORS)  # fmt: skip
    ray_address: str | None = option(None, "Ray cluster to join (default: start a local Ray with this "
                                     "machine's cores)", metavar="ADDR")  # fmt: skip
    task_molecules: int = option(4, "molecules per Ray task (--executor ray); each task writes its own shard")
    task_threads: int = option(1, "threads (XLA and OpenMP) and Ray CPUs per task (--executor ray)")
    progress: bool = option(True, "show a progress bar")
    report: str | None = option(None, "also write the run's summary as JSON to this file (counts, seconds, the "
                                "wall and host CPU time by stage)", metavar="FILE")  # fmt: skip
    memory_budget: float | None = option(None, "GB: refuse a run whose largest batch (with the next one prepared "
                                         "beside it) would need more (default: 80%% of this machine's memory)",
                                         metavar="GB")  # fmt: skip

    def __post_init__(self) -> None:
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"--memory-budget is in GB and must be positive, got {self.memory_budget}")
        for name in ("conformers", "batch_size", "task_molecules", "task_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if parse_shard(self.shard) != (0, 1) and self.executor == "ray":
            raise ValueError("--shard and --executor ray do not combine: Ray splits the work itself")
        if self.heavy_atoms is not None:
            parse_range(self.heavy_atoms)
        if not 0 <= self.min_converged <= 1:
            raise ValueError(f"--min-converged is a share of conformers, in [0, 1]; got {self.min_converged}")
        if self.geometries is not None and (self.smiles is not None or self.relax is not None):
            raise ValueError("--geometries labels the file's own geometries: it does not combine with "
                             f"{'--smiles' if self.smiles is not None else '--relax'}")  # fmt: skip

    @property
    def source(self) -> ConformerSource:
        """Where the conformers come from: the geometry file, or RDKit embeddings of the SMILES."""
        if self.geometries is not None:
            return FileConformers(self.geometries)
        return EmbeddedConformers(self.smiles, self.conformers, self.seed, self.relax)


@dataclass
class Summary:
    out: str
    shard: str
    molecules: int = 0
    conformers: int = 0  # written
    converged: int = 0
    labelled: int = 0  # converged or not: written, or dropped as failures (NaN, --drop-unconverged)
    failures: int = 0
    skipped: int = 0  # already done (resume)
    seconds: float = 0.0
    timings: Counter[str] = field(default_factory=Counter)  # seconds per stage, summed
    host: Counter[str] = field(default_factory=Counter)  # the host's CPU seconds per stage (HostClock)
    tasks: int = 0  # Ray tasks summed up here (0: one shard in one process)
    # the batches whose wall time holds no program loading or compiling (neither the batch nor the
    # one dispatched beside it is its size bucket's first): their conformers and seconds
    steady_conformers: int = 0
    steady_seconds: float = 0.0
    method: str = ""  # the basis, J-K backend and batch sizes the run used (:func:`chosen`)

    @property
    def where(self) -> str:
        return f"{self.tasks} Ray tasks" if self.tasks else f"shard {self.shard}"

    @property
    def conformers_per_hour(self) -> float:
        return 3600.0 * self.conformers / self.seconds if self.seconds else 0.0

    @property
    def steady_conformers_per_hour(self) -> float | None:
        """The rate over the batches that load or compile no programs (what a long run approaches);
        None where every batch did."""
        return 3600.0 * self.steady_conformers / self.steady_seconds if self.steady_seconds else None

    def to_dict(self) -> dict:
        """The summary as JSON-able data; ``host_ms_per_conformer`` is the host's CPU time per labelled
        conformer without what a run pays once (:data:`ONCE_PER_RUN`), ``once_seconds`` those."""
        labelled = self.conformers + self.failures
        steady = sum(v for k, v in self.host.items() if k not in ONCE_PER_RUN)
        return {**{k: getattr(self, k) for k in ("out", "shard", "method", "molecules", "conformers", "converged",
                                                   "failures", "skipped", "seconds", "tasks")},
                "conformers_per_hour": self.conformers_per_hour,
                "steady_conformers_per_hour": self.steady_conformers_per_hour, "timings": dict(self.timings),
                "host": dict(self.host), "host_ms_per_conformer": 1000 * steady / labelled if labelled else None,
                "once_seconds": {k: self.host[k] for k in ONCE_PER_RUN if k in self.host}}  # fmt: skip

    def lines(self) -> list[str]:
        rate = self.converged / self.conformers if self.conformers else 0.0
        split = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(self.timings.items(), key=lambda kv: -kv[1]))
        lines = [
            f"{self.out} ({self.where}; {self.method}): {self.conformers} conformers of {self.molecules} molecules "
            f"written, {rate:.1%} converged; {self.failures} failures; {self.skipped} already done",
            f"{self.seconds:.1f}s, {self.conformers_per_hour:,.0f} conformers per hour"
            + (f" ({self.steady_conformers_per_hour:,.0f} in batches that load no programs)" if self.steady_seconds
               else "")
            + f"; time: {split}",
        ]
        labelled = self.conformers + self.failures
        if labelled and self.host:
            per = {k: 1000 * v / labelled for k, v in self.host.items()}
            steady = sum(v for k, v in per.items() if k not in ONCE_PER_RUN)
            lines.append(f"host CPU per conformer: {steady:.1f} ms, and "
                         + ", ".join(f"{k} {per[k]:.1f} ms" for k in ONCE_PER_RUN if k in per)
                         + " (" + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])
                                            if k not in ONCE_PER_RUN) + ")")  # fmt: skip
        return lines


def provenance() -> dict[str, str]:
    """What the labels were computed with, beside their settings: the package versions, the device
    (a GPU's name, or the CPU's model) and the precision of every float32 product."""
    out = {"python": platform.python_version()}
    for name in ("pyscf-ipu", "jax", "jaxlib", "pyscf", "numpy", "rdkit", "h5py"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return {**out, "device": device_description(), "matmul_precision": MATMUL_PRECISION}


def label_settings(gen: GenerateConfig, dft: RKSConfig) -> dict:
    """Everything that defines the labels: a resumed run must use the same."""
    own = {f.name: getattr(dft, f.name) for f in dataclasses.fields(dft) if f.name != "ipu"}
    return {
        **own,
        "refine_commutator": dft.refine_threshold,  # auto (none) and 0 are the same labels
        "jk_strategy": dft.ipu.jk_strategy,  # the simulated IPU's placement options never change a label
        "stop_threshold": dft.stop_threshold,
        **gen.source.settings(),
        "drop_unconverged": gen.drop_unconverged,
        "forces": gen.forces,
        "heavy_atoms": gen.heavy_atoms,
    }


class NotConvergingError(RuntimeError):
    """Most of a run's recent conformers did not converge; the message says what to check."""


@dataclass
class ConvergenceWatch:
    """Stops a run whose conformers mostly fail to converge.

    A sound setup converges nearly every conformer; a run where most of the last ``window`` (or more:
    whole batches) did not points at its setup (float32 products below full precision, a bad basis,
    too few ``--max-iterations``), and labelling on would fill the dataset with unconverged rows.
    The occasional hard conformer never trips it. A whole run, however short, is judged when it ends
    (:meth:`finish`, by :func:`generate` over every shard or Ray task). ``minimum`` 0 switches it off.
    """

    minimum: float
    window: int
    hint: str  # the settings worth checking, for the message
    batches: deque = field(default_factory=deque)  # (conformers labelled, converged) of recent batches

    def add(self, labelled: int, converged: int) -> None:
        """Count a finished batch; :class:`NotConvergingError` if the recent share is below ``minimum``."""
        self.batches.append((labelled, converged))
        while sum(n for n, _ in self.batches) - self.batches[0][0] >= self.window:
            self.batches.popleft()  # the window stays full without its oldest batch
        total, good = (sum(column) for column in zip(*self.batches))
        if total >= self.window and good < self.minimum * total:
            raise self._error(good, f"the last {total}")

    def finish(self, labelled: int, converged: int) -> None:
        """At a run's end, its totals: :class:`NotConvergingError` if its converged share is below
        ``minimum``, however few conformers it labelled."""
        if labelled and converged < self.minimum * labelled:
            raise self._error(converged, f"the {labelled}")

    def _error(self, good: int, which: str) -> NotConvergingError:
        return NotConvergingError(
            f"only {good} of {which} conformers converged (below --min-converged {self.minimum:g}): that points "
            f"at the setup, not the molecules; check {self.hint}; what was committed is kept "
            "(--min-converged 0 labels on regardless)")  # fmt: skip


def batch_sizes(gen: GenerateConfig, method: Method, inputs: list[Input], buckets: dict) -> dict[SizeBucket, int]:
    """The batch size of each size bucket of ``buckets`` (by molecule id): ``--batch-size``, or auto:
    :data:`AUTO_BATCH_ON_A_CPU` on a CPU (:data:`AUTO_FITTED_BATCH_ON_A_CPU` density fitted); on an
    accelerator the largest power of two, up to the bucket's conformers rounded up to one, whose
    arrays (with the next batch's beside them) fit :data:`~pyscf_ipu.memory.DEVICE_SHARE` of its
    memory. Auto never goes above the largest batch that fits the memory budget (nor below one:
    :func:`check_memory` then says what would fit)."""
    conformers = Counter()
    for entry in inputs:
        if buckets[entry.molecule_id] is not None:
            conformers[buckets[entry.molecule_id]] += gen.source.expected(entry)
    if gen.batch_size is not None:
        return {bucket: gen.batch_size for bucket in conformers}
    memory = device_memory_bytes()
    if memory is None:
        cpu = AUTO_FITTED_BATCH_ON_A_CPU if method.config.density_fitted else AUTO_BATCH_ON_A_CPU
        sizes = {bucket: cpu for bucket in conformers}
    else:
        sizes = {bucket: device_batch(bucket, method, count, memory) for bucket, count in conformers.items()}
    budget = gen.memory_budget or default_budget()
    return {bucket: largest_batch(bucket, method, size, budget) or largest_batch(bucket, method, size, budget, ahead=False)
            or 1 for bucket, size in sizes.items()}  # fmt: skip


def prepares_ahead(gen: GenerateConfig, method: Method, sizes: dict[SizeBucket, int]) -> dict[SizeBucket, bool]:
    """Whether each size bucket's batches (of ``sizes``) are prepared while the one before runs: where a
    batch and the next one fit the memory budget together; else each waits for the one before."""
    budget = (gen.memory_budget or default_budget()) * GB
    return {bucket: batch_memory(bucket, method, size, prepared_ahead=size).total <= budget
            for bucket, size in sizes.items()}  # fmt: skip


def check_memory(gen: GenerateConfig, method: Method, sizes: dict[SizeBucket, int]) -> None:
    """:class:`~pyscf_ipu.memory.MemoryBudgetError` if a batch of the largest of the size buckets
    ``sizes`` (bucket: batch size) would need more than the memory budget, even without the next
    batch prepared beside it (:func:`prepares_ahead`); the message gives the largest batch size that fits."""
    largest = max(sizes, key=lambda b: b.nao, default=None)
    if largest is None:
        return
    budget = gen.memory_budget or default_budget()
    size = sizes[largest]
    dft = method.config
    asked = batch_memory(largest, method, size)
    if asked.total <= budget * GB:
        return
    fits = largest_batch(largest, method, size - 1, budget, ahead=False)
    fitted = "" if dft.density_fitted else "--jk df (density fitting: no N^4 array), "
    advice = (f"--batch-size {fits} fits" if fits else
              f"not even a batch of one fits: try {fitted}a smaller basis or, where the machine has the memory, "
              "a larger --memory-budget")  # fmt: skip
    check_budget(asked, budget, f"a batch of {size} conformers of the largest molecules "
                 f"({largest.label()}, {largest.nao} AOs, J-K backend {dft.jk})", advice)


def chosen(dft: RKSConfig, sizes: dict[SizeBucket, int]) -> str:
    """What ``--jk auto`` and ``--batch-size auto`` picked, e.g. ``def2-svp, jk df, batch 1``: the
    progress bar's label and the summary's; the backend is also in the dataset's settings."""
    low, high = min(sizes.values(), default=0), max(sizes.values(), default=0)
    return f"{dft.basis}, jk {dft.jk}, batch {low}" + (f"-{high}" if high != low else "")


def _bucket_order(bucket: SizeBucket | None) -> tuple:
    return (0, "") if bucket is None else (bucket.nao, bucket.label())


def load_inputs(gen: GenerateConfig) -> list[Input]:
    heavy = parse_range(gen.heavy_atoms) if gen.heavy_atoms else None
    return gen.source.inputs(heavy, gen.limit, parse_shard(gen.shard))


@dataclass(frozen=True)
class _Batch:
    """Conformers labelled together: of one molecule or of several of one size bucket."""

    members: list[tuple[Input, int, Molecule]]  # (input, conformer id, conformer)

    @property
    def molecules(self) -> list[Molecule]:
        return [m for _, _, m in self.members]


@dataclass(frozen=True)
class _Settled:
    """Conformers of one input that need no labelling: failures to record and conformers done earlier."""

    failures: list[Failure]
    skipped: int  # conformers already committed or recorded (resume)
    progress: int  # conformers the progress bar advances by
    seconds: float = 0.0  # spent making the input's conformers


def _batches(inputs: list[Input], buckets: dict, source: ConformerSource, done: set, sizes: dict[SizeBucket, int],
             supplied: Iterator[Supplied]) -> Iterator[_Batch | _Settled]:  # fmt: skip
    """Conformer batches still to do, in the inputs' order (grouped by their size ``buckets``, by
    molecule id), and what each input settles without labelling. A batch takes ``sizes[bucket]``
    conformers of one bucket, from one molecule or several; a molecule without a bucket (an element
    the basis lacks) goes alone, to fail as a whole. ``done``: the keys already in the shard;
    ``supplied``: the conformers of each input not done as a whole, in order (:func:`_supply`)."""
    pending: list[tuple[Input, int, Molecule]] = []
    pending_bucket = None
    for entry in inputs:
        expected = source.expected(entry)
        if (entry.molecule_id, -1) in done:
            yield _Settled([], expected, expected)
            continue
        made = next(supplied)
        if isinstance(made.outcome, ConformerError):
            yield _Settled([Failure(entry.description, made.outcome.reason, entry.molecule_id, -1)], 0, expected,
                           made.seconds)  # fmt: skip
            continue
        if isinstance(made.outcome, BaseException):
            raise made.outcome
        conformers, failures = made.outcome
        new = [f for f in failures if f.key not in done]
        todo = [(entry, cid, m) for cid, m in conformers if (entry.molecule_id, cid) not in done]
        yield _Settled(new, len(conformers) + len(failures) - len(todo) - len(new), expected - len(todo), made.seconds)
        if not todo:
            continue
        bucket = buckets[entry.molecule_id]
        if pending and (bucket is None or bucket != pending_bucket):
            yield _Batch(pending)
            pending = []
        pending_bucket = bucket
        pending += todo
        size = sizes[bucket] if bucket is not None else len(pending)  # a molecule without a bucket goes alone
        while len(pending) >= size or (pending and bucket is None):
            yield _Batch(pending[:size])
            pending = pending[size:]
    if pending:
        yield _Batch(pending)


def _supply(inputs: list[Input], source: ConformerSource, done: set, clock: HostClock) -> ConformerSupply:
    """The conformers of each input not done as a whole, made ahead by worker threads (all the cores
    but the one the main thread drives the device from), at most a few dozen molecules ahead."""
    workers = max(1, usable_cores() - 1)
    todo = [entry for entry in inputs if (entry.molecule_id, -1) not in done]
    return ConformerSupply(todo, source.conformers, workers, ahead=4 * workers + 8, clock=clock)


def _labelled(batch: _Batch, results: list[SCFResult], gradients: list[np.ndarray] | None, drop_unconverged: bool
              ) -> tuple[list[tuple], list[np.ndarray] | None, list[Failure]]:  # fmt: skip
    """The batch's conformers that become records, each (SMILES, molecule id, conformer id, conformer,
    result), with their gradients; failures for NaN labels or forces, and for dropped ones."""
    rows, kept_gradients, failures = [], [], []
    for k, ((entry, cid, molecule), r) in enumerate(zip(batch.members, results)):
        labels = np.array([r.energy, r.homo, r.lumo, r.gap, r.energy_std_ev])
        if gradients is not None and not np.all(np.isfinite(gradients[k])):
            failures.append(Failure(entry.description, "NaN force", entry.molecule_id, cid))
        elif not np.all(np.isfinite(labels)):
            failures.append(Failure(entry.description, "NaN label", entry.molecule_id, cid))
        elif drop_unconverged and not r.converged:
            failures.append(Failure(entry.description, "not converged (--drop-unconverged)", entry.molecule_id, cid))
        else:
            rows.append((entry.smiles, entry.molecule_id, cid, molecule, r))
            if gradients is not None:
                kept_gradients.append(gradients[k])
    return rows, None if gradients is None else kept_gradients, failures


@dataclass
class _Ledger:
    """The one place a run's outcomes go: committed to the shard (by the commit thread), counted in the
    summary, shown on the progress bar and judged by the convergence watch."""

    commits: CommitThread  # of (records' rows, their seconds, gradients, failures)
    summary: Summary
    bar: object  # a tqdm progress bar
    watch: ConvergenceWatch
    drop_unconverged: bool  # unconverged conformers become failures instead of records
    last_commit: float  # when the last batch was handed over: a record's seconds are its share since

    def settle(self, settled: _Settled) -> None:
        if settled.failures:
            self.commits.put(([], 0.0, None, settled.failures))
        self.summary.failures += len(settled.failures)
        self.summary.skipped += settled.skipped
        self.summary.timings["conformers"] += settled.seconds
        self.bar.update(settled.progress)

    def label(self, batch: _Batch, results: list[SCFResult], gradients: list[np.ndarray] | None,
              forces_seconds: float, steady: bool) -> None:  # fmt: skip
        """Hand a labelled batch to the commit thread: its records (their seconds the generator's wall
        time since the last batch, failed conformers' time included) and its failures. ``steady``:
        that time holds no program loading or compiling (the summary's steady rate counts it)."""
        for result in results:  # host preparation, transfer, waiting for the device, finalisation
            self.summary.timings.update(result.timings)
        if gradients is not None:
            self.summary.timings["forces"] += forces_seconds
        now = time.perf_counter()
        rows, gradients, failures = _labelled(batch, results, gradients, self.drop_unconverged)
        self.commits.put((rows, now - self.last_commit, gradients, failures))
        if steady:
            self.summary.steady_conformers += len(batch.members)
            self.summary.steady_seconds += now - self.last_commit
        self.last_commit = now
        self.summary.conformers += len(rows)
        self.summary.converged += sum(bool(r.converged) for *_, r in rows)
        self.summary.labelled += len(results)
        self.summary.failures += len(failures)
        self.bar.update(len(batch.members))
        self.watch.add(len(results), sum(r.converged and np.isfinite(r.energy) for r in results))


def _committer(writer: ShardWriter):
    """The commit thread's work: a batch's records built from its rows, and committed with its failures."""
    def commit(item) -> None:
        rows, seconds, gradients, failures = item
        writer.commit(RecordBatch.from_results(rows, seconds, gradients) if rows else None, failures)

    return commit


def _results(batch: _Batch, run: BatchRun, method: Method, forces: bool, clock: HostClock
             ) -> tuple[list[SCFResult], list[np.ndarray] | None, float]:  # fmt: skip
    """The batch's results (its filling members' dropped), the gradients where ``forces`` asks for
    them (with the grid's response: the exact derivative of the stored energy), and their seconds."""
    with clock.stage("results"):
        results = run.results()[: len(batch.members)]
    if not forces:
        return results, None, 0.0
    t = time.perf_counter()
    with clock.stage("forces"):
        gradients = [nuclear_gradient(m, r, method.functional, grid_response=True)
                     for m, r in zip(batch.molecules, results)]  # fmt: skip
    return results, gradients, time.perf_counter() - t


def input_buckets(gen: GenerateConfig, dft: RKSConfig, inputs: list[Input]) -> dict[int, SizeBucket | None]:
    """Each input's size bucket by molecule id (None: RDKit cannot read it, or the basis lacks an element)."""
    return {m.molecule_id: gen.source.bucket(m, dft.basis, dft.grid_level, dft.occupied_step) for m in inputs}


def run_shard(gen: GenerateConfig, dft: RKSConfig) -> Summary:
    """Generate one shard (``--shard i/n``) in this process: the ``local`` executor."""
    shard, num_shards = parse_shard(gen.shard)
    inputs = load_inputs(gen)
    return label_molecules(gen, dft, inputs, input_buckets(gen, dft, inputs), (shard, num_shards), gen.resume)


def label_molecules(gen: GenerateConfig, dft: RKSConfig, inputs: list[Input], buckets: dict[int, SizeBucket | None],
                    shard: tuple[int, int], resume: bool) -> Summary:  # fmt: skip
    """Label ``inputs`` (of the size ``buckets`` by molecule id) into shard ``shard`` = (i, n) of
    ``gen.out``, continuing what it holds if ``resume``: a local run, and each Ray task.
    :class:`NotConvergingError` once most recent conformers fail to converge
    (:class:`ConvergenceWatch`), after what was committed is merged.

    The conformers are made ahead by worker threads and the batches committed by a thread of their
    own (:mod:`qm1b.pipeline`); the main thread assembles batch k + 1's inputs and dispatches its
    programs before it reads batch k's labels, so that an accelerator always has the next batch."""
    from tqdm import tqdm

    start = time.perf_counter()
    if gen.forces:  # forces need converged orbitals: the float64 refinement's auto
        dft = dft.for_forces()
    enable_compilation_cache(default_cache_dir() / "jax")
    disable_numpy_huge_pages()
    clock = HostClock()
    with clock.stage("templates"):
        method = resolve(dft)
        sizes = batch_sizes(gen, method, inputs, buckets)
        check_memory(gen, method, sizes)
        ahead = prepares_ahead(gen, method, sizes)
        method.integrals.prepare_buckets(sizes, {s for entry in inputs for s in gen.source.symbols(entry)})
    source = gen.source
    shard, num_shards = shard
    inputs = sorted(inputs, key=lambda m: (_bucket_order(buckets[m.molecule_id]), m.molecule_id))
    summary = Summary(out=gen.out, shard=f"{shard}/{num_shards}", molecules=len(inputs), method=chosen(dft, sizes))
    versions = provenance()
    watch = convergence_watch(gen, dft, max(sizes.values(), default=1), versions["device"])
    stop = None
    with ShardWriter(gen.out, shard, num_shards, settings=label_settings(gen, dft), versions=versions,
                     resume=resume, ignored_settings=IPUConfig.PLACEMENT) as writer:  # fmt: skip
        for path, aside in writer.set_aside:
            print(f"qm1b: {path} could not be read; set aside as {aside.name}, its rows are computed again",
                  file=sys.stderr)
        bar = tqdm(total=sum(source.expected(m) for m in inputs), unit="conf", disable=not gen.progress,
                   smoothing=0.1, desc=summary.method)  # fmt: skip
        commits = CommitThread(_committer(writer), clock)
        inflight: tuple[_Batch, BatchRun, bool] | None = None  # and whether it was its bucket's first
        started: set = set()  # the size buckets whose programs are loaded
        done = writer.done()
        supply = iter(_supply(inputs, source, done, clock))  # a generator: its workers start at its first item
        try:
            ledger = _Ledger(commits, summary, bar, watch, gen.drop_unconverged, time.perf_counter())
            for item in _batches(inputs, buckets, source, done, sizes, supply):
                if isinstance(item, _Settled):
                    ledger.settle(item)
                    continue
                bucket = buckets[item.members[0][0].molecule_id]
                if inflight is not None and not ahead.get(bucket, True):  # the two would not fit together
                    ledger.label(inflight[0], *_results(*inflight[:2], method, gen.forces, clock), steady=not inflight[2])
                    inflight = prepared = run = None  # its arrays freed before the next batch's are made
                try:  # a short batch is filled up: every batch of a size bucket then runs the same programs
                    with clock.stage("inputs"):
                        molecules = fill_batch(item.molecules, sizes[bucket] if bucket is not None else len(item.members))
                        prepared = prepare_batch(molecules, method)
                except MoleculeError as err:  # e.g. an element the basis lacks: the whole molecule fails
                    entries = {e.molecule_id: e for e, _, _ in item.members}
                    ledger.settle(_Settled([Failure(e.description, str(err), e.molecule_id, -1) for e in entries.values()],
                                           0, len(item.members)))  # fmt: skip
                    continue
                first = bucket not in started  # its programs are loaded or compiled as it is dispatched
                started.add(bucket)
                with clock.stage("dispatch"):
                    run = submit_batch(prepared, method)
                if inflight is not None:  # the device worked on it while this batch was prepared
                    ledger.label(inflight[0], *_results(*inflight[:2], method, gen.forces, clock),
                                 steady=not (first or inflight[2]))  # fmt: skip
                inflight = (item, run, first)
            if inflight is not None:
                ledger.label(inflight[0], *_results(*inflight[:2], method, gen.forces, clock), steady=not inflight[2])
        except NotConvergingError as err:
            stop = err  # the shard closes as usual below: what was committed is merged and kept
        except BaseException:
            supply.close()  # its workers stop after the conformers they are making
            commits.close(raise_error=False)  # what was queued is committed; the error in hand is the one to tell
            raise
        commits.close()
        bar.close()
    summary.seconds = time.perf_counter() - start
    summary.host.update(clock.seconds)
    if stop is not None:
        raise stop
    return summary


class ClusterLostError(RuntimeError):
    """The Ray cluster lost a process that the run needs (a raylet, a node, a worker past its retries)."""


def _what_died(err: Exception) -> str:
    """One line naming what a Ray error says died, with Ray's own first line."""
    import ray.exceptions as errors

    kinds = [(errors.LocalRayletDiedError, "this node's raylet (Ray's process that runs the tasks here)"),
             (errors.NodeDiedError, "a node"), (errors.WorkerCrashedError, "a task's worker, past its retries"),
             (errors.ObjectLostError, "a task's result")]  # fmt: skip
    what = next((text for kind, text in kinds if isinstance(err, kind)), "a process it needs")
    detail = (str(err).strip().splitlines() or [""])[0]
    return f"the Ray cluster lost {what} ({type(err).__name__}: {detail})"


def ray_tasks(gen: GenerateConfig, molecules: int) -> int:
    """How many tasks a Ray run splits its molecules into: as many as ``gen.out`` already holds shards
    of (a resumed run keeps its split, so no molecule changes task), else one per ``task_molecules``."""
    if gen.resume and (existing := shard_count(gen.out)):
        return existing
    return max(1, -(-molecules // gen.task_molecules))


def _ray_task(gen: GenerateConfig, dft: RKSConfig, inputs: list[Input], buckets: dict, shard: tuple[int, int]) -> Summary:
    """One Ray task: claim ``gen.task_threads`` cores of the node for this worker and set up its
    memory reuse (both before JAX starts), then label ``inputs`` into their shard, continuing what
    an earlier attempt committed."""
    claim_cores(gen.task_threads)
    reuse_freed_memory()
    return label_molecules(gen, dft, inputs, buckets, shard, resume=True)


def run_ray(gen: GenerateConfig, dft: RKSConfig) -> list[Summary]:
    """The molecules as many small Ray tasks, which free workers pull: task k labels the molecules with
    ``molecule_id % n == k`` into shard k of n. A task whose worker died is run again by Ray and
    continues its shard from what it had committed. One progress bar and one summary for the run."""
    import ray
    from tqdm import tqdm

    start = time.perf_counter()
    source, inputs = gen.source, load_inputs(gen)
    if not gen.resume and shard_count(gen.out):
        raise FileExistsError(f"{gen.out} already holds a dataset: pass --resume to continue it, or choose another --out")
    buckets = input_buckets(gen, dft, inputs)
    method = resolve(dft)
    sizes = batch_sizes(gen, method, inputs, buckets)
    check_memory(gen, method, sizes)  # each task's batches
    picked = chosen(dft, sizes)
    n = ray_tasks(gen, len(inputs))
    chunks = [[m for m in inputs if m.molecule_id % n == k] for k in range(n)]
    ray.init(address=gen.ray_address, ignore_reinit_error=True, log_to_driver=False)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    task = ray.remote(_ray_task).options(num_cpus=gen.task_threads, num_gpus=gpus, max_retries=3,
                                         runtime_env={"env_vars": task_environment(gen.task_threads)})
    quiet = dataclasses.replace(gen, progress=False)
    # the output was checked above, so every task resumes its shard: a retried task continues it
    pending = {task.remote(quiet, dft, chunk, {m.molecule_id: buckets[m.molecule_id] for m in chunk}, (k, n)):
               sum(map(source.expected, chunk)) for k, chunk in enumerate(chunks) if chunk}  # fmt: skip
    summaries = []
    with tqdm(total=sum(pending.values()), unit="conf", disable=not gen.progress, smoothing=0.1,
              desc=picked) as bar:
        while pending:
            try:
                (ready,), _ = ray.wait(list(pending), num_returns=1)
                summaries.append(ray.get(ready))
            except ray.exceptions.RayTaskError as err:  # the task's own error (a full disk, ...), not Ray's wrapping
                raise err.cause from None
            except ray.exceptions.RayError as err:  # Ray itself lost a process the run needs
                raise ClusterLostError(_what_died(err)) from None
            bar.update(pending.pop(ready))
    total = Summary(out=gen.out, shard=gen.shard, seconds=time.perf_counter() - start, tasks=len(summaries),
                    method=picked)  # fmt: skip
    for s in summaries:
        for name in ("molecules", "conformers", "converged", "labelled", "failures", "skipped", "steady_conformers",
                     "steady_seconds"):  # the steady rate so summed is a task's, not the cluster's  # fmt: skip
            setattr(total, name, getattr(total, name) + getattr(s, name))
        total.timings.update(s.timings)
        total.host.update(s.host)
    return [total]


def generate(gen: GenerateConfig, dft: RKSConfig) -> list[Summary]:
    """Run the generator with the configured executor; :class:`NotConvergingError` once it has
    ended (what it labelled is kept) if its converged share is below ``--min-converged``."""
    summaries = run_ray(gen, dft) if gen.executor == "ray" else [run_shard(gen, dft)]
    labelled, converged = (sum(getattr(s, name) for s in summaries) for name in ("labelled", "converged"))
    # the watch (which names the device) built only for a run that fails: asking JAX for the device
    # would start its backend in a Ray driver, on a GPU node taking that GPU's memory
    if labelled and converged < gen.min_converged * labelled:
        convergence_watch(gen, dft, 1, provenance()["device"]).finish(labelled, converged)
    return summaries


def convergence_watch(gen: GenerateConfig, dft: RKSConfig, batch: int, device: str) -> ConvergenceWatch:
    """The run's :class:`ConvergenceWatch`, for batches of up to ``batch`` conformers on ``device``."""
    return ConvergenceWatch(gen.min_converged, max(CONVERGENCE_WINDOW, batch),
                            f"--max-iterations ({dft.max_iterations}), --basis ({dft.basis}), --precision "
                            f"({dft.precision}) and the device ({device})")  # fmt: skip


__all__ = ["ClusterLostError", "GenerateConfig", "NotConvergingError", "Summary", "generate", "label_molecules",
           "run_ray", "run_shard"]
