"""Host CPU and memory, read through psutil."""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil

_MIN_CPU_WINDOW_S = 0.01


@dataclass(frozen=True)
class HostSample:
    """One reading, each field a node-vector metric of its name; `cpu_util_ratio` is None when too little time
    passed since the last reading."""

    cpu_util_ratio: float | None
    mem_used_bytes: int
    mem_total_bytes: int


class HostSampler:
    """System-wide CPU utilisation since the previous sample (never blocks) and memory in use."""

    def __init__(self) -> None:
        psutil.cpu_percent(interval=None)
        self._last_cpu_read = time.monotonic()

    def sample(self) -> HostSample:
        """CPU over the time since the last call; memory in use is total minus available."""
        now = time.monotonic()
        percent = psutil.cpu_percent(interval=None)
        cpu = min(1.0, max(0.0, percent / 100.0)) if now - self._last_cpu_read >= _MIN_CPU_WINDOW_S else None
        self._last_cpu_read = now
        memory = psutil.virtual_memory()
        return HostSample(
            cpu_util_ratio=cpu,
            mem_used_bytes=memory.total - memory.available,
            mem_total_bytes=memory.total,
        )
