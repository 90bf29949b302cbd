"""A bounded queue drained by a worker thread of its own, the shape of every hand-off from a thread that must
not wait (a receiver's, a control loop's) to slow work (an export upstream, a scale-out hook), after
OpenTelemetry's BatchSpanProcessor: submitting never blocks, memory stays bounded, what does not fit is dropped
and counted, and `force_flush`/`shutdown` process what is queued."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from prismlb.wire import ConfigError

_log = logging.getLogger("prism.worker")
_E = TypeVar("_E")


@dataclass(frozen=True)
class QueueEntry(Generic[_E]):
    """One thing queued: the value processed, the room it takes in the queue, and the items it counts for."""

    value: _E
    size: int = 1
    items: int = 1


class BoundedWorker(ABC, Generic[_E]):
    """Processes what is offered in batches, from a bounded queue, on a thread named `prism-<name>`.

    The queue holds at most `max_queue` of room and a batch at most `max_batch` of it (an entry larger than that
    goes alone). The thread wakes every `interval_s`, at once when a batch's worth is queued, and on
    `force_flush`/`shutdown`. What does not fit when offered is dropped and its items counted (`dropped`,
    `_on_drop`). A batch that raises is logged and lost; the thread goes on. Subclasses set their fields before
    this `__init__`, which starts the thread.
    """

    def __init__(self, name: str, max_queue: int, max_batch: int = 1, interval_s: float = 1.0) -> None:
        if max_queue < 1 or not 1 <= max_batch <= max_queue or not interval_s > 0:
            raise ConfigError(
                f"{name}: need 1 <= max_batch ({max_batch}) <= max_queue ({max_queue}) and interval_s > 0"
            )
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._interval_s = interval_s
        self._queue: deque[QueueEntry[_E]] = deque()
        self._queued = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._flushes: list[threading.Event] = []
        self._stopping = False
        self.dropped = 0
        """Items offered that did not fit (the queue was full, or the worker shut down)."""
        self._thread = threading.Thread(target=self._run, name=f"prism-{name}", daemon=True)
        self._thread.start()

    @abstractmethod
    def _process(self, batch: list[_E], items: int) -> None:
        """Handle one batch (of `items` items) on the worker's thread."""

    def _on_drop(self, dropped: int, first: bool) -> None:
        """Called, outside the lock, when an offer dropped `dropped` items; `first` for the worker's first drop."""

    @property
    def queued(self) -> int:
        """The room the queued entries take."""
        return self._queued

    @property
    def queued_items(self) -> int:
        """The items queued and not yet processed."""
        with self._lock:
            return sum(entry.items for entry in self._queue)

    def _offer(self, entries: Iterable[QueueEntry[_E]], items: int) -> bool:
        """Queue `entries` in order while they fit; the rest of the `items` offered are dropped and counted.
        True when all of them were queued. `entries` may be lazy: what does not fit is never made."""
        room = 0 if self._stopping else self._max_queue - self._queued  # a hint; rechecked under the lock
        fitting: list[QueueEntry[_E]] = []
        for entry in entries:
            if entry.size > room:
                break
            room -= entry.size
            fitting.append(entry)
        accepted = 0
        with self._lock:
            room = 0 if self._stopping else self._max_queue - self._queued
            for entry in fitting:
                if entry.size > room:
                    break
                room -= entry.size
                self._queue.append(entry)
                self._queued += entry.size
                accepted += entry.items
            dropped = items - accepted
            self.dropped += dropped
            batch_ready = self._queued >= self._max_batch
            first = dropped > 0 and self.dropped == dropped
        if dropped:
            self._on_drop(dropped, first)
        if batch_ready:
            self._wake.set()
        return dropped == 0

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Process everything offered so far; False if that did not finish within `timeout_s`."""
        done = threading.Event()
        with self._lock:
            if self._stopping:
                return not self._queue
            self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def _on_shutdown(self, finished: bool, timeout_s: float) -> None:
        """Called once, by the first `shutdown`, after the thread ended (`finished`) or `timeout_s` passed."""

    def shutdown(self, timeout_s: float = 30.0, *, drain: bool = True) -> bool:
        """Take no more; process what is queued (with `drain=False`, discard it) and end the thread, waiting up
        to `timeout_s`. True when the thread has ended; False while it is still busy (a daemon: it does not hold
        the process up). Calls after the first only report that."""
        with self._lock:
            first = not self._stopping
            self._stopping = True
            if not drain:
                self._queue.clear()
                self._queued = 0
        if first:
            self._wake.set()
            self._thread.join(timeout_s)
            self._on_shutdown(not self._thread.is_alive(), timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            with self._lock:
                flushes, self._flushes = self._flushes, []
                stopping = self._stopping
            self._drain()
            for done in flushes:
                done.set()
            if stopping:
                return

    def _drain(self) -> None:
        """Process, in batches, the entries queued now (not those that arrive meanwhile)."""
        left = len(self._queue)
        while left > 0:
            batch: list[QueueEntry[_E]] = []
            size = 0
            with self._lock:
                while (
                    self._queue and len(batch) < left and (not batch or size + self._queue[0].size <= self._max_batch)
                ):
                    entry = self._queue.popleft()
                    batch.append(entry)
                    size += entry.size
                self._queued -= size
            if not batch:
                return
            left -= len(batch)
            try:
                self._process([entry.value for entry in batch], sum(entry.items for entry in batch))
            except Exception:  # one batch's failure must not end the worker
                _log.exception("%s: processing a batch failed; its items are lost", self._thread.name)
