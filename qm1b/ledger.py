"""The ledger: the one place a run's outcomes go. Each labelled batch becomes records or failures
(:func:`labelled`), is handed to the commit thread (:func:`committer` writes it to the shard),
counted in the summary, shown on the progress bar and judged by the convergence watch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pyscf_ipu.optimize import Relaxation
from pyscf_ipu.results import SCFResult

from .batching import Batch, Settled
from .inputs import Input
from .pipeline import CommitThread
from .schema import Failure, RecordBatch
from .store import ShardWriter
from .summary import Summary
from .watch import ConvergenceWatch


def labelled(batch: Batch, results: list[SCFResult], gradients: list[np.ndarray] | None, drop_unconverged: bool
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
class Ledger:
    """The one place a run's outcomes go: committed to the shard (by the commit thread), counted in the
    summary, shown on the progress bar and judged by the convergence watch."""

    commits: CommitThread  # of Commit
    summary: Summary
    bar: object  # a tqdm progress bar
    watch: ConvergenceWatch
    drop_unconverged: bool  # unconverged conformers become failures instead of records
    last_commit: float  # when the last batch was handed over: a record's seconds are its share since
    steps: int = 0  # relaxations' gradient evaluations so far, shown beside the bar's count

    def settle(self, settled: Settled) -> None:
        if settled.failures:
            self.commits.put(Commit([], 0.0, None, settled.failures))
        self.summary.failures += len(settled.failures)
        self.summary.skipped += settled.skipped
        self.summary.timings["conformers"] += settled.seconds
        self.bar.update(settled.progress)

    def label(self, batch: Batch, results: list[SCFResult], gradients: list[np.ndarray] | None,
              forces_seconds: float, steady: bool) -> None:  # fmt: skip
        """Hand a labelled batch to the commit thread: its records (their seconds the generator's wall
        time since the last batch, failed conformers' time included) and its failures. ``steady``:
        that time holds no program loading or compiling (the summary's steady rate counts it)."""
        for result in results:  # host preparation, transfer, waiting for the device, finalisation
            self.summary.timings.update(result.timings)
        if gradients is not None:
            self.summary.timings["forces"] += forces_seconds
        now = time.perf_counter()
        rows, gradients, failures = labelled(batch, results, gradients, self.drop_unconverged)
        self._hand_over(len(batch.members), Commit(rows, now - self.last_commit, gradients, failures), now, steady,
                        len(results), sum(r.converged and np.isfinite(r.energy) for r in results))  # fmt: skip

    def relaxed(self, conformers: list[tuple[Input, int, Relaxation]], trajectory: bool, steady: bool) -> None:
        """Hand relaxed conformers (input, conformer id, relaxation) to the commit thread: a record at
        each converged one's minimum (its seconds its whole relaxation's, its ``optimizer_steps`` the
        optimiser's evaluations), a failure with the reason for each other one, and with
        ``trajectory`` every step of each as a frame. ``steady`` as for :meth:`label`."""
        rows, gradients, steps, seconds, failures = [], [], [], [], []
        frames: list[tuple] = []
        for entry, cid, relaxation in conformers:
            if trajectory:
                frames += [(entry.smiles, entry.molecule_id, cid, f) for f in relaxation.frames]
            if relaxation.converged:
                final = relaxation.final
                rows.append((entry.smiles, entry.molecule_id, cid, final.molecule, final.result))
                gradients.append(final.gradient)
                steps.append(relaxation.steps)
                seconds.append(relaxation.seconds)
            else:
                failures.append(Failure(entry.description, f"relaxation: {relaxation.failure}", entry.molecule_id, cid))
        self.summary.optimizer_steps += sum(r.steps for *_, r in conformers)
        self.summary.timings["relaxation"] += sum(r.seconds for *_, r in conformers)
        # the convergence share and its watch judge the SCF of the records (a broken setup), not the
        # optimisations: one that stops unconverged is a failure with its reason
        commit = Commit(rows, seconds, gradients, failures, {"optimizer_steps": steps}, frames)
        self._hand_over(len(conformers), commit, time.perf_counter(), steady, len(rows),
                        sum(bool(r.converged) for *_, r in rows))  # fmt: skip

    def stepped(self) -> None:
        """One more gradient evaluation of a relaxation: counted beside the bar's conformers."""
        self.steps += 1
        self.bar.set_postfix_str(f"{self.steps} steps", refresh=False)

    def _hand_over(self, count: int, commit: Commit, now: float, steady: bool, judged: int, converged: int) -> None:
        """Put ``commit`` (made at ``now``) on the commit thread and count it: in the summary, on the
        bar, and in the convergence watch, which judges ``judged`` conformers' SCF, ``converged`` of
        them converged."""
        self.commits.put(commit)
        if steady:
            self.summary.steady_conformers += count
            self.summary.steady_seconds += now - self.last_commit
        self.last_commit = now
        self.summary.conformers += len(commit.rows)
        self.summary.converged += sum(bool(r.converged) for *_, r in commit.rows)
        self.summary.labelled += judged
        self.summary.failures += len(commit.failures)
        self.bar.update(count)
        self.watch.add(judged, converged)


@dataclass(frozen=True)
class Commit:
    """What the commit thread writes as one part: records' rows (with their seconds, shared or each
    its own, their gradients and optional columns), failures, and trajectory frames, each (SMILES,
    molecule id, conformer id, :class:`~pyscf_ipu.optimize.Frame`)."""

    rows: list[tuple]
    seconds: float | list[float]
    gradients: list[np.ndarray] | None
    failures: list[Failure]
    optional: dict | None = None
    frames: list[tuple] | None = None


def committer(writer: ShardWriter):
    """The commit thread's work: a batch's records built from its rows, and committed with its failures
    and frames."""
    def commit(item: Commit) -> None:
        records = RecordBatch.from_results(item.rows, item.seconds, item.gradients, item.optional) if item.rows else None
        frames = None
        if item.frames:
            rows = [(smiles, mid, cid, f.molecule, f.result) for smiles, mid, cid, f in item.frames]
            frames = RecordBatch.from_results(rows, [f.result.seconds for *_, f in item.frames],
                                              [f.gradient for *_, f in item.frames],
                                              {"step": [f.step for *_, f in item.frames]})  # fmt: skip
        writer.commit(records, item.failures, frames)

    return commit
