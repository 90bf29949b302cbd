"""The design's GPU-memory reservation advice, one advisor per device.

static: reserve 15% of the pool (vLLM PagedAttention under high concurrency).
dynamic: a watermark that starts at 8% of the pool and grows by 64 MiB each time the largest free block has
been under 96 MiB for three samples in a row, never above 22% of the pool (Triton-kernel-launch-heavy
loads). The design gives no rule for lowering it; it falls only when the pool shrinks.
Both: never under 128 MiB, the contiguous space kept for kernels (the design's `reserve_for_triton`).
The pool is the allocator's reserved bytes, the memory the snapshot describes. The design samples every
10 s (ADVICE_PERIOD_S); each `update` call is one sample.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

from ._allocator import AllocatorStats

ReservationMode = Literal["dynamic", "static"]

_MIB: Final = 1 << 20
ADVICE_PERIOD_S: Final = 10.0
KERNEL_CONTIGUOUS_BYTES: Final = 128 * _MIB
LOW_LARGEST_FREE_BYTES: Final = 96 * _MIB
LOW_SAMPLES_IN_A_ROW: Final = 3
STEP_BYTES: Final = 64 * _MIB
STATIC_PERCENT: Final = 15
DYNAMIC_MIN_PERCENT: Final = 8
DYNAMIC_MAX_PERCENT: Final = 22


class ReservationAdvisor:
    """Bytes one GPU's allocator should keep in reserve, from a sample of its stats every ADVICE_PERIOD_S."""

    def __init__(self, mode: ReservationMode = "dynamic") -> None:
        if mode not in get_args(ReservationMode):
            raise ValueError(f"reservation mode must be 'dynamic' or 'static', got {mode!r}")
        self.mode: ReservationMode = mode
        self._low_samples = 0
        self._extra_bytes = 0

    def update(self, stats: AllocatorStats) -> int:
        """Take one sample; the advice in bytes."""
        pool = stats.reserved_bytes
        if self.mode == "static":
            return max(KERNEL_CONTIGUOUS_BYTES, pool * STATIC_PERCENT // 100)
        floor = pool * DYNAMIC_MIN_PERCENT // 100
        ceiling = pool * DYNAMIC_MAX_PERCENT // 100
        if stats.largest_free_bytes < LOW_LARGEST_FREE_BYTES:
            self._low_samples += 1
            if self._low_samples == LOW_SAMPLES_IN_A_ROW:
                self._low_samples = 0
                self._extra_bytes = min(self._extra_bytes + STEP_BYTES, ceiling - floor)
        else:
            self._low_samples = 0
        return max(KERNEL_CONTIGUOUS_BYTES, min(ceiling, floor + self._extra_bytes))
