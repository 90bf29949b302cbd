"""Messages shared by agent, brain and router (msgspec structs, msgpack on the wire).

Units are in field names. A metric that was not measured is absent (None, omitted on the wire), never 0.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

SCHEMA_VERSION = 1

Count = Annotated[int, msgspec.Meta(ge=0)]
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0.0)]
NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$")]
Name = Annotated[str, msgspec.Meta(max_length=256)]
Labels = Annotated[dict[Annotated[str, msgspec.Meta(min_length=1, max_length=64)], Name], msgspec.Meta(max_length=64)]
Weight = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
SliceName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Bounded = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]  # finite because bounded (no per-struct check)


def _require_finite(struct: msgspec.Struct) -> None:
    for name in struct.__struct_fields__:
        value = getattr(struct, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{type(struct).__name__}.{name} is not finite: {value!r}")


class _Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


class _FiniteMessage(_Message, kw_only=True):
    """A message with unbounded float fields: NaN and infinities are rejected after decoding."""

    def __post_init__(self) -> None:
        _require_finite(self)


class NodeMetrics(_FiniteMessage, kw_only=True):
    """One node's measurements for one sample; absent fields were not measured."""

    # host
    cpu_util_ratio: Ratio | None = None
    mem_used_bytes: Count | None = None
    mem_total_bytes: Count | None = None
    connect_calls_total: Count | None = None
    # the design article's four health dimensions
    gpu_mem_frag_ratio: Ratio | None = None
    kv_cache_miss_ratio: Ratio | None = None
    cpu_preproc_p95_ms: NonNegative | None = None
    nvlink_util_ratio: Ratio | None = None
    # GPUs, summed (memory) or at their worst (utilisation) over the node's devices
    gpu_count: Count | None = None
    gpu_mem_used_bytes: Count | None = None
    gpu_mem_total_bytes: Count | None = None
    gpu_util_ratio: Ratio | None = None
    pcie_util_ratio: Ratio | None = None
    # inference engine
    kv_cache_usage_ratio: Ratio | None = None
    requests_running: Count | None = None
    requests_waiting: Count | None = None
    # load the node served
    requests_per_s: NonNegative | None = None
    health_score: Ratio | None = None


class ModalityLatency(_FiniteMessage, kw_only=True):
    """Observed latency of one modality slice's requests over the agent's window."""

    requests: Count
    errors: Count = 0
    """Of those requests, the ones that ended in an error (request span status ERROR)."""
    ttft_p50_ms: NonNegative | None = None
    ttft_p95_ms: NonNegative | None = None
    ttft_p99_ms: NonNegative | None = None
    e2e_p50_ms: NonNegative | None = None
    e2e_p95_ms: NonNegative | None = None
    e2e_p99_ms: NonNegative | None = None


class GpuState(_FiniteMessage, kw_only=True):
    """One GPU of the node: memory, interconnect load and where it sits in the host's topology."""

    index: Count
    uuid: Name
    name: Name = ""
    mem_used_bytes: Count
    mem_total_bytes: Count
    util_ratio: Ratio | None = None
    nvlink_util_ratio: Ratio | None = None
    pcie_util_ratio: Ratio | None = None
    numa_node: Count | None = None
    nvlink_peers: Annotated[list[Count], msgspec.Meta(max_length=64)] = []


class KvSummary(_Message, kw_only=True):
    """The engine's cached KV blocks as a Bloom filter over their block hashes (compact, no false negatives)."""

    blocks: Count
    bloom: Annotated[bytes, msgspec.Meta(max_length=16384)]
    bloom_hashes: Annotated[int, msgspec.Meta(ge=1, le=16)]
    block_size_tokens: Count | None = None


class NodeVector(_FiniteMessage, kw_only=True):
    """What an agent reports about its node every period."""

    node_id: NodeId
    host: Name
    endpoint: Name
    zone: Name = ""
    labels: Labels = {}
    seq: Count
    sample_time_unix_s: NonNegative
    period_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]
    metrics: NodeMetrics
    started_unix_s: NonNegative | None = None
    alarms: Annotated[list[Name], msgspec.Meta(max_length=32)] = []
    latency: Annotated[dict[SliceName, ModalityLatency], msgspec.Meta(max_length=16)] = {}
    gpus: Annotated[list[GpuState], msgspec.Meta(max_length=64)] = []
    kv: KvSummary | None = None


class TableNode(_Message, kw_only=True):
    """One routing target in a slice: a node, or one GPU of it in topology-aware slices. Its id was checked
    against NodeId's pattern when the node's vectors were; only its length is checked again here, which
    keeps decoding a table (every router, every version) three times cheaper."""

    node_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    endpoint: Name
    weight: Weight
    zone: Name = ""
    model_version: Name = ""
    load: Bounded | None = None  # the brain's estimate of requests on the node (running + waiting)
    predicted_p99_ms: Bounded | None = None
    gpu: Count | None = None
    numa_node: Count | None = None


class SliceTable(_Message, kw_only=True):
    name: SliceName
    nodes: Annotated[list[TableNode], msgspec.Meta(max_length=100_000)]
    fallback: SliceName | None = None  # where this slice's requests go while it has no nodes


class ExperimentArm(_Message, kw_only=True):
    model_version: Name
    fraction: Annotated[float, msgspec.Meta(ge=0.001, le=1.0)]


class Experiment(_Message, kw_only=True):
    """A gray release: a slice's traffic split between model versions, stable per session."""

    name: SliceName
    slice: SliceName
    arms: Annotated[list[ExperimentArm], msgspec.Meta(min_length=1, max_length=16)]


class RoutingTable(_FiniteMessage, kw_only=True):
    """A complete, versioned routing table; (epoch, version) orders tables across brain restarts."""

    epoch: Count
    version: Count
    issued_unix_s: NonNegative
    slices: Annotated[list[SliceTable], msgspec.Meta(max_length=64)]
    experiments: Annotated[list[Experiment], msgspec.Meta(max_length=64)] = []
    shed_classes: Annotated[list[Name], msgspec.Meta(max_length=16)] = []  # refused while the guardian degrades
    guardian: Name = "normal"

    @property
    def order(self) -> tuple[int, int]:
        return (self.epoch, self.version)


class Heartbeat(_FiniteMessage, kw_only=True):
    """Sent by the brain between tables so routers can tell a quiet brain from a missed table."""

    epoch: Count
    version: Count
    issued_unix_s: NonNegative


class SnapshotRequest(_Message, kw_only=True):
    """A late-joining router asks for the current table."""


Message = NodeVector | RoutingTable | Heartbeat | SnapshotRequest
