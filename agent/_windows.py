"""Sliding time windows of observations, for percentiles and rates over the last N seconds."""

from __future__ import annotations

import math
import threading
from collections import deque

from prismlb.wire import quantile


class Window:
    """Observations from the last `span_s` seconds (at most `max_samples`, oldest dropped first); thread-safe.

    Times are the caller's (monotonic seconds); observations may arrive slightly out of order."""

    def __init__(self, span_s: float, max_samples: int = 50_000) -> None:
        if span_s <= 0 or max_samples <= 0:
            raise ValueError("span and capacity must be positive")
        self.span_s = span_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, value: float, at_s: float) -> None:
        if math.isfinite(value):
            with self._lock:
                self._samples.append((at_s, value))

    def values(self, now_s: float) -> list[float]:
        """The values observed in (now − span, now], sorted."""
        horizon = now_s - self.span_s
        with self._lock:
            while self._samples and self._samples[0][0] <= horizon:
                self._samples.popleft()
            return sorted(v for t, v in self._samples if t > horizon)

    def quantiles(self, now_s: float, qs: tuple[float, ...]) -> tuple[float, ...] | None:
        """The requested quantiles of the window, or None when it is empty."""
        values = self.values(now_s)
        return tuple(quantile(values, q, ordered=True) for q in qs) if values else None

    def rate(self, now_s: float) -> float:
        """Observations per second over the window."""
        return len(self.values(now_s)) / self.span_s
