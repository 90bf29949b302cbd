"""The NUMA rule for per-GPU routing entries, shared by the brain (which publishes each entry's NUMA
node) and the router (which knows its caller's)."""

from __future__ import annotations

SAME_NUMA = 1.0
CROSS_NUMA = 0.4


def numa_factor(caller_numa: int | None, gpu_numa: int | None) -> float:
    """1.0 on the caller's NUMA node, 0.4 across; 1.0 when either side's NUMA node is unknown."""
    if caller_numa is None or gpu_numa is None or caller_numa == gpu_numa:
        return SAME_NUMA
    return CROSS_NUMA
