"""Topology-aware entries (MoE experts spread across GPUs): one table entry per GPU.

The AV slice (audio/video multi-turn, served by MoE models whose experts span GPUs) is topology-aware: each
GPU of a node is its own entry, carrying the GPU index and its NUMA node. The brain publishes each entry's
base weight; the router, which knows its caller's NUMA node, multiplies it by `numa_factor` (1.0 on the same
NUMA node, 0.4 across) and lays out `virtual_nodes` points (base 128) per entry. A GPU whose PCIe
utilisation is over 85% is derated to half its weight, so new work drifts to its siblings until it cools.

The NUMA rule itself is `prismlb.semantics.numa_factor`, shared with the router.
"""

from __future__ import annotations

from dataclasses import dataclass

from prismlb.semantics import Slice, numa_factor
from prismlb.wire import GpuState, NodeVector

TOPOLOGY_SLICES = frozenset({Slice.AV})
BASE_VIRTUAL_NODES = 128
PCIE_DERATE_ABOVE_RATIO = 0.85
PCIE_DERATE = 0.5


def virtual_nodes(weight: float, caller_numa: int | None, gpu_numa: int | None) -> int:
    """Ring points for an entry of `weight` seen from a caller on `caller_numa` (at least one)."""
    return max(1, round(BASE_VIRTUAL_NODES * weight * numa_factor(caller_numa, gpu_numa)))


def pcie_factor(gpu: GpuState) -> float:
    """PCIE_DERATE when the GPU's PCIe utilisation is over 85%, else 1.0 (unknown utilisation: 1.0)."""
    if gpu.pcie_util_ratio is not None and gpu.pcie_util_ratio > PCIE_DERATE_ABOVE_RATIO:
        return PCIE_DERATE
    return 1.0


@dataclass(frozen=True)
class GpuEntry:
    """Where a table entry sits in its node: one GPU, or the whole node (gpu None)."""

    gpu: int | None
    numa_node: int | None
    factor: float  # multiplies the node's weight
    share: float  # this entry's part of the node's load


WHOLE_NODE = GpuEntry(gpu=None, numa_node=None, factor=1.0, share=1.0)


def gpu_entries(vector: NodeVector) -> list[GpuEntry]:
    """One entry per GPU, by index, sharing the node's load evenly; WHOLE_NODE without GPU data."""
    if not vector.gpus:
        return [WHOLE_NODE]
    share = 1.0 / len(vector.gpus)
    return [GpuEntry(g.index, g.numa_node, pcie_factor(g), share) for g in sorted(vector.gpus, key=lambda g: g.index)]
