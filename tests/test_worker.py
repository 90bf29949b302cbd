"""The bounded worker every hand-off to slow work shares: bounded, drops counted, batches, flush and shutdown."""

from __future__ import annotations

import threading

import pytest

from prismlb.service import BoundedWorker, QueueEntry
from prismlb.wire import ConfigError

from .conftest import wait_for

WAIT_S = 10.0


class Recording(BoundedWorker[str]):
    """Records each batch; holds the thread inside a batch while `release` is clear; raises on a value "boom"."""

    def __init__(self, max_queue: int, max_batch: int = 1, interval_s: float = 60.0) -> None:
        self.batches: list[list[str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.drops: list[tuple[int, bool]] = []
        self.shutdowns: list[tuple[bool, float]] = []
        super().__init__("test-worker", max_queue, max_batch, interval_s)

    def _process(self, batch: list[str], items: int) -> None:
        self.entered.set()
        assert self.release.wait(WAIT_S)
        if "boom" in batch:
            raise RuntimeError("boom")
        self.batches.append(batch)

    def _on_drop(self, dropped: int, first: bool) -> None:
        self.drops.append((dropped, first))

    def _on_shutdown(self, finished: bool, timeout_s: float) -> None:
        self.shutdowns.append((finished, timeout_s))

    def offer(self, *values: str, size: int = 1) -> bool:
        return self._offer((QueueEntry(v, size, 1) for v in values), len(values))

    def processed(self) -> list[str]:
        return [value for batch in self.batches for value in batch]


def test_queue_is_bounded_and_the_excess_is_dropped_and_counted() -> None:
    worker = Recording(max_queue=3)
    worker.release.clear()
    try:
        assert worker.offer("a")
        assert worker.entered.wait(WAIT_S)  # "a" is being processed: the queue is empty again
        assert worker.offer("b", "c")
        assert not worker.offer("d", "e")  # "d" fits, "e" does not
        assert not worker.offer("f")
        assert (worker.queued, worker.queued_items, worker.dropped) == (3, 3, 2)
        assert worker.drops == [(1, True), (1, False)]
        worker.release.set()
        assert worker.force_flush(WAIT_S)
        assert worker.processed() == ["a", "b", "c", "d"]
        assert worker.queued == 0
    finally:
        worker.release.set()
        worker.shutdown(WAIT_S)


def test_batches_hold_at_most_max_batch_and_a_larger_entry_goes_alone() -> None:
    worker = Recording(max_queue=100, max_batch=4)
    worker.release.clear()
    try:
        assert worker.offer("x")
        assert not worker.force_flush(0.0)  # wakes the worker on less than a batch, without waiting for it
        assert worker.entered.wait(WAIT_S)
        assert worker.offer(*"abcdef")
        assert worker.offer("big", size=10)
        assert worker.offer("g")
        worker.release.set()
        assert worker.force_flush(WAIT_S)
        assert worker.batches == [["x"], ["a", "b", "c", "d"], ["e", "f"], ["big"], ["g"]]
    finally:
        worker.shutdown(WAIT_S)


def test_a_batch_worth_wakes_the_worker_before_its_interval() -> None:
    worker = Recording(max_queue=10, max_batch=2, interval_s=60.0)
    try:
        worker.offer("a")
        worker.offer("b")
        wait_for(lambda: worker.processed() == ["a", "b"], what="the batch processed without waiting 60 s")
    finally:
        worker.shutdown(WAIT_S)


def test_shutdown_processes_what_is_queued_then_takes_nothing() -> None:
    worker = Recording(max_queue=10, max_batch=10, interval_s=60.0)
    assert worker.offer("a", "b", "c")  # under a batch's worth: nothing wakes the worker but shutdown
    assert worker.shutdown(WAIT_S)
    assert worker.processed() == ["a", "b", "c"]
    assert worker.shutdowns == [(True, WAIT_S)]
    assert not worker.offer("late")
    assert worker.dropped == 1 and worker.drops == [(1, True)]
    assert worker.shutdown(WAIT_S)
    assert worker.shutdowns == [(True, WAIT_S)], "only the first shutdown acts"
    assert worker.force_flush(WAIT_S)


def test_shutdown_without_drain_discards_the_queue() -> None:
    worker = Recording(max_queue=10, max_batch=10)
    worker.release.clear()
    assert worker.offer("running")
    assert not worker.force_flush(0.0)  # wakes the worker on less than a batch, without waiting for it
    assert worker.entered.wait(WAIT_S)
    assert worker.offer("waiting")
    worker.release.set()
    assert worker.shutdown(WAIT_S, drain=False)
    assert worker.processed() == ["running"]
    assert worker.queued == 0


def test_shutdown_gives_up_after_its_timeout_and_says_so() -> None:
    worker = Recording(max_queue=10)
    worker.release.clear()
    try:
        assert worker.offer("stuck")
        assert worker.entered.wait(WAIT_S)
        assert worker.offer("behind")
        assert not worker.shutdown(0.05)
        assert worker.shutdowns == [(False, 0.05)]
        assert worker.queued_items == 1
    finally:
        worker.release.set()
    assert wait_for(lambda: worker.processed() == ["stuck", "behind"], what="the worker to finish after its release")


def test_a_failing_batch_is_logged_and_the_worker_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    worker = Recording(max_queue=10)
    assert worker.offer("boom")
    assert worker.offer("after")
    assert worker.force_flush(WAIT_S)
    assert worker.processed() == ["after"]
    assert "prism-test-worker: processing a batch failed" in caplog.text
    assert worker.shutdown(WAIT_S)


@pytest.mark.parametrize(("max_queue", "max_batch", "interval_s"), [(0, 1, 1.0), (4, 5, 1.0), (4, 0, 1.0), (4, 2, 0.0)])
def test_impossible_sizes_are_a_config_error(max_queue: int, max_batch: int, interval_s: float) -> None:
    with pytest.raises(ConfigError, match="test-worker: need 1 <= max_batch"):
        Recording(max_queue, max_batch, interval_s)
