"""Fragmentation of the CUDA caching allocator, computed from `torch.cuda.memory_snapshot()`.

The snapshot is a list of segments (one per `cudaMalloc`), each a dict with `device`, `total_size`,
`allocated_size` and `blocks`; a block has `size` and `state`: `active_allocated`, `active_pending_free`
(freed, waiting for another stream; torch's docstring calls it `active_awaiting_free`) or `inactive`.
Only `inactive` blocks are free: they can serve the next allocation. The allocator merges neighbouring
inactive blocks of a segment, so every inactive block is a maximal contiguous free range.

The model: α = largest contiguous free block / total free, and the entropy H of
the free-block size distribution. H is the Shannon entropy, in bits, of the distribution that gives each free
block the share of free bytes it holds: H = −Σ pᵢ·log₂ pᵢ with pᵢ = sizeᵢ / free bytes. One free block gives
H = 0; n equal blocks give log₂ n, so 2^H is the effective number of free blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

_FREE_STATE = "inactive"


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """One device's allocator pool: free space, how it is split, and the memory around it (bytes)."""

    device: int
    fragmentation_ratio: float
    """1 − α; 0 when nothing is free."""
    free_entropy: float
    """H of the free-block size distribution, in bits."""
    largest_free_ratio: float
    """α = largest_free_bytes / free_bytes; 1 when nothing is free."""
    largest_free_bytes: int
    free_bytes: int
    """Inactive blocks inside the reserved segments."""
    reserved_bytes: int
    """Sum of the segments' sizes: what the allocator holds from CUDA."""
    allocated_bytes: int
    """Bytes in `active_allocated` blocks."""


@dataclass
class _Pool:
    reserved: int = 0
    allocated: int = 0
    free_blocks: list[int] = field(default_factory=list)

    def stats(self, device: int) -> AllocatorStats:
        free = sum(self.free_blocks)
        largest = max(self.free_blocks, default=0)
        alpha = largest / free if free else 1.0
        entropy = sum(size / free * math.log2(free / size) for size in self.free_blocks if size) if free else 0.0
        return AllocatorStats(
            device=device,
            fragmentation_ratio=1.0 - alpha,
            free_entropy=entropy,
            largest_free_ratio=alpha,
            largest_free_bytes=largest,
            free_bytes=free,
            reserved_bytes=self.reserved,
            allocated_bytes=self.allocated,
        )


def allocator_stats_from_snapshot(snapshot: Iterable[Mapping[str, Any]]) -> list[AllocatorStats]:
    """Stats of every device that holds a segment in `snapshot` (torch's format), ordered by device."""
    pools: dict[int, _Pool] = {}
    for segment in snapshot:
        pool = pools.setdefault(int(segment["device"]), _Pool())
        pool.reserved += int(segment["total_size"])
        pool.allocated += int(segment["allocated_size"])
        pool.free_blocks.extend(int(block["size"]) for block in segment["blocks"] if block["state"] == _FREE_STATE)
    return [pools[device].stats(device) for device in sorted(pools)]
