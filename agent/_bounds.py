"""The range each number the agent reads from another program may take, and the count of those outside it.

Span attributes and engine `/metrics` pages are written by other programs, and one absurd value in a node
vector (a TTFT of 1e200 ms, 2e12 running requests) would be over the brain's limits and cost the whole vector.
Every such value passes one rule, `Bound.fit`, where it enters the agent: inside the range it is kept (a ratio
a rounding error outside [0, 1] is clamped), outside it is dropped, counted in
`prism_agent_invalid_values_total{source, field}` and logged once per source and field, and the rest of the
vector is kept.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

_log = logging.getLogger("prism.agent")


@dataclass(frozen=True)
class Bound:
    """A closed range [low, high]; a value within `slack` outside it is clamped to it, not dropped."""

    low: float
    high: float
    slack: float = 0.0

    def fit(self, value: float) -> float | None:
        """`value` within the range (clamped to it within the slack); None when non-finite or further out."""
        if not math.isfinite(value) or not self.low - self.slack <= value <= self.high + self.slack:
            return None
        return min(self.high, max(self.low, value))


LATENCY_MS = Bound(0.0, 1e7)
"""Latencies in milliseconds: up to about 2.8 hours."""
REQUESTS = Bound(0.0, 1e9)
"""Request counts (running, waiting, finished in a window)."""
RATIO = Bound(0.0, 1.0, slack=0.01)
"""Ratios; 1.004 from rounding becomes 1.0, 1.5 is dropped."""


class InvalidValues:
    """Counts values dropped by their bound, per source ("span", "otlp_metric", "engine") and field."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._metric = (
            Counter(
                "prism_agent_invalid_values",
                "Values read from spans, OTLP metrics or the engine that were outside their range and dropped",
                ["source", "field"],
                registry=registry,
            )
            if registry is not None
            else None
        )
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def check(self, source: str, field: str, value: float, bound: Bound) -> float | None:
        """`value` fitted to `bound`, or None (counted) when it does not fit."""
        fitted = bound.fit(value)
        if fitted is None:
            self.count(source, field, value)
        return fitted

    def count(self, source: str, field: str, value: object) -> None:
        """Count one dropped `value`; the first of each source and field is logged."""
        with self._lock:
            first = (source, field) not in self._counts
            self._counts[(source, field)] = self._counts.get((source, field), 0) + 1
        if self._metric is not None:
            self._metric.labels(source, field).inc()
        if first:
            _log.warning(
                "%s %s = %r is out of range and dropped; further invalid values of it are only counted",
                source,
                field,
                value,
            )

    def counts(self) -> dict[tuple[str, str], int]:
        """(source, field) → values dropped so far."""
        with self._lock:
            return dict(self._counts)
