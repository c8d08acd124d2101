"""The generator's batching and ledger on their own, without DFT: which conformers go together, what
each input settles without labelling, and where a labelled batch's outcomes go."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from qm1b.batching import Batch, Settled, batches
from qm1b.conformers import ConformerError
from qm1b.inputs import MoleculeInput
from qm1b.ledger import Commit, Ledger, labelled
from qm1b.pipeline import Supplied
from qm1b.schema import Failure
from qm1b.summary import Summary
from qm1b.watch import ConvergenceWatch, NotConvergingError


class Source:
    """A conformer source that asks ``count`` conformers of every input."""

    def __init__(self, count: int):
        self.count = count

    def expected(self, entry) -> int:
        return self.count


def supplied(inputs, made: dict) -> list[Supplied]:
    """What the workers hand over for each input: ``made[id]`` is (conformer ids, failed ids) or an error."""
    out = []
    for entry in inputs:
        outcome = made[entry.molecule_id]
        if not isinstance(outcome, BaseException):
            good, bad = outcome
            outcome = ([(cid, f"m{entry.molecule_id}c{cid}") for cid in good],
                       [Failure(entry.smiles, "collided", entry.molecule_id, cid) for cid in bad])  # fmt: skip
        out.append(Supplied(entry, outcome, 0.5))
    return out


def run(inputs, buckets, made, sizes, done=frozenset(), count=3):
    """The items ``batches`` yields, each a Batch as its (molecule id, conformer id) keys or a Settled."""
    todo = [e for e in inputs if (e.molecule_id, -1) not in done]
    items = batches(inputs, buckets, Source(count), set(done), sizes, iter(supplied(todo, made)))
    return [[(e.molecule_id, cid) for e, cid, _ in item.members] if isinstance(item, Batch) else item for item in items]


INPUTS = [MoleculeInput(k, f"C{'C' * k}") for k in range(4)]


def test_a_batch_fills_from_several_molecules_of_one_bucket_and_a_new_bucket_starts_its_own():
    buckets = {0: "a", 1: "a", 2: "b", 3: "b"}
    made = {k: ([0, 1, 2], []) for k in range(4)}
    items = run(INPUTS, buckets, made, {"a": 2, "b": 4})
    keys = [item for item in items if isinstance(item, list)]
    assert keys == [[(0, 0), (0, 1)], [(0, 2), (1, 0)], [(1, 1), (1, 2)],  # bucket a in twos, across molecules
                    [(2, 0), (2, 1), (2, 2), (3, 0)], [(3, 1), (3, 2)]]  # bucket b in fours, the rest short
    buckets = {0: "a", 1: "b", 2: "b", 3: "b"}  # a's leftover conformer goes short, not into b's batch
    keys = [item for item in run(INPUTS, buckets, made, {"a": 2, "b": 4}) if isinstance(item, list)]
    assert keys == [[(0, 0), (0, 1)], [(0, 2)], [(1, 0), (1, 1), (1, 2), (2, 0)], [(2, 1), (2, 2), (3, 0), (3, 1)],
                    [(3, 2)]]  # fmt: skip
    settled = [item for item in items if isinstance(item, Settled)]
    assert [s.progress for s in settled] == [0, 0, 0, 0] and all(not s.failures for s in settled)


def test_inputs_settle_their_failures_and_what_was_done_without_labelling():
    """A molecule recorded as failed is skipped whole; one whose conformers cannot be made is one
    failure; a conformer that failed is a failure of its own; committed conformers are skipped."""
    buckets = {k: "a" for k in range(4)}
    made = {1: ConformerError("embedding failed", "C"), 2: ([0, 2], [1]), 3: ([0, 1, 2], [])}
    done = {(0, -1), (3, 0), (3, 1)}
    items = run(INPUTS, buckets, made, {"a": 8}, done=done)
    settled = [item for item in items if isinstance(item, Settled)]
    assert [(s.skipped, s.progress, [f.key for f in s.failures]) for s in settled] == [
        (3, 3, []),  # molecule 0: done as a whole
        (0, 3, [(1, -1)]),  # molecule 1: no conformer could be made
        (0, 1, [(2, 1)]),  # molecule 2: conformer 1 failed, 0 and 2 go on
        (2, 2, []),  # molecule 3: two committed earlier
    ]
    assert [item for item in items if isinstance(item, list)] == [[(2, 0), (2, 2), (3, 2)]]


def test_a_molecule_without_a_bucket_goes_alone_and_an_unexpected_error_is_raised():
    buckets = {0: "a", 1: None, 2: "a", 3: "a"}
    made = {k: ([0, 1], []) for k in range(4)}
    keys = [item for item in run(INPUTS, buckets, made, {"a": 8}, count=2) if isinstance(item, list)]
    assert keys == [[(0, 0), (0, 1)], [(1, 0), (1, 1)], [(2, 0), (2, 1), (3, 0), (3, 1)]]
    made[2] = MemoryError("out of memory in a worker")
    with pytest.raises(MemoryError):
        run(INPUTS, buckets, made, {"a": 8}, count=2)


def result(energy: float, converged: bool = True):
    return SimpleNamespace(energy=energy, homo=-0.2, lumo=0.1, gap=0.3, energy_std_ev=1e-4, converged=converged,
                           timings={"scf": 1.0})  # fmt: skip


class Commits:
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)


class Bar:
    def __init__(self):
        self.n = 0

    def update(self, n):
        self.n += n


def test_the_ledger_commits_counts_and_judges_each_batch():
    """Records for the good conformers, failures for a NaN label, a NaN force and (with
    --drop-unconverged) an unconverged one; the summary, the bar and the watch count all of them."""
    entry = MoleculeInput(7, "CCO")
    batch = Batch([(entry, cid, f"m{cid}") for cid in range(5)])
    results = [result(-10.0), result(float("nan")), result(-10.1, converged=False), result(-10.2), result(-10.3)]
    gradients = [np.zeros((3, 3)), np.zeros((3, 3)), np.zeros((3, 3)), np.full((3, 3), np.nan), np.zeros((3, 3))]
    rows, kept, failures = labelled(batch, results, gradients, drop_unconverged=True)
    assert [row[2] for row in rows] == [0, 4] and len(kept) == 2
    assert [(f.conformer_id, f.reason) for f in failures] == [
        (1, "NaN label"), (2, "not converged (--drop-unconverged)"), (3, "NaN force")]

    commits, summary, bar = Commits(), Summary(out="x", shard="0/1"), Bar()
    ledger = Ledger(commits, summary, bar, ConvergenceWatch(0.5, 32, "the setup"), True, last_commit=0.0)
    ledger.settle(Settled([Failure("CC", "bad SMILES", 8, -1)], skipped=2, progress=5, seconds=1.5))
    ledger.label(batch, results, gradients, forces_seconds=2.0, steady=True)
    (first, second) = commits.items
    assert first == Commit([], 0.0, None, [Failure("CC", "bad SMILES", 8, -1)])
    assert [row[2] for row in second.rows] == [0, 4] and len(second.failures) == 3 and second.frames is None
    assert (summary.conformers, summary.converged, summary.labelled, summary.failures, summary.skipped) == (2, 2, 5, 4, 2)
    assert summary.steady_conformers == 5 and summary.timings == Counter({"scf": 5.0, "forces": 2.0, "conformers": 1.5})
    assert bar.n == 10


def test_the_ledger_records_relaxations_at_their_minima_and_failures_with_their_frames():
    """A converged relaxation becomes a record at its last frame, with its steps and its own seconds;
    one that stopped becomes a failure with the reason; with a trajectory every frame of both goes to
    the commit; the convergence share counts the records' SCF only."""
    from pyscf_ipu.optimize import Frame, Relaxation

    entry = MoleculeInput(3, "CO")
    batch = Batch([(entry, 0, "start 0"), (entry, 1, "start 1")])
    frames = [tuple(Frame(step, f"m{cid}.{step}", result(-10.0 - step), np.zeros((2, 3))) for step in range(steps))
              for cid, steps in ((0, 3), (1, 2))]  # fmt: skip
    relaxations = [Relaxation(frames[0], "", 4.0), Relaxation(frames[1], "not converged in 1 steps", 3.0)]
    commits, summary = Commits(), Summary(out="x", shard="0/1")
    ledger = Ledger(commits, summary, Bar(), ConvergenceWatch(0.5, 32, "the setup"), False, last_commit=0.0)
    ledger.relaxed([(entry, cid, r) for (_, cid, _), r in zip(batch.members, relaxations)], trajectory=True,
                   steady=True)  # fmt: skip
    (commit,) = commits.items
    (row,) = commit.rows
    assert row[2:4] == (0, "m0.2") and commit.seconds == [4.0] and commit.optional == {"optimizer_steps": [3]}
    assert [(f.conformer_id, f.reason) for f in commit.failures] == [(1, "relaxation: not converged in 1 steps")]
    assert [(cid, f.step) for _, _, cid, f in commit.frames] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert (summary.conformers, summary.converged, summary.labelled, summary.failures, summary.optimizer_steps) == (
        1, 1, 1, 1, 5)


def test_the_watch_stops_a_run_that_mostly_fails_to_converge():
    watch = ConvergenceWatch(0.5, 8, "the setup")
    watch.add(4, 4)
    watch.add(4, 1)  # 5 of 8: at the minimum's side
    with pytest.raises(NotConvergingError, match="only 2 of the last 8 conformers converged"):
        watch.add(4, 1)  # the oldest batch left the window: 2 of 8
