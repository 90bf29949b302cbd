"""Counting rejected input: every reject is counted by kind, the first of each kind is logged."""

from __future__ import annotations

import logging
import threading
import weakref

from prometheus_client import CollectorRegistry, Counter

from ._exceptions import WireError

_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()
_METRICS_LOCK = threading.Lock()


def _metric(registry: CollectorRegistry) -> Counter:
    """One `prism_rejected_messages_total` per registry, shared by every receiver registered on it."""
    with _METRICS_LOCK:
        if registry not in _METRICS:
            _METRICS[registry] = Counter(
                "prism_rejected_messages",
                "Messages rejected by a receiver, by kind of failure",
                ["receiver", "kind"],
                registry=registry,
            )
        return _METRICS[registry]


class RejectCounter:
    """Counts `WireError`s per kind for one receiver and logs the first of each kind once."""

    def __init__(self, receiver: str, logger: logging.Logger, registry: CollectorRegistry | None = None) -> None:
        self.receiver = receiver
        self._log = logger
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._metric = _metric(registry) if registry is not None else None

    def record(self, error: WireError) -> None:
        self.count(error.kind, error)

    def count(self, kind: str, detail: object) -> None:
        """Count one failure of `kind`; the first of each kind is logged with `detail`."""
        with self._lock:
            first = kind not in self._counts
            self._counts[kind] = self._counts.get(kind, 0) + 1
        if self._metric is not None:
            self._metric.labels(self.receiver, kind).inc()
        if first:
            self._log.warning("%s: %s (%s); further failures of this kind are only counted", self.receiver, detail, kind)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
