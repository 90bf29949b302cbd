"""Sliding time windows of observations, for percentiles and rates over the last N seconds, and the per-slice
request windows a node vector's latency entries are read from."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence

from prismlb.semantics import quantile
from prismlb.wire import ModalityLatency

LOAD_WINDOW_S = 10.0
"""The span of the agent's per-slice latency and request rate: long enough for a P99 of a slice with a few
requests a second, short enough to follow a change of load within a few vector periods."""
LATENCY_QUANTILES = (0.5, 0.95, 0.99)
"""The quantiles of a latency entry (`ModalityLatency`'s p50, p95 and p99)."""


def _quantiles(ordered: Sequence[float], qs: tuple[float, ...]) -> tuple[float, ...] | None:
    """The `qs` quantiles of sorted `ordered`, or None when it is empty."""
    return tuple(quantile(ordered, q, ordered=True) for q in qs) if ordered else None


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
            self._forget(horizon)
            values = [v for t, v in self._samples if t > horizon]
        values.sort()
        return values

    def count(self, now_s: float) -> int:
        """How many values were observed in (now − span, now]."""
        horizon = now_s - self.span_s
        with self._lock:
            self._forget(horizon)
            return sum(1 for t, _ in self._samples if t > horizon)

    def _forget(self, horizon: float) -> None:
        """Drop the oldest observations up to the first after `horizon` (lock held)."""
        while self._samples and self._samples[0][0] <= horizon:
            self._samples.popleft()

    def quantiles(self, now_s: float, qs: tuple[float, ...]) -> tuple[float, ...] | None:
        """The requested quantiles of the window, or None when it is empty."""
        return _quantiles(self.values(now_s), qs)

    def rate(self, now_s: float) -> float:
        """Observations per second over the window."""
        return self.count(now_s) / self.span_s


class SliceWindows:
    """Requests per latency key (a slice, as `NodeVector.latency` keys its entries): the time to first token,
    end-to-end latency and errors of those reported in the last `span_s` seconds; thread-safe.

    A request counts when it is reported, with whatever it measured: the agent's request spans arrive when a
    request ends, and so do the cluster replay's requests."""

    def __init__(self, span_s: float = LOAD_WINDOW_S) -> None:
        if span_s <= 0:
            raise ValueError("span must be positive")
        self.span_s = span_s
        self._ttft: dict[str, Window] = {}
        self._e2e: dict[str, Window] = {}
        self._errors: dict[str, Window] = {}
        self._lock = threading.Lock()

    def _window(self, table: dict[str, Window], key: str) -> Window:
        with self._lock:
            window = table.get(key)
            if window is None:
                window = table[key] = Window(self.span_s)
            return window

    def add(
        self, key: str, at_s: float, *, ttft_ms: float | None = None, e2e_ms: float | None = None, error: bool = False
    ) -> None:
        """One request reported at `at_s`: its latencies in ms (None: not measured) and whether it failed."""
        if e2e_ms is not None:
            self._window(self._e2e, key).add(e2e_ms, at_s)
        if error:
            self._window(self._errors, key).add(1.0, at_s)
        if ttft_ms is not None:
            self._window(self._ttft, key).add(ttft_ms, at_s)

    def latency(self, now_s: float) -> dict[str, ModalityLatency]:
        """Per key with requests in the window: their count (those with an end-to-end latency), errors, and TTFT
        and end-to-end P50/P95/P99."""
        with self._lock:
            keys = sorted(set(self._e2e) | set(self._ttft))
            tables = [(key, self._ttft.get(key), self._e2e.get(key), self._errors.get(key)) for key in keys]
        out: dict[str, ModalityLatency] = {}
        for key, ttft, e2e, errors in tables:
            e2e_values = e2e.values(now_s) if e2e is not None else []
            ttft_q = ttft.quantiles(now_s, LATENCY_QUANTILES) if ttft is not None else None
            if not e2e_values and ttft_q is None:
                continue
            e2e_q = _quantiles(e2e_values, LATENCY_QUANTILES)
            count = len(e2e_values)
            out[key] = ModalityLatency(
                requests=count,
                errors=min(count, errors.count(now_s)) if errors is not None else 0,
                ttft_p50_ms=ttft_q[0] if ttft_q else None,
                ttft_p95_ms=ttft_q[1] if ttft_q else None,
                ttft_p99_ms=ttft_q[2] if ttft_q else None,
                e2e_p50_ms=e2e_q[0] if e2e_q else None,
                e2e_p95_ms=e2e_q[1] if e2e_q else None,
                e2e_p99_ms=e2e_q[2] if e2e_q else None,
            )
        return out

    def requests_per_s(self, now_s: float) -> float | None:
        """Requests with an end-to-end latency per second over the window, all keys; None before the first."""
        with self._lock:
            windows = list(self._e2e.values())
        return sum(w.rate(now_s) for w in windows) if windows else None
