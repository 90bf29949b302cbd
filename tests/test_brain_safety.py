"""No wire-valid input stops the brain: any vectors, the extremes of every bound, a node whose handling fails."""

from __future__ import annotations

import math
import time

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from prismlb.brain import Brain, BrainConfig
from prismlb.brain._tables import TableBuilder
from prismlb.wire import (
    MAX_MS,
    FutureSampleError,
    GpuState,
    ModalityLatency,
    NodeMetrics,
    NodeVector,
    RoutingTable,
    SliceTable,
    TableEncoder,
    TableNode,
    decode,
    encode,
)
from prismlb.wire._messages import MAX_COUNT, MAX_REQUESTS, MAX_UNIX_S

NOW = time.time()


def _float(high: float) -> st.SearchStrategy[float]:
    """Any value within [0, high], its ends and tiny values included."""
    return st.one_of(st.just(0.0), st.just(high), st.floats(min_value=0.0, max_value=high, allow_nan=False))


def _maybe(strategy: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.one_of(st.none(), strategy)


ratios = _float(1.0)
metrics = st.builds(
    NodeMetrics,
    cpu_util_ratio=_maybe(ratios),
    mem_used_bytes=_maybe(st.integers(0, MAX_COUNT)),
    mem_total_bytes=_maybe(st.integers(0, MAX_COUNT)),
    gpu_mem_frag_ratio=_maybe(ratios),
    kv_cache_miss_ratio=_maybe(ratios),
    cpu_preproc_p95_ms=_maybe(_float(MAX_MS)),
    nvlink_util_ratio=_maybe(ratios),
    gpu_util_ratio=_maybe(ratios),
    kv_cache_usage_ratio=_maybe(ratios),
    requests_running=_maybe(st.integers(0, MAX_REQUESTS)),
    requests_waiting=_maybe(st.integers(0, MAX_REQUESTS)),
    requests_per_s=_maybe(_float(float(MAX_REQUESTS))),
)
latency = st.builds(
    ModalityLatency,
    requests=st.integers(0, MAX_COUNT),
    errors=st.integers(0, MAX_COUNT),
    ttft_p99_ms=_maybe(_float(MAX_MS)),
    ttft_p50_ms=_maybe(_float(MAX_MS)),
    e2e_p99_ms=_maybe(_float(MAX_MS)),
)
gpus = st.lists(
    st.builds(
        GpuState,
        index=st.integers(0, 7),
        uuid=st.just("GPU-x"),
        mem_used_bytes=st.integers(0, MAX_COUNT),
        mem_total_bytes=st.integers(0, MAX_COUNT),
        pcie_util_ratio=_maybe(ratios),
        numa_node=_maybe(st.integers(0, MAX_COUNT)),
    ),
    max_size=3,
    unique_by=lambda g: g.index,
)
vectors = st.builds(
    NodeVector,
    node_id=st.sampled_from(["n0", "n1", "n2", "n3"]),
    host=st.just("h"),
    endpoint=st.sampled_from(["http://a:1", "http://b:2"]),
    zone=st.sampled_from(["", "z1"]),
    labels=st.sampled_from([{}, {"gpu": "h100"}, {"gpu": "l40s", "model_version": "v2"}, {"modality": "av"}]),
    seq=st.integers(0, MAX_COUNT),
    sample_time_unix_s=_float(NOW),
    period_s=st.floats(min_value=1e-3, max_value=3600.0),
    metrics=metrics,
    started_unix_s=_maybe(_float(MAX_UNIX_S)),
    latency=st.dictionaries(st.sampled_from(["llm", "vlm", "av", "rag", "engine"]), latency, max_size=3),
    gpus=gpus,
)


def _wire(vector: NodeVector) -> NodeVector:
    """What the brain would receive: the vector through the codec (which must take every generated one)."""
    return decode(encode(vector), (NodeVector,), 1 << 16)


def quiet_brain() -> Brain:
    """A brain publishing at once, with latency weights: their path reads more of each vector (its latency entries)
    than the default's, so hostile vectors meet every step the default takes and more."""
    config = BrainConfig(holddown_s=0.0, train_budget_s=0.0, admin_port=0, latency_weights=True)
    return Brain(config, CollectorRegistry())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches=st.lists(st.lists(vectors, min_size=1, max_size=6), min_size=1, max_size=5))
def test_any_wire_valid_vectors_keep_the_brain_publishing(batches: list[list[NodeVector]]) -> None:
    brain = quiet_brain()
    encoder = TableEncoder()
    now = 0.0
    published = 0
    for batch in batches:
        brain.ingest([_wire(v) for v in batch], now)
        for _ in range(6):  # past a predict, a control period and several cycles
            table = brain.tick(now, NOW)
            if table is not None:
                encoder.update(table)  # what the publisher checks: routers would accept every message
                published += 1
            now += 1.0
    assert brain.faults.counts() == {}, "no step failed"
    assert published >= 1 and brain.current is not None
    assert {n.node_id for s in brain.current.slices for n in s.nodes} <= {"n0", "n1", "n2", "n3"}


def test_the_extremes_of_every_bound_are_routed_on() -> None:
    brain = quiet_brain()
    extreme = NodeVector(
        node_id="hot",
        host="h",
        endpoint="http://hot:1",
        seq=1,
        sample_time_unix_s=NOW,
        period_s=1.0,
        metrics=NodeMetrics(requests_running=MAX_REQUESTS, requests_waiting=MAX_REQUESTS, cpu_preproc_p95_ms=MAX_MS),
        latency={"llm": ModalityLatency(requests=MAX_COUNT, ttft_p99_ms=MAX_MS)},
    )
    calm = msgspec.structs.replace(extreme, node_id="calm", endpoint="http://calm:1", metrics=NodeMetrics(), latency={})
    brain.ingest([_wire(extreme), _wire(calm)], 0.0)
    table = brain.tick(0.0, NOW)
    assert table is not None
    TableEncoder().update(table)
    llm = next(s for s in table.slices if s.name == "llm")
    weights = {n.node_id: n.weight for n in llm.nodes}
    assert weights["hot"] < weights["calm"], "the extreme node is weighed down, not a crash"


def test_a_node_whose_handling_fails_is_isolated_and_the_rest_published() -> None:
    """Vectors made in-process (a simulation, a bug) skip the codec's bounds: one absurd node costs only itself."""
    brain = quiet_brain()
    good = NodeVector(
        node_id="good", host="h", endpoint="http://g:1", seq=1, sample_time_unix_s=NOW, period_s=1.0, metrics=NodeMetrics()
    )
    absurd = msgspec.structs.replace(
        good,
        node_id="absurd",
        metrics=NodeMetrics(requests_running=2 * 10**12),
        latency={"llm": ModalityLatency(requests=1, ttft_p99_ms=1e200)},
    )
    brain.ingest([good, absurd], 0.0)
    table = brain.tick(0.0, NOW)
    assert table is not None
    TableEncoder().update(table)  # the builder clamped what the wire would refuse
    nodes = {n.node_id: n for s in table.slices for n in s.nodes}
    assert set(nodes) == {"good", "absurd"} and nodes["absurd"].load is not None and nodes["absurd"].load <= 1e12
    assert brain.tables.clamped >= 1

    class Exploding(dict):  # a node whose latency map fails to read: the weights step must isolate it
        def get(self, key: object, default: object = None) -> object:
            raise RuntimeError("unreadable latency")

    broken = msgspec.structs.replace(good, node_id="broken", seq=2, latency=Exploding())
    brain.ingest([broken], 1.0)
    brain.tick(1.0, NOW)  # routing did not change: no new table, and no exception
    assert brain.current is not None and "broken" not in {n.node_id for s in brain.current.slices for n in s.nodes}
    assert "broken" not in brain.registry.nodes, "left out until its next vector"
    assert brain.faults.counts().get("node_weights") == 1


def test_a_future_sample_time_cannot_pin_a_node() -> None:
    brain = quiet_brain()
    real = NodeVector(
        node_id="n", host="h", endpoint="http://n:1", seq=5, sample_time_unix_s=NOW, period_s=1.0, metrics=NodeMetrics()
    )
    spoof = msgspec.structs.replace(real, seq=10**9, sample_time_unix_s=NOW + 10 * 3600, endpoint="http://evil:1")
    brain.ingest([real, spoof], 0.0)
    assert brain.rejects.counts() == {FutureSampleError.kind: 1}
    later = msgspec.structs.replace(real, seq=6, sample_time_unix_s=NOW + 1)
    brain.ingest([later], 1.0)
    assert brain.registry.nodes["n"].vector.endpoint == "http://n:1" and brain.registry.nodes["n"].vector.seq == 6


def test_the_table_builder_clamps_rather_than_raises() -> None:
    builder = TableBuilder(1)
    odd = [
        TableNode(node_id="a", endpoint="e", weight=math.nan, load=math.inf, predicted_p99_ms=-1.0),
        TableNode(node_id="b", endpoint="e", weight=7.0, load=1e300, predicted_p99_ms=math.nan),
    ]
    table = builder.build({"llm": odd})  # type: ignore[dict-item]
    assert table is not None and builder.clamped == 2
    nodes = table.slices[0].nodes
    assert [(n.weight, n.load, n.predicted_p99_ms) for n in nodes] == [(0.05, 1e12, None), (1.0, 1e12, None)]
    wire = decode(encode(table), (RoutingTable,), 1 << 24)
    assert wire.slices[0] == SliceTable(name=table.slices[0].name, nodes=nodes, fallback=table.slices[0].fallback)
