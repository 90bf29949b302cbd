"""What the parts of Prism must agree on beyond the wire format: node health, NUMA weights, A/B arm and
zone assignment, modality slices, the TTFT SLO, the KV Bloom filter, the published prefill speed, the network stall and
the one quantile rule."""

from ._arms import assign_arm, assign_zone
from ._bloom import (
    BLOOM_BITS,
    BLOOM_CAPACITY,
    BLOOM_HASHES,
    CountingBloom,
    block_key,
    bloom_contains,
    bloom_false_positive_rate,
    bloom_overlap,
)
from ._health import DIMENSIONS, Dimension, Health, health
from ._modality import DEFAULT_SLICE, ENGINE_LATENCY_KEY, MODALITY_HEADER, Slice, parse_signature
from ._numa import CROSS_NUMA, SAME_NUMA, numa_factor
from ._slo import SLO_SCALE, TAU0_MS, ttft_slo_s
from ._speed import callers_speeds, held_speed
from ._stall import RTO_MIN_MS, STALL_SMOOTHING_S, network_stall_ms
from ._stats import quantile

__all__ = [
    "BLOOM_BITS",
    "BLOOM_CAPACITY",
    "BLOOM_HASHES",
    "CROSS_NUMA",
    "CountingBloom",
    "DEFAULT_SLICE",
    "DIMENSIONS",
    "Dimension",
    "ENGINE_LATENCY_KEY",
    "Health",
    "MODALITY_HEADER",
    "RTO_MIN_MS",
    "SAME_NUMA",
    "SLO_SCALE",
    "STALL_SMOOTHING_S",
    "Slice",
    "TAU0_MS",
    "assign_arm",
    "assign_zone",
    "block_key",
    "bloom_contains",
    "bloom_false_positive_rate",
    "bloom_overlap",
    "callers_speeds",
    "health",
    "held_speed",
    "network_stall_ms",
    "numa_factor",
    "parse_signature",
    "quantile",
    "ttft_slo_s",
]
