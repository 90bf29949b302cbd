"""Node health from whatever dimensions a node vector carries (SPEC §3 weights, renormalised)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._messages import NodeMetrics


def _mem_util(m: NodeMetrics) -> float | None:
    if m.mem_used_bytes is None or not m.mem_total_bytes:
        return None
    return m.mem_used_bytes / m.mem_total_bytes


@dataclass(frozen=True)
class Dimension:
    """One health dimension: how to read it, where it alarms (same unit) and its weight."""

    name: str
    read: Callable[[NodeMetrics], float | None]
    alarm: float
    weight: float

    def score(self, value: float) -> float:
        """1.0 when idle, 0.5 at the alarm threshold, 0.0 at twice the threshold."""
        return max(0.0, 1.0 - 0.5 * value / self.alarm)


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("gpu_mem_frag_ratio", lambda m: m.gpu_mem_frag_ratio, 0.45, 0.32),
    Dimension("kv_cache_miss_ratio", lambda m: m.kv_cache_miss_ratio, 0.18, 0.27),
    Dimension("cpu_preproc_p95_ms", lambda m: m.cpu_preproc_p95_ms, 120.0, 0.21),
    Dimension("nvlink_util_ratio", lambda m: m.nvlink_util_ratio, 0.82, 0.20),
    # Host dimensions (not in the design article): weighted below every GPU/engine dimension.
    Dimension("cpu_util_ratio", lambda m: m.cpu_util_ratio, 0.90, 0.10),
    Dimension("mem_util_ratio", _mem_util, 0.90, 0.10),
)


@dataclass(frozen=True)
class Health:
    score: float
    alarms: tuple[str, ...]
    dimensions: tuple[str, ...]


def health(metrics: NodeMetrics) -> Health:
    """Weighted mean of the present dimensions' scores; 1.0 when none is present."""
    total_weight = 0.0
    weighted = 0.0
    alarms: list[str] = []
    present: list[str] = []
    for dim in DIMENSIONS:
        value = dim.read(metrics)
        if value is None:
            continue
        present.append(dim.name)
        total_weight += dim.weight
        weighted += dim.weight * dim.score(value)
        if value > dim.alarm:
            alarms.append(dim.name)
    score = weighted / total_weight if total_weight else 1.0
    return Health(score=score, alarms=tuple(alarms), dimensions=tuple(present))
