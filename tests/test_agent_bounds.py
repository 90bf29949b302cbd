"""Values read from spans, OTLP metrics and the engine outside their range: dropped and counted, the rest of
the node vector kept; through a real agent (OTLP/HTTP in, ZeroMQ out) and through the collectors alone."""

from __future__ import annotations

import http.client
import math
import time
from collections.abc import Callable

import pytest
import zmq
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    Gauge,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from prometheus_client import CollectorRegistry

from prismlb.agent import AgentConfig
from prismlb.agent._bounds import LATENCY_MS, RATIO, REQUESTS, InvalidValues
from prismlb.agent._engine import EngineCollector
from prismlb.agent._signals import SpanSignals
from prismlb.wire import MAX_VECTOR_BYTES, NodeVector, decode

from .conftest import free_port, reporting_agent, wait_for
from .test_engine import MetricsServer, fixture, server  # noqa: F401 (server is a fixture)

WAIT_S = 15.0
START_NS = 1_700_000_000_000_000_000


def request_span(i: int, ttft: float | str, duration_ms: float = 100.0) -> Span:
    value = AnyValue(string_value=ttft) if isinstance(ttft, str) else AnyValue(double_value=ttft)
    return Span(
        trace_id=bytes(16 * [1]),
        span_id=(i + 1).to_bytes(8, "big"),
        name="prism.request",
        start_time_unix_nano=START_NS,
        end_time_unix_nano=START_NS + int(duration_ms * 1e6),
        attributes=[
            KeyValue(key="prism.slice", value=AnyValue(string_value="vlm")),
            KeyValue(key="prism.ttft_ms", value=value),
        ],
    )


def traces(*spans: Span) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=list(spans))])])


def invalid(registry: CollectorRegistry, source: str, field: str) -> float | None:
    return registry.get_sample_value("prism_agent_invalid_values_total", {"source": source, "field": field})


def run_agent(
    ctx: zmq.Context, until: Callable[[NodeVector], bool], act: Callable[[AgentConfig], None], **settings: object
) -> tuple[NodeVector, CollectorRegistry]:
    """Run an agent, call `act` once its receiver is up, and return the first vector meeting `until`."""
    registry = CollectorRegistry()
    with reporting_agent(ctx, registry, node_id="bounds-node", **settings) as (agent, pull):
        wait_for(lambda: agent.trace_path is not None, WAIT_S, what="the agent's OTLP receiver")
        act(agent.config)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if pull.poll(200):
                vector = decode(pull.recv_multipart(), (NodeVector,), MAX_VECTOR_BYTES)
                if until(vector):
                    return vector, registry
        raise AssertionError("no vector met the condition")


def post_traces(config: AgentConfig, request: ExportTraceServiceRequest) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", config.otlp_http_port, timeout=WAIT_S)
    try:
        conn.request(
            "POST", "/v1/traces", body=request.SerializeToString(), headers={"Content-Type": "application/x-protobuf"}
        )
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_absurd_ttft_attributes_are_dropped_and_counted_the_rest_reaches_the_vector(ctx: zmq.Context) -> None:
    spans = [request_span(i, ttft) for i, ttft in enumerate((10.0, 20.0, -5.0, 1e200, math.nan, "fast"))]
    vector, registry = run_agent(
        ctx,
        lambda v: "vlm" in v.latency,
        lambda config: post_traces(config, traces(*spans)),
        otlp_http_port=free_port(),
    )
    vlm = vector.latency["vlm"]
    assert vlm.requests == 6, "every request counts; only its bad TTFT is dropped"
    assert (vlm.ttft_p50_ms, vlm.ttft_p99_ms) == pytest.approx((15.0, 19.9))
    assert vlm.e2e_p50_ms == pytest.approx(100.0)
    assert invalid(registry, "span", "prism.ttft_ms") == 4
    assert vector.metrics.requests_per_s is not None


def test_an_absurd_engine_gauge_is_dropped_and_counted_the_rest_reaches_the_vector(ctx: zmq.Context) -> None:
    page = fixture("vllm_metrics_1.txt").replace(
        b'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0',
        b'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2e12',
    )
    assert b"2e12" in page
    metrics = MetricsServer()
    metrics.queue(page)
    try:
        vector, registry = run_agent(
            ctx,
            lambda v: v.metrics.kv_cache_usage_ratio is not None,
            lambda _config: None,
            otlp_http_port=0,
            engine_url=metrics.url,
        )
    finally:
        metrics.close()
    assert vector.metrics.requests_running is None
    assert vector.metrics.requests_waiting == 1
    assert vector.metrics.kv_cache_usage_ratio == pytest.approx(0.1)
    assert invalid(registry, "engine", "requests_running") == 1
    assert invalid(registry, "engine", "requests_waiting") is None


def test_bounds_keep_clamp_or_drop() -> None:
    assert LATENCY_MS.fit(0.0) == 0.0 and LATENCY_MS.fit(1e7) == 1e7
    assert LATENCY_MS.fit(-5.0) is None and LATENCY_MS.fit(1e7 + 1) is None and LATENCY_MS.fit(math.inf) is None
    assert REQUESTS.fit(1e9) == 1e9 and REQUESTS.fit(2e12) is None and REQUESTS.fit(-1.0) is None
    assert RATIO.fit(1.004) == 1.0 and RATIO.fit(-0.001) == 0.0, "rounding just outside [0, 1] is clamped"
    assert RATIO.fit(1.5) is None and RATIO.fit(math.nan) is None


def test_span_durations_and_fragmentation_gauges_are_checked_too() -> None:
    signals = SpanSignals(invalid=InvalidValues())
    backwards = request_span(1, 10.0, duration_ms=-50.0)
    endless = request_span(2, 10.0, duration_ms=1e12)
    signals.on_traces(traces(backwards, endless, request_span(3, 12.0)))
    assert signals.latency()["vlm"].e2e_p50_ms == pytest.approx(100.0)
    points = [
        NumberDataPoint(as_double=value, attributes=[KeyValue(key="gpu.index", value=AnyValue(int_value=gpu))])
        for gpu, value in ((0, 0.25), (1, 7.0), (2, math.nan), (3, 1.001))
    ]
    metric = Metric(name="prism.gpu.allocator.fragmentation", gauge=Gauge(data_points=points))
    signals.on_metrics(
        ExportMetricsServiceRequest(resource_metrics=[ResourceMetrics(scope_metrics=[ScopeMetrics(metrics=[metric])])])
    )
    assert signals.fragmentation_ratio(60.0) == 1.0, "1.001 is rounding, clamped; 7 and NaN are dropped"
    assert signals.invalid.counts() == {
        ("span", "prism.request.duration_ms"): 2,
        ("otlp_metric", "prism.gpu.allocator.fragmentation"): 2,
    }


def test_engine_values_out_of_range_are_dropped_one_by_one(server: MetricsServer) -> None:  # noqa: F811
    def page(running: str, waiting: str, usage: str, queries: float, hits: float) -> bytes:
        return (
            f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {waiting}\n"
            f"vllm:kv_cache_usage_perc {usage}\n"
            f"vllm:prefix_cache_queries_total {queries}\nvllm:prefix_cache_hits_total {hits}\n"
        ).encode()

    server.queue(page("NaN", "-3", "1.004", 100, 10))
    server.queue(page("4", "2", "7", 200, 150))  # 140 hits of 100 queries: a miss ratio of -0.4
    collector = EngineCollector(server.url, invalid=InvalidValues())
    first = collector.sample()
    assert (first.requests_running, first.requests_waiting, first.kv_cache_usage_ratio) == (None, None, 1.0)
    second = collector.sample()
    assert (second.requests_running, second.requests_waiting) == (4, 2)
    assert second.kv_cache_usage_ratio is None and second.kv_cache_miss_ratio is None
    assert collector.invalid.counts() == {
        ("engine", "requests_running"): 1,
        ("engine", "requests_waiting"): 1,
        ("engine", "kv_cache_usage_ratio"): 1,
        ("engine", "kv_cache_miss_ratio"): 1,
    }
