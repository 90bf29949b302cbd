"""GPU-allocator gauges, one point per device (attribute `gpu.index`), from one snapshot per collection."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from ._allocator import AllocatorStats, allocator_stats_from_snapshot
from ._conventions import (
    ATTR_GPU,
    METRIC_ALLOCATED_BYTES,
    METRIC_FRAGMENTATION,
    METRIC_FREE_BYTES,
    METRIC_FREE_ENTROPY,
    METRIC_LARGEST_FREE_BYTES,
    METRIC_LARGEST_FREE_RATIO,
    METRIC_RESERVE_ADVICE_BYTES,
    METRIC_RESERVED_BYTES,
)
from ._reservation import ADVICE_PERIOD_S, ReservationAdvisor, ReservationMode

_log = logging.getLogger("prism.otel")

SnapshotProvider = Callable[[], Sequence[Mapping[str, Any]]]
"""Returns the allocator's segments in the format of `torch.cuda.memory_snapshot()`."""


@dataclass(frozen=True)
class _Point:
    stats: AllocatorStats
    advice_bytes: int


_GAUGES: tuple[tuple[str, str, str, Callable[[_Point], float]], ...] = (
    (METRIC_FRAGMENTATION, "1", "1 − largest free block / free bytes", lambda p: p.stats.fragmentation_ratio),
    (METRIC_FREE_ENTROPY, "bit", "Shannon entropy of free bytes over free blocks", lambda p: p.stats.free_entropy),
    (METRIC_LARGEST_FREE_RATIO, "1", "Largest free block / free bytes (α)", lambda p: p.stats.largest_free_ratio),
    (METRIC_LARGEST_FREE_BYTES, "By", "Largest contiguous free block", lambda p: p.stats.largest_free_bytes),
    (METRIC_FREE_BYTES, "By", "Free bytes inside reserved segments", lambda p: p.stats.free_bytes),
    (METRIC_RESERVED_BYTES, "By", "Bytes the allocator holds from CUDA", lambda p: p.stats.reserved_bytes),
    (METRIC_ALLOCATED_BYTES, "By", "Bytes in allocated blocks", lambda p: p.stats.allocated_bytes),
    (METRIC_RESERVE_ADVICE_BYTES, "By", "Bytes to keep in reserve (the design)", lambda p: p.advice_bytes),
)


def cuda_snapshot_provider() -> SnapshotProvider | None:
    """`torch.cuda.memory_snapshot` when CUDA is available; otherwise None, and one log line says so."""
    import torch  # here, so that importing prismlb.otel (the agent does, for the names) never loads torch

    if not torch.cuda.is_available():
        _log.info("no CUDA device (torch.cuda.is_available() is False): GPU-allocator metrics are not exported")
        return None
    return functools.partial(torch.cuda.memory_snapshot, include_traces=False)


class _Advice:
    """One device's advisor, sampled at most every ADVICE_PERIOD_S."""

    def __init__(self, mode: ReservationMode) -> None:
        self._advisor = ReservationAdvisor(mode)
        self._sampled_s: float | None = None
        self._bytes = 0

    def bytes(self, stats: AllocatorStats, now_s: float) -> int:
        if self._sampled_s is None or now_s - self._sampled_s >= ADVICE_PERIOD_S:
            self._sampled_s = now_s
            self._bytes = self._advisor.update(stats)
        return self._bytes


class AllocatorGauges:
    """Observable gauges of the allocator stats and reservation advice.

    A collection calls every gauge's callback once; the first call of each collection takes a new snapshot
    and the others read it, so the points of one export agree. A failing provider yields no points; the
    first failure and the recovery are logged.
    """

    def __init__(
        self, meter: Meter, provider: SnapshotProvider, devices: Iterable[int] | None, mode: ReservationMode
    ) -> None:
        self._provider = provider
        self._devices = None if devices is None else frozenset(devices)
        self._mode = mode
        self._lock = threading.Lock()
        self._served = {name for name, *_ in _GAUGES}  # every gauge served: the next call snapshots
        self._points: list[_Point] = []
        self._advice: dict[int, _Advice] = {}
        self._failing = False
        for name, unit, description, read in _GAUGES:
            meter.create_observable_gauge(name, [self._callback(name, read)], unit=unit, description=description)

    def _callback(
        self, name: str, read: Callable[[_Point], float]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                if name in self._served:
                    self._refresh()
                self._served.add(name)
                return [Observation(read(point), {ATTR_GPU: point.stats.device}) for point in self._points]

        return observe

    def _refresh(self) -> None:
        self._served = set()
        try:
            stats = allocator_stats_from_snapshot(self._provider())
        except Exception as exc:  # a provider's fault must not stop the other instruments' collection
            self._points = []
            if not self._failing:
                _log.warning("GPU-allocator snapshot failed, no allocator metrics until it works: %r", exc)
                self._failing = True
            return
        if self._failing:
            _log.info("GPU-allocator snapshot works again")
            self._failing = False
        now_s = time.monotonic()
        self._points = [
            _Point(s, self._advice.setdefault(s.device, _Advice(self._mode)).bytes(s, now_s))
            for s in stats
            if self._devices is None or s.device in self._devices
        ]
