"""Sliding windows, and the signals the agent derives from the worker library's spans and metrics."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    Gauge,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.proto.trace.v1.trace_pb2 import (
    ResourceSpans,
    ScopeSpans,
    Span,
    Status,
)

from prismlb.agent._signals import SpanSignals
from prismlb.agent._windows import Window

from .conftest import Clock

START_S = 1000.0
"""Where the tests' clocks start."""


def kv(key: str, value: str | int | float) -> KeyValue:
    if isinstance(value, str):
        return KeyValue(key=key, value=AnyValue(string_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(double_value=value))


def span(name: str, duration_ms: float, attrs: dict[str, str | int | float] | None = None) -> Span:
    s = Span(name=name, start_time_unix_nano=10**18, end_time_unix_nano=10**18 + int(duration_ms * 1e6))
    s.attributes.extend(kv(k, v) for k, v in (attrs or {}).items())
    return s


def traces(*spans: Span) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=list(spans))])])


def fragmentation(
    points: dict[int, float], name: str = "prism.gpu.allocator.fragmentation"
) -> ExportMetricsServiceRequest:
    gauge = Gauge(
        data_points=[NumberDataPoint(as_double=v, attributes=[kv("gpu.index", g)]) for g, v in points.items()]
    )
    metric = Metric(name=name, gauge=gauge)
    return ExportMetricsServiceRequest(
        resource_metrics=[ResourceMetrics(scope_metrics=[ScopeMetrics(metrics=[metric])])]
    )


def test_window_forgets_old_values_and_is_bounded() -> None:
    w = Window(10.0, max_samples=5)
    for t in range(8):
        w.add(float(t), at_s=float(t))
    assert w.values(7.0) == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert w.values(15.5) == [6.0, 7.0]
    w.add(float("nan"), 16.0)
    assert w.rate(16.0) == pytest.approx(0.1)
    assert Window(1.0).quantiles(0.0, (0.5,)) is None


def test_request_spans_give_per_slice_latency_and_rate() -> None:
    clock = Clock(START_S)
    signals = SpanSignals(load_window_s=10.0, clock=clock)
    signals.on_traces(
        traces(
            *(span("prism.request", 100.0 + i, {"prism.slice": "vlm", "prism.ttft_ms": float(i)}) for i in range(100))
        )
    )
    signals.on_traces(traces(span("prism.request", 50.0), span("other", 5.0)))
    latency = signals.latency()
    assert set(latency) == {"vlm", "llm"}
    assert latency["vlm"].requests == 100
    assert latency["vlm"].ttft_p50_ms == pytest.approx(49.5)
    assert latency["vlm"].e2e_p99_ms == pytest.approx(100.0 + 98.01, rel=1e-6)
    assert latency["llm"].ttft_p99_ms is None and latency["llm"].e2e_p50_ms == pytest.approx(50.0)
    assert signals.requests_per_s() == pytest.approx(10.1)
    clock.now += 11
    assert signals.latency() == {} and signals.requests_per_s() == 0.0


def test_unknown_slice_attribute_counts_as_default() -> None:
    signals = SpanSignals(clock=Clock(START_S))
    signals.on_traces(traces(span("prism.request", 10.0, {"prism.slice": "hologram"})))
    assert set(signals.latency()) == {"llm"}


def test_cpu_preprocessing_p95_uses_only_cpu_stages() -> None:
    clock = Clock(START_S)
    signals = SpanSignals(preprocessing_window_s=10.0, clock=clock)
    assert signals.cpu_preprocessing_p95_ms() is None
    signals.on_traces(
        traces(*(span("prism.stage.image_decode", float(i), {"prism.stage": "image_decode"}) for i in range(1, 101)))
    )
    signals.on_traces(traces(span("prism.stage.decode", 5000.0, {"prism.stage": "decode"})))
    assert signals.cpu_preprocessing_p95_ms() == pytest.approx(95.05)
    clock.now += 10.5
    assert signals.cpu_preprocessing_p95_ms() is None


def test_fragmentation_takes_the_worst_fresh_gpu() -> None:
    clock = Clock(START_S)
    signals = SpanSignals(clock=clock)
    signals.on_metrics(fragmentation({0: 0.2, 1: 0.6}))
    signals.on_metrics(fragmentation({2: 0.9}, name="something.else"))
    signals.on_metrics(fragmentation({3: 7.0}))
    assert signals.fragmentation_ratio(max_age_s=6) == pytest.approx(0.6)
    clock.now += 3
    signals.on_metrics(fragmentation({1: 0.1}))
    assert signals.fragmentation_ratio(max_age_s=6) == pytest.approx(0.2)
    assert signals.fragmentation_ratio(max_age_s=1) == pytest.approx(0.1)
    clock.now += 10
    assert signals.fragmentation_ratio(max_age_s=6) is None


def test_request_spans_with_error_status_are_counted_per_slice() -> None:
    clock = Clock(START_S)
    signals = SpanSignals(load_window_s=10.0, clock=clock)
    failed = [span("prism.request", 20.0, {"prism.slice": "av"}) for _ in range(3)]
    for s in failed:
        s.status.code = Status.STATUS_CODE_ERROR
    ok = [span("prism.request", 20.0, {"prism.slice": "av"}) for _ in range(7)]
    signals.on_traces(traces(*failed, *ok, span("prism.request", 20.0)))
    latency = signals.latency()
    assert (latency["av"].requests, latency["av"].errors) == (10, 3)
    assert (latency["llm"].requests, latency["llm"].errors) == (1, 0)
    clock.now += 11
    assert signals.latency() == {}


def vllm_span(duration_ms: float, attrs: dict[str, str | int | float]) -> Span:
    """A request span as vLLM's output processor writes it: `llm_request`, SERVER, latencies in seconds."""
    s = span("llm_request", duration_ms, {"gen_ai.usage.prompt_tokens": 100, "gen_ai.request.id": "cmpl-1", **attrs})
    s.kind = Span.SpanKind.SPAN_KIND_SERVER
    return s


def test_prism_old_prism_and_vllm_request_spans_feed_the_same_windows() -> None:
    genai = span(
        "chat llama-3-8b",
        900.0,
        {"prism.span": "request", "gen_ai.operation.name": "chat", "gen_ai.latency.time_to_first_token": 0.25},
    )
    old = span("prism.request", 1000.0, {"prism.slice": "llm", "prism.ttft_ms": 350.0})
    vllm = vllm_span(50.0, {"gen_ai.latency.time_to_first_token": 0.45, "gen_ai.latency.e2e": 1.1})
    for one, ttft_ms, e2e_ms in ((genai, 250.0, 900.0), (old, 350.0, 1000.0), (vllm, 450.0, 1100.0)):
        signals = SpanSignals(clock=Clock(START_S))
        signals.on_traces(traces(one))
        alone = signals.latency()
        assert set(alone) == {"llm"}, one.name  # no prism.slice (vLLM, this GenAI span): the default slice
        assert (alone["llm"].ttft_p50_ms, alone["llm"].e2e_p50_ms) == pytest.approx((ttft_ms, e2e_ms)), one.name
    signals = SpanSignals(clock=Clock(START_S))
    signals.on_traces(traces(genai, old, vllm))
    llm = signals.latency()["llm"]
    assert llm.requests == 3
    assert (llm.ttft_p50_ms, llm.ttft_p99_ms) == pytest.approx((350.0, 350.0 + 0.98 * 100.0))
    assert (llm.e2e_p50_ms, llm.e2e_p99_ms) == pytest.approx((1000.0, 1000.0 + 0.98 * 100.0))
    assert signals.invalid.counts() == {}


def test_a_genai_request_span_without_ttft_or_with_an_error_still_counts() -> None:
    clock = Clock(START_S)
    signals = SpanSignals(clock=clock)
    failed = span("chat m", 30.0, {"prism.span": "request", "prism.slice": "av"})
    failed.status.code = Status.STATUS_CODE_ERROR
    signals.on_traces(traces(failed, span("chat m", 10.0, {"prism.span": "stage"})))
    latency = signals.latency()
    assert set(latency) == {"av"}
    assert (latency["av"].requests, latency["av"].errors, latency["av"].ttft_p50_ms) == (1, 1, None)
    assert latency["av"].e2e_p50_ms == pytest.approx(30.0)


def test_bad_engine_latencies_are_counted_and_the_rest_of_the_span_is_used() -> None:
    signals = SpanSignals(clock=Clock(START_S))
    negative_e2e = vllm_span(80.0, {"gen_ai.latency.time_to_first_token": 0.02, "gen_ai.latency.e2e": -1.0})
    text_ttft = vllm_span(60.0, {"gen_ai.latency.time_to_first_token": "soon", "gen_ai.latency.e2e": 0.07})
    endless = vllm_span(60.0, {"gen_ai.latency.time_to_first_token": 1e200, "gen_ai.latency.e2e": 0.07})
    signals.on_traces(traces(negative_e2e, text_ttft, endless))
    llm = signals.latency()["llm"]
    assert llm.requests == 3
    assert llm.e2e_p50_ms == pytest.approx(70.0) and llm.e2e_p99_ms == pytest.approx(80.0 - 0.02 * 10.0)
    assert llm.ttft_p50_ms == pytest.approx(20.0) and llm.ttft_p99_ms == pytest.approx(20.0)
    assert signals.invalid.counts() == {
        ("span", "gen_ai.latency.e2e"): 1,
        ("span", "gen_ai.latency.time_to_first_token"): 2,
    }
