"""Node vectors for the tests that feed a brain: what a test does not care about derived from the node's name and
the vector's number, so that each test names only the fields it is about."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prismlb.wire import GpuState, ModalityLatency, NodeMetrics, NodeVector


def node_vector(
    node_id: str,
    seq: int,
    *,
    period_s: float = 1.0,
    zone: str = "",
    labels: Mapping[str, str] | None = None,
    metrics: NodeMetrics | None = None,
    latency: Mapping[str, ModalityLatency] | None = None,
    gpus: Sequence[GpuState] = (),
    sample_time_unix_s: float | None = None,
) -> NodeVector:
    """Vector `seq` of `node_id`, a host of its own name serving on port 8000, one every `period_s` from
    1000 s on unless `sample_time_unix_s` says when (a brain on the wall clock)."""
    return NodeVector(
        node_id=node_id,
        host=node_id,
        endpoint=f"http://{node_id}:8000",
        zone=zone,
        labels=dict(labels or {}),
        seq=seq,
        sample_time_unix_s=1000.0 + seq * period_s if sample_time_unix_s is None else sample_time_unix_s,
        period_s=period_s,
        metrics=metrics or NodeMetrics(),
        latency=dict(latency or {}),
        gpus=list(gpus),
    )
