"""The labelling threads on their own, without DFT (:func:`qm1b.pipeline.run_in_stages`): the order
items go through the stages, how many are alive at once, the threads they run on, and errors."""

from __future__ import annotations

import threading
import time

import pytest

from qm1b.pipeline import run_in_stages


class Record:
    """The stages of a run that log what they did, on which thread, and the items alive at once."""

    def __init__(self, pause: float = 0.0):
        self.events: list[tuple[str, object]] = []
        self.threads: dict[str, set[str]] = {}
        self.alive, self.most_alive, self.pause = 0, 0, pause
        self._lock = threading.Lock()

    def stage(self, name: str, enters: bool = False, leaves: bool = False):
        def run(value):
            with self._lock:
                self.events.append((name, value))
                self.threads.setdefault(name, set()).add(threading.current_thread().name)
                self.alive += enters - leaves
                self.most_alive = max(self.most_alive, self.alive)
            time.sleep(self.pause)
            return value

        return run

    def stages(self):
        return self.stage("prepare", enters=True), self.stage("dispatch"), self.stage("label", leaves=True)


def test_every_item_goes_through_every_stage_in_order_on_threads_other_than_the_callers():
    record = Record()
    run_in_stages(range(6), record.stages())
    for name in ("prepare", "dispatch", "label"):
        assert [v for n, v in record.events if n == name] == list(range(6))
    names = [next(iter(t)) for t in record.threads.values()]
    assert all(len(t) == 1 for t in record.threads.values()) and len(set(names)) == 3
    assert threading.main_thread().name not in names


def test_two_items_are_alive_at_once_and_an_item_of_full_weight_runs_alone():
    """With a pause in every stage, the next item is prepared while the one before is labelled, but
    never a third; an item weighing all the tokens enters only once the one before has left, and
    holds the next one back until it has left itself."""
    record = Record(pause=0.02)
    run_in_stages(range(5), record.stages(), alive=2)
    assert record.most_alive == 2
    record = Record(pause=0.02)
    run_in_stages(range(4), record.stages(), weight=lambda item: 2 if item == 2 else 1, alive=2)
    order = [(n, v) for n, v in record.events if n in ("prepare", "label")]
    assert order.index(("prepare", 2)) > order.index(("label", 1))
    assert order.index(("prepare", 3)) > order.index(("label", 2))


def test_serial_stages_take_turns():
    busy, overlaps = [0], [0]
    lock = threading.Lock()

    def stage(value):
        with lock:
            busy[0] += 1
            overlaps[0] = max(overlaps[0], busy[0])
        time.sleep(0.01)
        with lock:
            busy[0] -= 1
        return value

    run_in_stages(range(6), (stage, stage, stage), serial=True)
    assert overlaps[0] == 1
    overlaps[0] = 0
    run_in_stages(range(6), (stage, stage, stage))
    assert overlaps[0] > 1


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_the_first_error_in_any_stage_stops_the_others_and_is_raised_once_they_end(failing):
    """Stage ``failing`` raises at item 3: no later item reaches the last stage, no thread is left
    running, the items' source is closed (``on_end``) and the caller gets that error."""
    record, ended = Record(), []

    def broken(value):
        if value == 3:
            raise RuntimeError("stage failed at item 3")
        return value

    stages = list(record.stages())
    stages[failing] = broken
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="stage failed at item 3"):
        run_in_stages(range(1000), stages, on_end=lambda: ended.append(True))
    assert ended == [True]
    assert threading.active_count() == before
    assert all(v < 3 for n, v in record.events if n == "label")


def test_an_error_in_the_items_source_is_raised_too():
    def items():
        yield 0
        raise ValueError("bad input")

    record, before = Record(), threading.active_count()
    with pytest.raises(ValueError, match="bad input"):
        run_in_stages(items(), record.stages())
    assert threading.active_count() == before
