"""Kernel time (bpf_ktime_get_ns, which is CLOCK_MONOTONIC) to epoch time, aligned explicitly."""

from __future__ import annotations

import time

SAMPLES = 5
REFRESH_S = 10.0


def measure_offset_ns(samples: int = SAMPLES) -> int:
    """time.time_ns() - time.monotonic_ns(), from the narrowest of `samples` monotonic brackets around a wall read."""
    best_width: int | None = None
    best_offset = 0
    for _ in range(samples):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        width = after - before
        if best_width is None or width < best_width:
            best_width = width
            best_offset = wall - (before + after) // 2
    return best_offset


class UnixClock:
    """Converts CLOCK_MONOTONIC nanoseconds to epoch nanoseconds; re-measures the offset every `refresh_s`
    (NTP slews and steps wall time, the monotonic clock follows neither)."""

    def __init__(self, refresh_s: float = REFRESH_S) -> None:
        self._refresh_s = refresh_s
        self.offset_ns = measure_offset_ns()
        self._measured_at = time.monotonic()

    def refresh_if_due(self) -> None:
        """Re-measure the offset when the last measurement is older than `refresh_s`."""
        if time.monotonic() - self._measured_at >= self._refresh_s:
            self.offset_ns = measure_offset_ns()
            self._measured_at = time.monotonic()

    def to_unix_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns
