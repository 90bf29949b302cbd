"""The agent's OTLP receiver and span forwarder over real sockets, fed by the real OpenTelemetry SDK."""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
from google.rpc.status_pb2 import Status as RpcStatus
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ProtoResource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)
from prometheus_client import CollectorRegistry

from prismlb.agent._otlp_forward import SpanForwarder, readable_spans, upstream_exporter
from prismlb.agent._otlp_receiver import EPHEMERAL_PORT, OtlpReceiver
from prismlb.wire import ConfigError

WAIT_S = 10.0
TRACES = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Sink:
    """Collects what a receiver delivers; `on_traces` may be wrapped to change spans first."""

    def __init__(self, before: Callable[[ExportTraceServiceRequest], None] | None = None) -> None:
        self._cond = threading.Condition()
        self._before = before
        self.traces: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.logs: list[ExportLogsServiceRequest] = []

    def on_traces(self, request: ExportTraceServiceRequest) -> None:
        if self._before is not None:
            self._before(request)
        with self._cond:
            self.traces.append(request)
            self._cond.notify_all()

    def on_metrics(self, request: ExportMetricsServiceRequest) -> None:
        with self._cond:
            self.metrics.append(request)
            self._cond.notify_all()

    def on_logs(self, request: ExportLogsServiceRequest) -> None:
        with self._cond:
            self.logs.append(request)
            self._cond.notify_all()

    def spans(self) -> list[tuple[ResourceSpans, ScopeSpans, Span]]:
        with self._cond:
            return [
                (rs, ss, s)
                for req in self.traces
                for rs in req.resource_spans
                for ss in rs.scope_spans
                for s in ss.spans
            ]

    def wait_spans(self, count: int) -> list[tuple[ResourceSpans, ScopeSpans, Span]]:
        deadline = time.monotonic() + WAIT_S
        while len(found := self.spans()) < count and time.monotonic() < deadline:
            with self._cond:
                self._cond.wait(0.05)
        assert len(found) == count, f"expected {count} spans, got {len(found)}"
        return found


@pytest.fixture
def serve() -> Iterator[Callable[..., OtlpReceiver]]:
    """Start receivers on ephemeral loopback ports; all are shut down after the test."""
    started: list[OtlpReceiver] = []

    def _serve(sink: Sink, **kwargs: Any) -> OtlpReceiver:
        kwargs.setdefault("grpc_port", EPHEMERAL_PORT)
        kwargs.setdefault("http_port", EPHEMERAL_PORT)
        receiver = OtlpReceiver(sink.on_traces, sink.on_metrics, on_logs=sink.on_logs, host="127.0.0.1", **kwargs)
        receiver.start()
        started.append(receiver)
        return receiver

    yield _serve
    for receiver in started:
        receiver.shutdown()


def span_exporter(protocol: str, receiver: OtlpReceiver) -> SpanExporter:
    if protocol == "grpc":
        return GrpcSpanExporter(endpoint=f"127.0.0.1:{receiver.grpc_port}", insecure=True)
    compression = Compression.Gzip if protocol == "http-gzip" else Compression.NoCompression
    return HttpSpanExporter(endpoint=f"http://127.0.0.1:{receiver.http_port}/v1/traces", compression=compression)


def value(v: AnyValue) -> object:
    field = v.WhichOneof("value")
    if field == "array_value":
        return [value(item) for item in v.array_value.values]
    return getattr(v, field) if field else None


def attrs(kvs: Sequence[KeyValue]) -> dict[str, object]:
    return {kv.key: value(kv.value) for kv in kvs}


SPAN_ATTRS: dict[str, Any] = {
    "http.request.method": "POST",
    "server.port": 8000,
    "gen_ai.request.temperature": 0.7,
    "gen_ai.request.stream": True,
    "gen_ai.request.stop_sequences": ("\n", "END"),
    "prism.token_counts": (12, 480),
    "prism.scores": (0.5, 1.25),
    "prism.flags": (True, False),
}


def emit_spans(exporter: SpanExporter, batch: bool = False) -> TracerProvider:
    """An inference server's spans, as the SDK makes them: every attribute type, events, links, status."""
    resource = Resource.create(
        {"service.name": "vllm", "host.gpu.count": 8}, schema_url="https://opentelemetry.io/schemas/1.26.0"
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer(
        "prism.test", "1.2.3", schema_url="https://example.com/s", attributes={"lib.mode": "x"}
    )
    remote_parent = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "v1")]),
    )
    linked = SpanContext(0x5B8EFFF798038103D269B633813FC60C, 0xEEE19B7EC3C1B174, is_remote=True)
    with tracer.start_as_current_span(
        "POST /v1/chat/completions",
        context=set_span_in_context(NonRecordingSpan(remote_parent)),
        kind=SpanKind.SERVER,
        attributes=SPAN_ATTRS,
        links=[Link(linked, {"link.reason": "batch"})],
    ) as server:
        server.add_event("first_token", {"gen_ai.token.index": 0, "prism.ttft_ms": 41.5}, timestamp=time.time_ns())
        with tracer.start_as_current_span("prefill", kind=SpanKind.INTERNAL) as child:
            child.set_status(StatusCode.ERROR, "KV cache exhausted")
        with tracer.start_as_current_span("tokenize", kind=SpanKind.CLIENT) as client:
            client.set_status(StatusCode.OK)
    return provider


@pytest.mark.parametrize("protocol", ["grpc", "http", "http-gzip"])
def test_sdk_spans_arrive_with_attributes_resource_and_scope(serve: Callable[..., OtlpReceiver], protocol: str) -> None:
    sink = Sink()
    registry = CollectorRegistry()
    receiver = serve(sink, registry=registry)
    emit_spans(span_exporter(protocol, receiver)).shutdown()

    spans = sink.wait_spans(3)
    by_name = {s.name: (rs, ss, s) for rs, ss, s in spans}
    rs, ss, server = by_name["POST /v1/chat/completions"]
    assert attrs(server.attributes) == {k: list(v) if isinstance(v, tuple) else v for k, v in SPAN_ATTRS.items()}
    assert server.kind == Span.SpanKind.SPAN_KIND_SERVER
    assert server.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c"
    assert server.parent_span_id.hex() == "b7ad6b7169203331"
    assert [e.name for e in server.events] == ["first_token"]
    assert attrs(server.events[0].attributes) == {"gen_ai.token.index": 0, "prism.ttft_ms": 41.5}
    assert server.links[0].span_id.hex() == "eee19b7ec3c1b174"
    assert attrs(rs.resource.attributes)["service.name"] == "vllm"
    assert attrs(rs.resource.attributes)["host.gpu.count"] == 8
    assert rs.schema_url == "https://opentelemetry.io/schemas/1.26.0"
    assert (ss.scope.name, ss.scope.version, ss.schema_url) == ("prism.test", "1.2.3", "https://example.com/s")
    assert attrs(ss.scope.attributes) == {"lib.mode": "x"}
    _, _, prefill = by_name["prefill"]
    assert (prefill.status.code, prefill.status.message) == (Status.STATUS_CODE_ERROR, "KV cache exhausted")
    assert prefill.parent_span_id == server.span_id

    wire = "grpc" if protocol == "grpc" else "http"
    assert receiver.spans_received == 3
    assert receiver.requests[wire] == 3  # SimpleSpanProcessor: one request per span
    assert registry.get_sample_value("prism_agent_otlp_spans_received_total") == 3
    assert registry.get_sample_value("prism_agent_otlp_requests_total", {"protocol": wire, "signal": "traces"}) == 3


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sdk_metrics_arrive(serve: Callable[..., OtlpReceiver], protocol: str) -> None:
    sink = Sink()
    receiver = serve(sink)
    if protocol == "grpc":
        exporter: Any = GrpcMetricExporter(endpoint=f"127.0.0.1:{receiver.grpc_port}", insecure=True)
    else:
        exporter = HttpMetricExporter(endpoint=f"http://127.0.0.1:{receiver.http_port}/v1/metrics")
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=60_000)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "vllm"}))
    meter = provider.get_meter("prism.test")
    meter.create_counter("gen_ai.requests").add(5, {"route": "/v1/chat"})
    meter.create_counter("gen_ai.requests.other").add(1)
    meter.create_histogram("gen_ai.ttft", unit="ms").record(41.5, {"model": "llama"})
    provider.shutdown()  # exports once more, then stops

    assert sink.metrics, "no metrics request arrived"
    names = {
        m.name for req in sink.metrics for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    assert names == {"gen_ai.requests", "gen_ai.requests.other", "gen_ai.ttft"}
    first = sink.metrics[0].resource_metrics[0]
    assert attrs(first.resource.attributes)["service.name"] == "vllm"
    assert first.scope_metrics[0].scope.name == "prism.test"
    assert receiver.metric_points_received == 3 * len(sink.metrics)


def add_test_attribute(request: ExportTraceServiceRequest) -> None:
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                span.attributes.append(KeyValue(key="prism.net.test", value=AnyValue(int_value=1)))


@pytest.mark.parametrize("upstream", ["grpc", "http"])
def test_forwarded_spans_reach_upstream_unchanged_but_for_the_join(
    serve: Callable[..., OtlpReceiver], upstream: str
) -> None:
    collector_sink = Sink()
    collector = serve(collector_sink)  # B: the "upstream collector"
    forwarder = SpanForwarder(span_exporter(upstream, collector), interval_s=0.05)
    received: list[ExportTraceServiceRequest] = []

    def join_then_forward(request: ExportTraceServiceRequest) -> None:
        add_test_attribute(request)
        received.append(request)
        forwarder.submit(request)

    agent = OtlpReceiver(join_then_forward, lambda _r: None, host="127.0.0.1", grpc_port=EPHEMERAL_PORT, http_port=0)
    agent.start()
    try:
        emit_spans(span_exporter("grpc", agent), batch=True).shutdown()
        assert forwarder.force_flush(WAIT_S)
        forwarded = {s.span_id: (rs, ss, s) for rs, ss, s in collector_sink.wait_spans(3)}
    finally:
        agent.shutdown()
        forwarder.shutdown()

    sent = [(rs, ss, s) for req in received for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert len(sent) == 3
    for rs, ss, span in sent:
        up_rs, up_ss, up_span = forwarded[span.span_id]
        assert up_span == span  # ids, name, kind, times, attributes, events, links, status, flags, trace state
        assert attrs(up_span.attributes)["prism.net.test"] == 1
        assert up_rs.resource == rs.resource and up_rs.schema_url == rs.schema_url
        assert up_ss.scope == ss.scope and up_ss.schema_url == ss.schema_url
    assert (forwarder.exported, forwarder.dropped, forwarder.export_failures) == (3, 0, 0)


def kv(key: str, v: AnyValue) -> KeyValue:
    return KeyValue(key=key, value=v)


def test_conversion_carries_every_value_type_and_dropped_counts() -> None:
    every_type = [
        kv("s", AnyValue(string_value="x")),
        kv("b", AnyValue(bool_value=False)),
        kv("i", AnyValue(int_value=-(2**63))),
        kv("d", AnyValue(double_value=1e-300)),
        kv("bytes", AnyValue(bytes_value=b"\x00\xff")),
        kv("empty", AnyValue()),
        kv(
            "mixed",
            AnyValue(
                array_value=ArrayValue(
                    values=[AnyValue(int_value=1), AnyValue(string_value="a"), AnyValue(array_value=ArrayValue())]
                )
            ),
        ),
        kv("map", AnyValue(kvlist_value=KeyValueList(values=[kv("inner", AnyValue(double_value=2.5))]))),
    ]
    span = Span(
        trace_id=bytes(range(16)),
        span_id=bytes(range(8)),
        parent_span_id=bytes(range(8, 16)),
        trace_state="congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
        name="decode",
        kind=Span.SpanKind.SPAN_KIND_CONSUMER,
        start_time_unix_nano=1,
        end_time_unix_nano=2**63,
        attributes=every_type,
        dropped_attributes_count=3,
        events=[Span.Event(time_unix_nano=5, name="e", attributes=every_type, dropped_attributes_count=1)],
        dropped_events_count=4,
        links=[
            Span.Link(
                trace_id=bytes(16 * [7]),
                span_id=bytes(8 * [9]),
                attributes=every_type,
                dropped_attributes_count=2,
                flags=0x300,
            )
        ],
        dropped_links_count=5,
        status=Status(code=Status.STATUS_CODE_ERROR, message="boom"),
        flags=0x300,
    )
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=ProtoResource(attributes=[kv("service.name", AnyValue(string_value="sglang"))]),
                schema_url="https://r",
                scope_spans=[
                    ScopeSpans(
                        scope=InstrumentationScope(name="n", version="v", attributes=[kv("k", AnyValue(int_value=1))]),
                        schema_url="https://s",
                        spans=[
                            span,
                            Span(
                                trace_id=bytes(16 * [1]),
                                span_id=bytes(8 * [2]),
                                name="root",
                                flags=0x100,
                                kind=Span.SpanKind.SPAN_KIND_INTERNAL,
                                status=Status(),
                            ),
                        ],
                    )
                ],
            )
        ]
    )
    assert encode_spans(list(readable_spans(request))) == request


class BlockingExporter(SpanExporter):
    """An upstream that accepts a batch only when `release` is set (or fails, when `fail` is)."""

    def __init__(self, fail: bool = False) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = fail
        self.batches: list[int] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(WAIT_S)
        self.batches.append(len(spans))
        return SpanExportResult.FAILURE if self.fail else SpanExportResult.SUCCESS


def request_of(count: int, first_id: int = 1) -> ExportTraceServiceRequest:
    spans = [
        Span(trace_id=bytes(16 * [1]), span_id=(first_id + i).to_bytes(8, "big"), name=f"s{i}") for i in range(count)
    ]
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])])


def test_full_queue_drops_and_counts_exactly_the_excess() -> None:
    exporter = BlockingExporter()
    registry = CollectorRegistry()
    forwarder = SpanForwarder(exporter, max_queue=10, max_batch=4, interval_s=0.01, registry=registry)
    try:
        forwarder.submit(request_of(1))
        assert exporter.entered.wait(WAIT_S)  # that span is in flight; the queue is empty and stays so
        forwarder.submit(request_of(7, first_id=100))
        forwarder.submit(request_of(7, first_id=200))  # 3 fit
        forwarder.submit(request_of(2, first_id=300))  # none fit
        assert forwarder.dropped == 6
        assert registry.get_sample_value("prism_agent_otlp_forward_dropped_spans_total") == 6
        assert registry.get_sample_value("prism_agent_otlp_forward_queue_spans") == 10
        exporter.release.set()
        assert forwarder.force_flush(WAIT_S)
        assert forwarder.exported == 11 and sum(exporter.batches) == 11
        assert max(exporter.batches) <= 4
    finally:
        exporter.release.set()
        forwarder.shutdown()


def test_failed_exports_are_counted_and_do_not_stop_forwarding() -> None:
    exporter = BlockingExporter(fail=True)
    exporter.release.set()
    forwarder = SpanForwarder(exporter, max_queue=100, max_batch=5, interval_s=0.01)
    forwarder.submit(request_of(12))
    assert forwarder.force_flush(WAIT_S)
    assert (forwarder.export_failures, forwarder.exported) == (3, 0)
    exporter.fail = False
    forwarder.submit(request_of(2))
    forwarder.shutdown()  # exports what is queued first
    assert (forwarder.export_failures, forwarder.exported) == (3, 2)
    forwarder.submit(request_of(1))
    assert forwarder.dropped == 1  # after shutdown nothing is taken


def post(port: int, body: bytes, path: str = "/v1/traces", method: str = "POST", **headers: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        sent = {"Content-Type": "application/x-protobuf"} | {k.replace("_", "-"): v for k, v in headers.items()}
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_bad_http_input_is_answered_counted_and_survived(serve: Callable[..., OtlpReceiver]) -> None:
    sink = Sink()
    limit = 64 * 1024
    receiver = serve(sink, max_message_bytes=limit)
    port = receiver.http_port
    assert port is not None
    good = request_of(1).SerializeToString()

    status, body = post(port, b"\x0a\xff")
    assert status == 400 and RpcStatus.FromString(body).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert post(port, b"{not json", Content_Type="application/json")[0] == 400
    assert (
        post(
            port,
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
            Content_Type="application/json",
        )[0]
        == 400
    )
    assert post(port, b"[]", Content_Type="application/json")[0] == 400
    assert post(port, bytes(limit + 1))[0] == 413  # read and discarded: the connection stays usable
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:  # too big to read at all
        raw.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 10000000000\r\n\r\n"
        )
        answer = raw.makefile("rb").read()  # the server answers and closes without waiting for the body
    assert answer.startswith(b"HTTP/1.1 413") and b"Connection: close" in answer
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
        raw.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n\r\n")
        assert raw.makefile("rb").read().startswith(b"HTTP/1.1 411")
    assert post(port, good, Content_Encoding="gzip")[0] == 400  # says gzip, is not
    assert post(port, gzip.compress(good)[:-4], Content_Encoding="gzip")[0] == 400  # truncated
    assert post(port, gzip.compress(bytes(4 * limit)), Content_Encoding="gzip")[0] == 413  # inflates too far
    assert post(port, good, Content_Encoding="br")[0] == 415
    assert post(port, good, Content_Type="text/plain")[0] == 415
    assert post(port, good, path="/v1/profiles")[0] == 404
    assert post(port, b"", method="GET")[0] == 405
    assert post(port, b"", path="/", method="GET")[0] == 404

    assert post(port, good)[0] == 200
    assert post(port, gzip.compress(good), Content_Encoding="gzip")[0] == 200
    trace_id, span_id = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    document = {
        "resourceSpans": [
            {
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": trace_id,
                                "spanId": span_id,
                                "name": "GET",
                                "kind": 2,
                                "startTimeUnixNano": "1700000000000000000",
                                "attributes": [{"key": "http.route", "value": {"stringValue": "/v1"}}],
                                "unknownField": 1,
                            }
                        ]
                    }
                ]
            }
        ]
    }
    status, body = post(port, json.dumps(document).encode(), Content_Type="application/json; charset=utf-8")
    assert status == 200 and json.loads(body) == {}
    spans = [s for _, _, s in sink.wait_spans(3)]
    assert (spans[2].trace_id.hex(), spans[2].span_id.hex(), spans[2].kind) == (
        trace_id,
        span_id,
        Span.SpanKind.SPAN_KIND_SERVER,
    )
    assert spans[2].start_time_unix_nano == 1_700_000_000_000_000_000

    assert receiver.rejects["http"].counts() == {
        "malformed_protobuf": 1,
        "malformed_json": 3,
        "oversized": 3,
        "length_required": 1,
        "bad_compression": 2,
        "unsupported_encoding": 1,
        "unsupported_media_type": 1,
        "not_found": 2,
        "method_not_allowed": 1,
    }


def test_http_keeps_a_connection_after_a_reject_and_ends_it_at_shutdown(serve: Callable[..., OtlpReceiver]) -> None:
    sink = Sink()
    receiver = serve(sink, max_message_bytes=1024)
    conn = http.client.HTTPConnection("127.0.0.1", receiver.http_port or 0, timeout=WAIT_S)
    headers = {"Content-Type": "application/x-protobuf"}
    try:
        for body, expected in ((b"\x0a\xff", 400), (bytes(2000), 413), (request_of(1).SerializeToString(), 200)):
            conn.request("POST", "/v1/traces", body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            assert response.status == expected
        receiver.shutdown()
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            conn.request("POST", "/v1/traces", body=request_of(1).SerializeToString(), headers=headers)
            conn.getresponse()
    finally:
        conn.close()
    assert receiver.spans_received == 1


def test_a_failing_callback_is_an_internal_error_not_a_crash(serve: Callable[..., OtlpReceiver]) -> None:
    calls: list[int] = []

    def flaky(_request: ExportTraceServiceRequest) -> None:
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("bug in the join")

    sink = Sink(before=flaky)
    receiver = serve(sink)
    assert post(receiver.http_port or 0, request_of(1).SerializeToString())[0] == 500
    with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as channel:
        stub = TraceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            stub.Export(request_of(1), timeout=WAIT_S)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        stub.Export(request_of(1), timeout=WAIT_S)
    assert post(receiver.http_port or 0, request_of(1).SerializeToString())[0] == 200
    assert len(sink.wait_spans(2)) == 2


def test_bad_grpc_input_is_answered_counted_and_survived(serve: Callable[..., OtlpReceiver]) -> None:
    sink = Sink()
    receiver = serve(sink, max_message_bytes=64 * 1024)
    with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as channel:
        raw = channel.unary_unary(TRACES)
        with pytest.raises(grpc.RpcError) as garbage:
            raw(b"\x0a\xff", timeout=WAIT_S)
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as oversized:
            raw(bytes(128 * 1024), timeout=WAIT_S)
        assert oversized.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        bad_ids = request_of(2)
        bad_ids.resource_spans[0].scope_spans[0].spans[1].trace_id = b"\x01\x02\x03\x04"
        response = TraceServiceStub(channel).Export(bad_ids, timeout=WAIT_S)
        assert isinstance(response, ExportTraceServiceResponse)
        assert response.partial_success.rejected_spans == 1
    assert len(sink.wait_spans(1)) == 1
    assert receiver.rejects["grpc"].counts() == {"malformed_protobuf": 1, "invalid_id": 1}
    assert receiver.spans_received == 1


def test_ports_off_and_ephemeral(serve: Callable[..., OtlpReceiver]) -> None:
    sink = Sink()
    only_http = serve(sink, grpc_port=0)
    assert only_http.grpc_port is None and only_http.http_port
    assert only_http.addresses == [("127.0.0.1", only_http.http_port)]
    off = OtlpReceiver(sink.on_traces, sink.on_metrics, grpc_port=0, http_port=0)
    off.start()
    assert off.addresses == []
    off.shutdown()
    with pytest.raises(ConfigError, match="HTTP port must be 0"):
        OtlpReceiver(sink.on_traces, sink.on_metrics, grpc_port=0, http_port=65536)
    with pytest.raises(ConfigError, match="gRPC port must be 0"):
        OtlpReceiver(sink.on_traces, sink.on_metrics, grpc_port=-2, http_port=0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.raises(ConfigError, match="OTLP/gRPC"):
            OtlpReceiver(sink.on_traces, sink.on_metrics, host="127.0.0.1", grpc_port=taken, http_port=0)
        with pytest.raises(ConfigError, match="OTLP/HTTP"):
            OtlpReceiver(sink.on_traces, sink.on_metrics, host="127.0.0.1", grpc_port=0, http_port=taken)


ENV = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
)


def test_upstream_exporter_follows_the_standard_variables(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    own = [("127.0.0.1", 4317), ("127.0.0.1", 4318)]
    with caplog.at_level(logging.INFO, logger="prism.agent.forward"):
        assert upstream_exporter(own) is None
    assert "traces are received but not forwarded" in caplog.text

    for loop in ("localhost:4317", "http://127.0.0.1:4317", "http://localhost:4318"):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", loop)
        with pytest.raises(ConfigError, match="loop"):
            upstream_exporter(own)
    with pytest.raises(ConfigError, match="loop"):
        upstream_exporter([("0.0.0.0", 4318)])

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector.example:4317")
    exporter = upstream_exporter(own)
    assert isinstance(exporter, GrpcSpanExporter)
    exporter.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    exporter = upstream_exporter(own)
    assert isinstance(exporter, HttpSpanExporter)
    exporter.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="http/json"):
        upstream_exporter(own)
