"""The worker library: allocator math on torch-format snapshots, the reservation advisor, and real OTLP export.

Snapshots are built by hand in the format `torch.cuda.memory_snapshot()` returns (see `_snapshot`'s docstring in
torch/cuda/memory.py and THCPModule_memorySnapshot in torch/csrc/cuda/Module.cpp, which names the states
`active_allocated`, `active_pending_free` and `inactive`). This machine has no CUDA: the default provider path
is tested for its one log line and its absence of allocator gauges.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from prismlb.agent._otlp_receiver import EPHEMERAL_PORT, OtlpReceiver
from prismlb.agent._signals import SpanSignals
from prismlb.otel import (
    STAGES,
    AllocatorStats,
    PrismTelemetry,
    ReservationAdvisor,
    allocator_stats_from_snapshot,
    setup,
)
from prismlb.otel import _conventions as conv
from prismlb.wire import ConfigError

from .conftest import wait_for

MIB = 1 << 20
GIB = 1 << 30


# --- snapshots in torch's format ------------------------------------------------------------------------------


def _segment(device: int, blocks: Sequence[tuple[int, str]], address: int = 0x7F0000000000) -> dict[str, Any]:
    """One segment as torch.cuda.memory_snapshot() lists it; `blocks` are (size, state) in address order."""
    total = sum(size for size, _ in blocks)
    allocated = sum(size for size, state in blocks if state == "active_allocated")
    active = sum(size for size, state in blocks if state != "inactive")
    block_dicts = []
    offset = address
    for size, state in blocks:
        requested = size if state != "inactive" else 0
        block_dicts.append({"address": offset, "size": size, "requested_size": requested, "state": state, "frames": []})
        offset += size
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "allocated_size": allocated,
        "active_size": active,
        "requested_size": active,
        "stream": 0,
        "segment_type": "large" if total > MIB else "small",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": block_dicts,
    }


# device 0: free blocks of 8, 2 and 4 MiB (14 MiB free), one 2 MiB block waiting on another stream
SNAPSHOT: list[Mapping[str, Any]] = [
    _segment(
        0, [(4 * MIB, "active_allocated"), (8 * MIB, "inactive"), (6 * MIB, "active_allocated"), (2 * MIB, "inactive")]
    ),
    _segment(0, [(4 * MIB, "inactive"), (2 * MIB, "active_pending_free")], address=0x7F1000000000),
    _segment(1, [(2 * MIB, "active_allocated")], address=0x7F2000000000),
]


def _no_segments() -> list[Mapping[str, Any]]:
    return []


def _by_device(stats: list[AllocatorStats]) -> dict[int, AllocatorStats]:
    return {s.device: s for s in stats}


def test_alpha_fragmentation_and_entropy_by_hand() -> None:
    stats = allocator_stats_from_snapshot(SNAPSHOT)
    assert [s.device for s in stats] == [0, 1]
    gpu0 = stats[0]
    assert gpu0.reserved_bytes == 26 * MIB
    assert gpu0.allocated_bytes == 10 * MIB  # the pending-free block is neither allocated nor free
    assert gpu0.free_bytes == 14 * MIB
    assert gpu0.largest_free_bytes == 8 * MIB
    assert gpu0.largest_free_ratio == pytest.approx(4 / 7)
    assert gpu0.fragmentation_ratio == pytest.approx(3 / 7)
    # p = (4/7, 1/7, 2/7): H = 4/7·log2(7/4) + 1/7·log2(7) + 2/7·log2(7/2) = log2(7) − 10/7
    assert gpu0.free_entropy == pytest.approx(math.log2(7) - 10 / 7)


def test_equal_free_blocks_give_log2_n_bits() -> None:
    snapshot = [_segment(0, [(16 * MIB, "inactive"), (1 * MIB, "active_allocated")] * 4)]
    (stats,) = allocator_stats_from_snapshot(snapshot)
    assert stats.free_entropy == pytest.approx(2.0)
    assert stats.largest_free_ratio == pytest.approx(0.25)
    assert stats.fragmentation_ratio == pytest.approx(0.75)


def test_one_free_block_is_not_fragmented() -> None:
    (stats,) = allocator_stats_from_snapshot([_segment(3, [(2 * MIB, "active_allocated"), (30 * MIB, "inactive")])])
    assert (stats.device, stats.free_entropy, stats.largest_free_ratio, stats.fragmentation_ratio) == (3, 0.0, 1.0, 0.0)


def test_nothing_free() -> None:
    gpu1 = _by_device(allocator_stats_from_snapshot(SNAPSHOT))[1]
    assert gpu1 == AllocatorStats(
        device=1,
        fragmentation_ratio=0.0,
        free_entropy=0.0,
        largest_free_ratio=1.0,
        largest_free_bytes=0,
        free_bytes=0,
        reserved_bytes=2 * MIB,
        allocated_bytes=2 * MIB,
    )
    assert allocator_stats_from_snapshot([]) == []


# --- reservation advice ---------------------------------------------------------------------------------------


def _stats(reserved: int, largest_free: int) -> AllocatorStats:
    return AllocatorStats(
        device=0,
        fragmentation_ratio=0.0,
        free_entropy=0.0,
        largest_free_ratio=1.0,
        largest_free_bytes=largest_free,
        free_bytes=largest_free,
        reserved_bytes=reserved,
        allocated_bytes=reserved - largest_free,
    )


LOW = _stats(10 * GIB, 95 * MIB)  # largest free block under 96 MiB
HIGH = _stats(10 * GIB, 96 * MIB)
FLOOR = 10 * GIB * 8 // 100
CEILING = 10 * GIB * 22 // 100


def test_static_reserves_15_percent_and_ignores_pressure() -> None:
    advisor = ReservationAdvisor("static")
    assert [advisor.update(LOW) for _ in range(6)] == [10 * GIB * 15 // 100] * 6
    assert advisor.update(_stats(512 * MIB, 0)) == 128 * MIB  # 15% is 76.8 MiB: the kernels' 128 MiB wins


def test_dynamic_adds_64_mib_after_three_low_samples_in_a_row() -> None:
    advisor = ReservationAdvisor()
    assert advisor.update(HIGH) == FLOOR  # starts at 8% of the pool
    assert [advisor.update(LOW) for _ in range(3)] == [FLOOR, FLOOR, FLOOR + 64 * MIB]
    assert [advisor.update(LOW) for _ in range(2)] == [FLOOR + 64 * MIB] * 2
    assert advisor.update(HIGH) == FLOOR + 64 * MIB  # the streak is broken: counting starts again
    assert [advisor.update(LOW) for _ in range(3)] == [FLOOR + 64 * MIB] * 2 + [FLOOR + 128 * MIB]


def test_dynamic_stays_within_8_to_22_percent_and_above_128_mib() -> None:
    advisor = ReservationAdvisor("dynamic")
    advice = [advisor.update(LOW) for _ in range(3 * 30)]
    assert advice[-1] == CEILING  # 22.4 steps of 64 MiB fit between 8% and 22%
    assert all(FLOOR <= a <= CEILING for a in advice)
    assert advice.index(CEILING) == 3 * 23 - 1
    assert advisor.update(_stats(20 * GIB, 0)) == 20 * GIB * 8 // 100 + (CEILING - FLOOR)  # bigger pool: more room
    assert ReservationAdvisor().update(_stats(1 * GIB, 0)) == 128 * MIB  # 8% is 81.9 MiB


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match="dynamic"):
        ReservationAdvisor("adaptive")  # type: ignore[arg-type]


# --- export to a real OTLP receiver ---------------------------------------------------------------------------


@dataclass
class Received:
    traces: list[ExportTraceServiceRequest] = field(default_factory=list)
    metrics: list[ExportMetricsServiceRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_traces(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            self.traces.append(request)

    def on_metrics(self, request: ExportMetricsServiceRequest) -> None:
        with self.lock:
            self.metrics.append(request)

    def spans(self) -> list[tuple[dict[str, Any], Span]]:
        """(resource attributes, span) of every span received."""
        with self.lock:
            return [
                (_attrs(rs.resource.attributes), span)
                for request in self.traces
                for rs in request.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            ]

    def gauges(self) -> dict[str, dict[int, float]]:
        """Latest value of every gauge received, by metric name and `gpu.index`."""
        latest: dict[str, dict[int, float]] = {}
        with self.lock:
            for request in self.metrics:
                for rm in request.resource_metrics:
                    assert _attrs(rm.resource.attributes)["process.pid"] == os.getpid()
                    for sm in rm.scope_metrics:
                        for metric in sm.metrics:
                            for point in metric.gauge.data_points:
                                value = point.as_double if point.HasField("as_double") else point.as_int
                                latest.setdefault(metric.name, {})[_attrs(point.attributes)[conv.ATTR_GPU]] = value
        return latest


def _attrs(kvs: Sequence[KeyValue]) -> dict[str, Any]:
    return {kv.key: getattr(kv.value, str(kv.value.WhichOneof("value"))) for kv in kvs}


@pytest.fixture
def received() -> Iterator[tuple[OtlpReceiver, Received]]:
    sink = Received()
    receiver = OtlpReceiver(sink.on_traces, sink.on_metrics, grpc_port=EPHEMERAL_PORT, http_port=EPHEMERAL_PORT)
    receiver.start()
    yield receiver, sink
    receiver.shutdown()


def _url(receiver: OtlpReceiver, protocol: str) -> str:
    return f"http://127.0.0.1:{receiver.grpc_port if protocol == 'grpc' else receiver.http_port}"


def _named(spans: list[tuple[dict[str, Any], Span]]) -> dict[str, tuple[dict[str, Any], Span]]:
    return {span.name: (resource, span) for resource, span in spans}


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_request_and_stage_spans_arrive(received: tuple[OtlpReceiver, Received], protocol: str) -> None:
    receiver, sink = received
    with setup(
        "test-worker", endpoint=_url(receiver, protocol), protocol=protocol, snapshot_provider=_no_segments
    ) as telemetry:
        telemetry.provider_name = "vllm"
        with telemetry.request("image+text", model="qwen2-vl-7b") as request:
            with telemetry.stage("image_decode"):
                pass
            with telemetry.stage("tokenize"):
                pass
            with telemetry.stage("prefill"):
                ttft_s = request.mark_first_token()
            assert request.mark_first_token() == ttft_s  # the first call wins

            def decode() -> None:  # another thread: the stage still hangs off its request
                with request.stage("decode"):
                    pass

            worker = threading.Thread(target=decode)
            worker.start()
            worker.join()
            request.set_usage(input_tokens=812, output_tokens=64, cached_input_tokens=512)
        assert telemetry.force_flush()
    assert receiver.requests["grpc" if protocol == "grpc" else "http"] > 0

    spans = _named(sink.spans())
    assert set(spans) == {
        "chat qwen2-vl-7b",  # the GenAI span name: {gen_ai.operation.name} {gen_ai.request.model}
        "prism.stage.image_decode",
        "prism.stage.tokenize",
        "prism.stage.prefill",
        "prism.stage.decode",
    }
    resource, root = spans["chat qwen2-vl-7b"]
    assert resource["process.pid"] == os.getpid()
    assert resource["service.name"] == "test-worker"
    assert root.kind == Span.SpanKind.SPAN_KIND_INTERNAL
    assert root.parent_span_id == b""
    assert _attrs(root.attributes) == {
        "prism.span": "request",
        "prism.modality.signature": "image+text",
        "prism.slice": "vlm",
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "qwen2-vl-7b",
        "gen_ai.usage.input_tokens": 812,
        "gen_ai.usage.output_tokens": 64,
        "gen_ai.usage.cache_read.input_tokens": 512,
        "gen_ai.latency.time_to_first_token": ttft_s,
    }
    assert 0 < ttft_s <= (root.end_time_unix_nano - root.start_time_unix_nano) / 1e9  # seconds, inside the request
    for stage in ("image_decode", "tokenize", "prefill", "decode"):
        _, span = spans[f"prism.stage.{stage}"]
        assert (span.trace_id, span.parent_span_id) == (root.trace_id, root.span_id)
        assert span.kind == Span.SpanKind.SPAN_KIND_INTERNAL
        assert _attrs(span.attributes) == {"prism.stage": stage, "prism.slice": "vlm"}
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano


def _in_memory(provider_name: str | None = None) -> tuple[PrismTelemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return PrismTelemetry(tracer_provider, MeterProvider(), provider_name=provider_name), exporter


def test_request_span_name_and_genai_attributes() -> None:
    telemetry, exporter = _in_memory(provider_name="sglang")
    with telemetry:
        with telemetry.request("text", model="llama-3-8b"):
            pass
        with telemetry.request(None, operation="text_completion"):  # no model: the operation alone
            pass
    named = {span.name: dict(span.attributes or {}) for span in exporter.get_finished_spans()}
    assert named == {
        "chat llama-3-8b": {
            "prism.span": "request",
            "prism.modality.signature": "text",
            "prism.slice": "llm",
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "sglang",
            "gen_ai.request.model": "llama-3-8b",
        },
        "text_completion": {
            "prism.span": "request",
            "prism.slice": "llm",
            "gen_ai.operation.name": "text_completion",
            "gen_ai.provider.name": "sglang",
        },
    }
    with pytest.raises(ValueError, match="operation"), telemetry.request("text", operation=""):
        pass
    with pytest.raises(ConfigError, match="provider_name"):
        _in_memory(provider_name="")
    with pytest.raises(ConfigError, match="provider_name"):
        telemetry.provider_name = ""


def test_provider_name_defaults_to_the_engine_the_process_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    for engine in ("vllm", "sglang"):
        monkeypatch.delitem(sys.modules, engine, raising=False)
    telemetry, exporter = _in_memory()
    providers: list[str] = []

    def provider_of_a_request() -> str:
        with telemetry.request("text", model="m"):
            pass
        providers.append(str(exporter.get_finished_spans()[-1].attributes["gen_ai.provider.name"]))  # type: ignore[index]
        return providers[-1]

    assert provider_of_a_request() == "_OTHER"  # no engine known: the conventions' fallback value
    monkeypatch.setitem(sys.modules, "vllm", ModuleType("vllm"))  # the server imports its engine after setup()
    assert provider_of_a_request() == "vllm"
    monkeypatch.setitem(sys.modules, "sglang", ModuleType("sglang"))  # SGLang may import vLLM's kernels too
    assert provider_of_a_request() == "sglang"
    telemetry.provider_name = "my-engine"
    assert provider_of_a_request() == "my-engine"
    assert telemetry.provider_name == "my-engine"
    telemetry.shutdown()


def test_the_agent_reads_ttft_from_prism_old_prism_and_vllm_spans_over_otlp() -> None:
    """The three request-span shapes, each exported by the real SDK over OTLP/gRPC into the agent's receiver:
    prismlb.otel's GenAI-named span (slice vlm here), the earlier `prism.request` span and vLLM's own
    `llm_request` span as vLLM's output processor writes it (both in the default slice)."""
    signals = SpanSignals()
    receiver = OtlpReceiver(signals.on_traces, signals.on_metrics, grpc_port=EPHEMERAL_PORT, http_port=EPHEMERAL_PORT)
    receiver.start()
    try:
        url = _url(receiver, "grpc")
        with setup("new-worker", endpoint=url, protocol="grpc", snapshot_provider=_no_segments) as telemetry:
            with telemetry.request("image+text", model="qwen2-vl-7b") as request:
                ttft_s = request.mark_first_token()
            assert telemetry.force_flush()

        engine = TracerProvider()
        engine.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url, insecure=True)))
        tracer = engine.get_tracer("test")
        arrival_ns = time.time_ns()
        old = tracer.start_span(
            "prism.request", attributes={"prism.slice": "llm", "prism.ttft_ms": 350.0}, start_time=arrival_ns
        )
        old.end(end_time=arrival_ns + 1_000_000_000)
        vllm_attributes = {
            "gen_ai.latency.time_to_first_token": 0.45,
            "gen_ai.latency.e2e": 1.1,
            "gen_ai.latency.time_in_queue": 0.02,
            "gen_ai.usage.prompt_tokens": 100,
            "gen_ai.usage.completion_tokens": 20,
            "gen_ai.request.id": "cmpl-1",
        }
        vllm = tracer.start_span("llm_request", kind=SpanKind.SERVER, attributes=vllm_attributes, start_time=arrival_ns)
        vllm.end(end_time=arrival_ns + 50_000_000)  # the span's own length is not the request's: e2e is the attribute
        engine.shutdown()

        wait_for(lambda: sum(s.requests for s in signals.latency().values()) == 3, what="three request spans")
    finally:
        receiver.shutdown()
    latency = signals.latency()
    assert latency["vlm"].ttft_p50_ms == pytest.approx(ttft_s * 1000)  # seconds on the span, ms in the vector
    assert (latency["llm"].requests, latency["llm"].ttft_p50_ms) == (2, pytest.approx((350.0 + 450.0) / 2))
    assert latency["llm"].ttft_p99_ms == pytest.approx(350.0 + 0.99 * 100.0)
    assert latency["llm"].e2e_p50_ms == pytest.approx((1000.0 + 1100.0) / 2)
    assert signals.invalid.counts() == {}


def test_errors_mark_spans_and_propagate(received: tuple[OtlpReceiver, Received]) -> None:
    receiver, sink = received
    with setup(
        "test-worker", endpoint=_url(receiver, "grpc"), protocol="grpc", snapshot_provider=_no_segments
    ) as telemetry:
        with pytest.raises(KeyError), telemetry.request("audio+text") as request:
            assert request.slice == "av"
            with telemetry.stage("audio_features"):
                raise KeyError("codec")
        with telemetry.request(None) as request:  # no X-Modality-Signature header: the default slice
            assert request.slice == "llm"
        assert telemetry.force_flush()
    by_slice = {
        _attrs(span.attributes)["prism.slice"]: span
        for _, span in sink.spans()
        if _attrs(span.attributes).get("prism.span") == "request"
    }
    stage = _named(sink.spans())["prism.stage.audio_features"][1]
    for span in (by_slice["av"], stage):
        assert span.status.code == Status.STATUS_CODE_ERROR
        assert _attrs(span.attributes)["error.type"] == "KeyError"
    assert [event.name for event in stage.events] == ["exception"]
    assert by_slice["llm"].status.code == Status.STATUS_CODE_UNSET
    assert "prism.modality.signature" not in _attrs(by_slice["llm"].attributes)


def test_stage_names_and_context_are_checked(received: tuple[OtlpReceiver, Received]) -> None:
    receiver, _ = received
    with setup(
        "test-worker", endpoint=_url(receiver, "grpc"), protocol="grpc", snapshot_provider=_no_segments
    ) as telemetry:
        with pytest.raises(RuntimeError, match="no prism request"):
            telemetry.stage("tokenize")
        with telemetry.request("text") as request:
            with pytest.raises(ValueError, match="unknown stage 'detokenize'"):
                telemetry.stage("detokenize")
            with pytest.raises(ValueError, match="non-negative"):
                request.set_usage(output_tokens=-1)
    assert set(STAGES) == {
        "queue",
        "image_decode",
        "audio_features",
        "video_decode",
        "tokenize",
        "encode",
        "prefill",
        "decode",
    }


def test_standard_environment_picks_endpoint_and_protocol(
    received: tuple[OtlpReceiver, Received], monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver, sink = received
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", _url(receiver, "http/protobuf"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    with setup("env-worker", snapshot_provider=_no_segments) as telemetry:
        with telemetry.request("text"):
            pass
        assert telemetry.force_flush()
    assert receiver.requests == {"grpc": 0, "http": 1}
    assert [span.name for _, span in sink.spans()] == ["chat"]


def test_allocator_gauges_arrive(received: tuple[OtlpReceiver, Received]) -> None:
    receiver, sink = received
    snapshot: list[Mapping[str, Any]] = list(SNAPSHOT)
    url = _url(receiver, "http/protobuf")
    with setup(
        "gpu-worker", endpoint=url, protocol="http/protobuf", export_interval_s=60, snapshot_provider=lambda: snapshot
    ) as telemetry:
        assert telemetry.force_flush()
        gauges = sink.gauges()
        assert gauges[conv.METRIC_FRAGMENTATION] == pytest.approx({0: 3 / 7, 1: 0.0})
        assert gauges[conv.METRIC_LARGEST_FREE_RATIO] == pytest.approx({0: 4 / 7, 1: 1.0})
        assert gauges[conv.METRIC_FREE_ENTROPY] == pytest.approx({0: math.log2(7) - 10 / 7, 1: 0.0})
        assert gauges[conv.METRIC_LARGEST_FREE_BYTES] == {0: 8 * MIB, 1: 0}
        assert gauges[conv.METRIC_FREE_BYTES] == {0: 14 * MIB, 1: 0}
        assert gauges[conv.METRIC_RESERVED_BYTES] == {0: 26 * MIB, 1: 2 * MIB}
        assert gauges[conv.METRIC_ALLOCATED_BYTES] == {0: 10 * MIB, 1: 2 * MIB}
        assert gauges[conv.METRIC_RESERVE_ADVICE_BYTES] == {0: 128 * MIB, 1: 128 * MIB}

        # a new snapshot at the next collection; the advice is sampled every 10 s, so it keeps its value
        snapshot[:] = [_segment(0, [(10 * GIB, "inactive")])]
        assert telemetry.force_flush()
        gauges = sink.gauges()
        assert gauges[conv.METRIC_FRAGMENTATION][0] == 0.0
        assert gauges[conv.METRIC_RESERVED_BYTES][0] == 10 * GIB
        assert gauges[conv.METRIC_RESERVE_ADVICE_BYTES][0] == 128 * MIB


def test_gpu_devices_selects_devices_one_snapshot_per_collection(received: tuple[OtlpReceiver, Received]) -> None:
    receiver, sink = received
    calls: list[None] = []

    def provider() -> list[Mapping[str, Any]]:
        calls.append(None)
        return SNAPSHOT

    url = _url(receiver, "grpc")
    with setup(
        "gpu-worker", endpoint=url, export_interval_s=60, gpu_devices=[1], snapshot_provider=provider
    ) as telemetry:
        assert telemetry.force_flush()
        assert len(calls) == 1  # eight gauges, one snapshot
        assert telemetry.force_flush()
        assert len(calls) == 2
    assert sink.gauges()[conv.METRIC_FREE_BYTES] == {1: 0}


def test_failing_snapshot_logs_once_and_recovers(
    received: tuple[OtlpReceiver, Received], caplog: pytest.LogCaptureFixture
) -> None:
    receiver, sink = received
    failing = [True]

    def provider() -> list[Mapping[str, Any]]:
        if failing[0]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return SNAPSHOT

    caplog.set_level(logging.INFO, logger="prism.otel")
    url = _url(receiver, "grpc")
    with setup("gpu-worker", endpoint=url, export_interval_s=60, snapshot_provider=provider) as telemetry:
        assert telemetry.force_flush()
        assert telemetry.force_flush()
        assert sink.gauges() == {}
        failing[0] = False
        assert telemetry.force_flush()
        assert sink.gauges()[conv.METRIC_FREE_BYTES] == {0: 14 * MIB, 1: 0}
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.name == "prism.otel"] == [
        "GPU-allocator snapshot failed, no allocator metrics until it works",
        "GPU-allocator snapshot works again",
    ]


@pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")  # torch without numpy, on import
def test_without_cuda_no_allocator_gauges_and_one_log_line(
    received: tuple[OtlpReceiver, Received], caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    assert not torch.cuda.is_available(), "this test is for a machine without CUDA"
    receiver, sink = received
    caplog.set_level(logging.INFO, logger="prism.otel")
    with setup("cpu-worker", endpoint=_url(receiver, "grpc"), export_interval_s=60) as telemetry:
        with telemetry.request("text"):
            pass
        assert telemetry.force_flush()
    messages = [r.getMessage() for r in caplog.records if r.name == "prism.otel"]
    assert len(messages) == 1 and "no CUDA device" in messages[0]
    assert sink.gauges() == {}
    assert [span.name for _, span in sink.spans()] == ["chat"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"protocol": "http/json"}, "not supported"),
        ({"endpoint": "127.0.0.1:4317"}, "must be a URL"),
        ({"export_interval_s": 0.0}, "positive"),
        ({"gpu_devices": [-1]}, "device indices"),
        ({"reservation": "adaptive"}, "reservation"),
    ],
)
def test_bad_settings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        setup("worker", snapshot_provider=_no_segments, **kwargs)
