"""Node health from whatever dimensions a node vector carries (SPEC §3 weights, renormalised)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

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


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("gpu_mem_frag_ratio", attrgetter("gpu_mem_frag_ratio"), 0.45, 0.32),
    Dimension("kv_cache_miss_ratio", attrgetter("kv_cache_miss_ratio"), 0.18, 0.27),
    Dimension("cpu_preproc_p95_ms", attrgetter("cpu_preproc_p95_ms"), 120.0, 0.21),
    Dimension("nvlink_util_ratio", attrgetter("nvlink_util_ratio"), 0.82, 0.20),
    # Host dimensions (not in the design article): weighted below every GPU/engine dimension.
    Dimension("cpu_util_ratio", attrgetter("cpu_util_ratio"), 0.90, 0.10),
    Dimension("mem_util_ratio", _mem_util, 0.90, 0.10),
)


@dataclass(frozen=True)
class Health:
    score: float
    alarms: tuple[str, ...]
    dimensions: tuple[str, ...]


_DIMENSION_ROWS = tuple((d.name, d.read, d.alarm, d.weight) for d in DIMENSIONS)


def health(metrics: NodeMetrics) -> Health:
    """Weighted mean of the present dimensions' scores, 1.0 when none is present. A dimension scores 1.0 when
    idle, 0.5 at its alarm threshold and 0.0 from twice the threshold (written inline: the brain scores every
    vector it takes)."""
    total_weight = 0.0
    weighted = 0.0
    alarms: list[str] = []
    present: list[str] = []
    for name, read, alarm, weight in _DIMENSION_ROWS:
        value = read(metrics)
        if value is None:
            continue
        present.append(name)
        total_weight += weight
        score = 1.0 - 0.5 * value / alarm
        if score > 0.0:
            weighted += weight * score
        if value > alarm:
            alarms.append(name)
    score = weighted / total_weight if total_weight else 1.0
    return Health(score=score, alarms=tuple(alarms), dimensions=tuple(present))
