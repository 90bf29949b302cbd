"""Metrics and logs through the agent, for real: an application's OpenTelemetry SDK exports them to the agent over
OTLP gRPC or HTTP, and the agent passes them on unchanged to an upstream collector (a second receiver); what it
cannot take or pass on is answered and counted."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcLogExporter
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.logs.v1.logs_service_pb2_grpc import LogsServiceStub
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2_grpc import MetricsServiceStub
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue, KeyValueList
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    Exemplar,
    ExponentialHistogram,
    ExponentialHistogramDataPoint,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
    Summary,
    SummaryDataPoint,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ProtoResource
from opentelemetry.sdk._logs import LoggerProvider, ReadableLogRecord
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prismlb.agent import AgentConfig
from prismlb.agent._bounds import InvalidValues
from prismlb.agent._otlp_forward import RequestExporter, RequestForwarder, passthrough_forwarders
from prismlb.agent._otlp_receiver import EPHEMERAL_PORT, OtlpReceiver
from prismlb.agent._signals import SpanSignals
from prismlb.agent._tracing import TracePath
from prismlb.otel._conventions import ATTR_GPU, METRIC_FRAGMENTATION
from prismlb.wire import ConfigError

from .conftest import wait_for
from .test_otlp import WAIT_S, Sink, post, serve  # noqa: F401 (serve is a fixture)

LOGS = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331
METRIC_POINTS = 8  # what `emit_metrics` records


@pytest.fixture(autouse=True)
def no_otlp_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the upstream it wants; none comes from the environment the tests run in."""
    for signal in ("", "TRACES_", "METRICS_", "LOGS_"):
        for setting in ("ENDPOINT", "PROTOCOL", "HEADERS", "COMPRESSION", "TIMEOUT", "INSECURE", "CERTIFICATE"):
            monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{signal}{setting}", raising=False)


def set_upstream(monkeypatch: pytest.MonkeyPatch, collector: OtlpReceiver, protocol: str) -> None:
    """Point the standard variables at `collector`, one endpoint for every signal, as the README says."""
    port = collector.grpc_port if protocol == "grpc" else collector.http_port
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)


def logs_collector(on_logs: Callable[[ExportLogsServiceRequest], None], **settings: Any) -> OtlpReceiver:
    """A started receiver on loopback (gRPC on an ephemeral port, the rest as `settings` says) that hands logs to
    `on_logs` and drops traces and metrics; the test shuts it down."""
    receiver = OtlpReceiver(
        lambda _t: None, lambda _m: None, on_logs=on_logs, host="127.0.0.1", grpc_port=EPHEMERAL_PORT, **settings
    )
    receiver.start()
    return receiver


SCOPE = InstrumentationScope(name="n", version="v")
"""The instrumentation scope of the requests made here (copied into each message that takes it)."""


def service(name: str) -> ProtoResource:
    """The resource of the requests made here: a service `name`."""
    return ProtoResource(attributes=[KeyValue(key="service.name", value=AnyValue(string_value=name))])


class RecordingMetricExporter(MetricExporter):
    """The app's real OTLP exporter, keeping a copy of each request it is given, encoded as the SDK encodes it."""

    def __init__(self, inner: GrpcMetricExporter | HttpMetricExporter) -> None:
        super().__init__(inner._preferred_temporality, inner._preferred_aggregation)
        self.inner = inner
        self.sent: list[ExportMetricsServiceRequest] = []

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self.sent.append(encode_metrics(metrics_data))
        return self.inner.export(metrics_data, timeout_millis=timeout_millis)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown()


class RecordingLogExporter(LogRecordExporter):
    """The app's real OTLP log exporter, keeping a copy of each request it is given, as the SDK encodes it."""

    def __init__(self, inner: GrpcLogExporter | HttpLogExporter) -> None:
        self.inner = inner
        self.sent: list[ExportLogsServiceRequest] = []
        self.results: list[LogRecordExportResult] = []

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        self.sent.append(encode_logs(batch))
        self.results.append(self.inner.export(batch))
        return self.results[-1]

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        return True

    def shutdown(self) -> None:
        self.inner.shutdown()


def app_metric_exporter(protocol: str, port: int) -> RecordingMetricExporter:
    if protocol == "grpc":
        return RecordingMetricExporter(GrpcMetricExporter(endpoint=f"127.0.0.1:{port}", insecure=True))
    return RecordingMetricExporter(HttpMetricExporter(endpoint=f"http://127.0.0.1:{port}/v1/metrics"))


def app_log_exporter(protocol: str, port: int) -> RecordingLogExporter:
    if protocol == "grpc":
        return RecordingLogExporter(GrpcLogExporter(endpoint=f"127.0.0.1:{port}", insecure=True))
    compression = Compression.Gzip if protocol == "http-gzip" else Compression.NoCompression
    return RecordingLogExporter(HttpLogExporter(endpoint=f"http://127.0.0.1:{port}/v1/logs", compression=compression))


def emit_metrics(exporter: MetricExporter) -> None:
    """An inference server's metrics, 8 data points of every synchronous kind, exported once at shutdown."""
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=600_000)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "vllm"}))
    meter = provider.get_meter("prism.test", "1.2.3")
    requests = meter.create_counter("gen_ai.requests")
    for route in ("/v1/chat", "/v1/completions", "/v1/embeddings"):
        requests.add(5, {"route": route})
    meter.create_up_down_counter("gen_ai.running").add(-2)
    ttft = meter.create_histogram("gen_ai.ttft", unit="ms")
    ttft.record(41.5, {"model": "llama"})
    ttft.record(900.0, {"model": "qwen-vl"})
    fragmentation = meter.create_gauge(METRIC_FRAGMENTATION)
    fragmentation.set(0.25, {ATTR_GPU: 0})
    fragmentation.set(0.4, {ATTR_GPU: 1})
    provider.shutdown()


def emit_logs(exporter: LogRecordExporter) -> None:
    """An inference server's log records: every body type, severities, an event, and trace context."""
    provider = LoggerProvider(resource=Resource.create({"service.name": "vllm", "host.gpu.count": 8}))
    provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
    logger = provider.get_logger("prism.test", "1.2.3", "https://example.com/s", {"lib.mode": "x"})
    in_span = set_span_in_context(
        NonRecordingSpan(SpanContext(TRACE_ID, SPAN_ID, is_remote=True, trace_flags=TraceFlags(1)))
    )
    logger.emit(
        body="prefill started",
        severity_number=SeverityNumber.INFO,
        severity_text="INFO",
        attributes={"gen_ai.request.model": "llama", "prism.tokens": (12, 480)},
        context=in_span,
    )
    logger.emit(body={"event": "oom", "bytes": 1024, "gpus": [0, 1]}, severity_number=SeverityNumber.ERROR)
    logger.emit(body=["a", 1, 2.5, True], severity_number=SeverityNumber.WARN, timestamp=1_700_000_000_000_000_000)
    logger.emit(body=b"\x00\xff", event_name="gen_ai.choice", attributes={"index": 0})
    logger.emit(body="plain")
    provider.shutdown()


def log_records(requests: Sequence[ExportLogsServiceRequest]) -> list[ResourceLogs]:
    return [rl for request in requests for rl in request.resource_logs]


def resource_metrics(requests: Sequence[ExportMetricsServiceRequest]) -> list[ResourceMetrics]:
    return [rm for request in requests for rm in request.resource_metrics]


def count_records(requests: Sequence[ExportLogsServiceRequest]) -> int:
    return sum(len(sl.log_records) for rl in log_records(requests) for sl in rl.scope_logs)


@pytest.mark.parametrize("protocol", ["grpc", "http", "http-gzip"])
def test_sdk_logs_arrive_and_are_counted(
    serve: Callable[..., OtlpReceiver],  # noqa: F811
    protocol: str,
) -> None:
    sink = Sink()
    registry = CollectorRegistry()
    receiver = serve(sink, registry=registry)
    port = receiver.grpc_port if protocol == "grpc" else receiver.http_port
    assert port is not None
    app = app_log_exporter(protocol, port)
    emit_logs(app)

    assert app.results and all(result is LogRecordExportResult.SUCCESS for result in app.results)
    assert log_records(sink.logs) == log_records(app.sent)
    first = sink.logs[0].resource_logs[0].scope_logs[0].log_records[0]
    assert (first.body.string_value, first.trace_id.hex(), first.span_id.hex()) == (
        "prefill started",
        f"{TRACE_ID:032x}",
        f"{SPAN_ID:016x}",
    )
    wire = "grpc" if protocol == "grpc" else "http"
    assert receiver.log_records_received == 5
    assert registry.get_sample_value("prism_agent_otlp_log_records_received_total") == 5
    requests = registry.get_sample_value("prism_agent_otlp_requests_total", {"protocol": wire, "signal": "logs"})
    assert requests == len(sink.logs)
    assert receiver.rejects[wire].counts() == {}


def log_request(*bodies: str, trace_id: bytes = b"", resource: str = "vllm") -> ExportLogsServiceRequest:
    records = [
        LogRecord(
            time_unix_nano=1_700_000_000_000_000_000 + i,
            observed_time_unix_nano=1_700_000_000_000_000_001 + i,
            severity_number=SeverityNumber.ERROR.value,
            severity_text="ERROR",
            body=AnyValue(string_value=body),
            attributes=[KeyValue(key="i", value=AnyValue(int_value=i))],
            dropped_attributes_count=2,
            flags=1,
            trace_id=trace_id,
            span_id=bytes(8 * [2]) if trace_id else b"",
            event_name="prism.test",
        )
        for i, body in enumerate(bodies)
    ]
    return ExportLogsServiceRequest(
        resource_logs=[
            ResourceLogs(
                resource=service(resource),
                schema_url="https://r",
                scope_logs=[ScopeLogs(scope=SCOPE, log_records=records)],
            )
        ]
    )


def test_bad_logs_input_is_answered_counted_and_survived(
    serve: Callable[..., OtlpReceiver],  # noqa: F811
) -> None:
    sink = Sink()
    registry = CollectorRegistry()
    receiver = serve(sink, max_message_bytes=64 * 1024, registry=registry)
    port = receiver.http_port
    assert port is not None
    assert post(port, b"\x0a\xff", path="/v1/logs")[0] == 400
    assert post(port, b"not protobuf at all", path="/v1/logs")[0] == 400
    assert post(port, b"{not json", path="/v1/logs", Content_Type="application/json")[0] == 400
    assert post(port, bytes(64 * 1024 + 1), path="/v1/logs")[0] == 413
    assert post(port, b"", path="/v1/logs", method="GET")[0] == 405
    assert post(port, log_request("x").SerializeToString(), path="/v1/profiles")[0] == 404
    document = {
        "resourceLogs": [
            {
                "scopeLogs": [
                    {
                        "logRecords": [
                            {
                                "timeUnixNano": "1700000000000000000",
                                "severityNumber": 17,
                                "body": {"stringValue": "from JSON"},
                                "traceId": f"{TRACE_ID:032x}",
                                "spanId": f"{SPAN_ID:016x}",
                            }
                        ]
                    }
                ]
            }
        ]
    }
    status, body = post(port, json.dumps(document).encode(), path="/v1/logs", Content_Type="application/json")
    assert status == 200 and json.loads(body) == {}
    with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as garbage:
            channel.unary_unary(LOGS)(b"\x0a\xff", timeout=WAIT_S)
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        bad_ids = log_request("good", "bad")
        bad_ids.resource_logs[0].scope_logs[0].log_records[1].trace_id = b"\x01\x02\x03"
        response = LogsServiceStub(channel).Export(bad_ids, timeout=WAIT_S)
        assert isinstance(response, ExportLogsServiceResponse)
        assert response.partial_success.rejected_log_records == 1
        assert "log records rejected" in response.partial_success.error_message

    record = sink.logs[0].resource_logs[0].scope_logs[0].log_records[0]
    assert (record.body.string_value, record.trace_id.hex(), record.span_id.hex()) == (
        "from JSON",
        f"{TRACE_ID:032x}",
        f"{SPAN_ID:016x}",
    )
    assert [r.body.string_value for r in sink.logs[1].resource_logs[0].scope_logs[0].log_records] == ["good"]
    assert receiver.log_records_received == 2
    assert receiver.rejects["http"].counts() == {
        "malformed_protobuf": 2,
        "malformed_json": 1,
        "oversized": 1,
        "method_not_allowed": 1,
        "not_found": 1,
    }
    assert receiver.rejects["grpc"].counts() == {"malformed_protobuf": 1, "invalid_id": 1}
    rejected = registry.get_sample_value(
        "prism_rejected_messages_total", {"receiver": "otlp_http", "kind": "malformed_protobuf"}
    )
    assert rejected == 2


def test_logs_share_the_grpc_export_limit() -> None:
    release = threading.Event()
    entered = threading.Event()

    def hold(_request: ExportLogsServiceRequest) -> None:
        entered.set()
        release.wait(WAIT_S)

    receiver = logs_collector(hold, http_port=0, max_grpc_rpcs=1)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as channel:
            held = LogsServiceStub(channel).Export.future(log_request("held"), timeout=WAIT_S)
            assert entered.wait(WAIT_S)
            with pytest.raises(grpc.RpcError) as refused:
                MetricsServiceStub(channel).Export(metrics_request(), timeout=WAIT_S)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.RpcError) as refused:
                LogsServiceStub(channel).Export(log_request("refused"), timeout=WAIT_S)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            release.set()
            held.result(timeout=WAIT_S)
    finally:
        release.set()
        receiver.shutdown()
    assert receiver.rejects["grpc"].counts() == {"too_many_rpcs": 2}
    assert receiver.log_records_received == 1


def gauge(value: float) -> Metric:
    point = NumberDataPoint(
        attributes=[KeyValue(key="gpu.index", value=AnyValue(int_value=0))],
        time_unix_nano=2,
        as_double=value,
        exemplars=[Exemplar(time_unix_nano=1, as_double=value, trace_id=bytes(16 * [1]), span_id=bytes(8 * [2]))],
    )
    return Metric(name="prism.gauge", unit="1", description="d", gauge=Gauge(data_points=[point]))


def metrics_request(resource: str = "vllm") -> ExportMetricsServiceRequest:
    """One request with a point of every metric kind (5 points)."""
    metrics = [
        gauge(0.25),
        Metric(
            name="prism.sum",
            sum=Sum(
                data_points=[NumberDataPoint(start_time_unix_nano=1, time_unix_nano=2, as_int=-7, flags=1)],
                aggregation_temporality=2,
                is_monotonic=False,
            ),
            metadata=[KeyValue(key="m", value=AnyValue(kvlist_value=KeyValueList(values=[])))],
        ),
        Metric(
            name="prism.hist",
            histogram=Histogram(
                data_points=[
                    HistogramDataPoint(
                        count=3, sum=7.5, bucket_counts=[1, 2, 0], explicit_bounds=[1.0, 5.0], min=0.5, max=4.0
                    )
                ],
                aggregation_temporality=1,
            ),
        ),
        Metric(
            name="prism.exp",
            exponential_histogram=ExponentialHistogram(
                data_points=[
                    ExponentialHistogramDataPoint(
                        count=2,
                        scale=3,
                        zero_count=1,
                        positive=ExponentialHistogramDataPoint.Buckets(offset=-2, bucket_counts=[1]),
                        zero_threshold=1e-9,
                    )
                ]
            ),
        ),
        Metric(
            name="prism.summary",
            summary=Summary(
                data_points=[
                    SummaryDataPoint(
                        count=4,
                        sum=10.0,
                        quantile_values=[SummaryDataPoint.ValueAtQuantile(quantile=0.99, value=9.0)],
                    )
                ]
            ),
        ),
    ]
    return ExportMetricsServiceRequest(
        resource_metrics=[
            ResourceMetrics(
                resource=service(resource),
                schema_url="https://r",
                scope_metrics=[ScopeMetrics(scope=SCOPE, metrics=metrics, schema_url="s")],
            )
        ]
    )


@pytest.mark.parametrize("upstream", ["grpc", "http/protobuf"])
def test_requests_are_passed_on_unchanged_in_batches(
    serve: Callable[..., OtlpReceiver],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    upstream: str,
) -> None:
    sink = Sink()
    collector = serve(sink)
    set_upstream(monkeypatch, collector, upstream)
    registry = CollectorRegistry()
    metrics = RequestForwarder(RequestExporter("metrics", upstream), interval_s=60.0, registry=registry)
    logs = RequestForwarder(RequestExporter("logs", upstream), interval_s=60.0, registry=registry)
    sent_metrics = [metrics_request("vllm"), metrics_request("sglang")]
    sent_logs = [log_request("a", "b", trace_id=bytes(16 * [1])), log_request("c", resource="sglang")]
    try:
        for request in sent_metrics:
            metrics.submit(request)
        for request in sent_logs:
            logs.submit(request)
        assert metrics.force_flush(WAIT_S) and logs.force_flush(WAIT_S)
    finally:
        metrics.shutdown()
        logs.shutdown()

    assert len(sink.metrics) == 1 and len(sink.logs) == 1, "the queued requests go in one batch each"
    assert resource_metrics(sink.metrics) == resource_metrics(sent_metrics)
    assert log_records(sink.logs) == log_records(sent_logs)
    assert sink.metrics[0].SerializeToString() == b"".join(r.SerializeToString() for r in sent_metrics)
    assert (metrics.exported, metrics.dropped, metrics.export_failures) == (10, 0, 0)
    assert (logs.exported, logs.dropped, logs.export_failures) == (3, 0, 0)
    assert registry.get_sample_value("prism_agent_otlp_forwarded_metric_points_total") == 10
    assert registry.get_sample_value("prism_agent_otlp_forwarded_log_records_total") == 3
    assert collector.metric_points_received == 10 and collector.log_records_received == 3


def test_a_full_queue_drops_whole_requests_and_counts_their_items(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered = threading.Semaphore(0)
    release = threading.Event()
    sink = Sink()

    def slow(request: ExportMetricsServiceRequest) -> None:
        entered.release()
        release.wait(WAIT_S)
        sink.on_metrics(request)

    collector = OtlpReceiver(lambda _t: None, slow, host="127.0.0.1", grpc_port=EPHEMERAL_PORT, http_port=0)
    collector.start()
    set_upstream(monkeypatch, collector, "grpc")
    registry = CollectorRegistry()
    first, second, third, dropped = (metrics_request(name) for name in ("first", "second", "third", "dropped"))
    queued = second.ByteSize() + third.ByteSize()
    forwarder = RequestForwarder(
        RequestExporter("metrics", "grpc"),
        max_queue_bytes=queued + dropped.ByteSize() // 2,
        max_batch_bytes=queued,
        interval_s=0.01,
        registry=registry,
    )
    try:
        forwarder.submit(first)
        assert entered.acquire(timeout=WAIT_S)  # in flight: the queue is empty again
        forwarder.submit(second)
        forwarder.submit(third)
        forwarder.submit(dropped)  # half a request's room is left: dropped whole
        assert forwarder.dropped == 5
        assert registry.get_sample_value("prism_agent_otlp_forward_dropped_metric_points_total") == 5
        assert registry.get_sample_value("prism_agent_otlp_forward_queue_metrics_bytes") == queued
        release.set()
        assert forwarder.force_flush(WAIT_S)
    finally:
        release.set()
        forwarder.shutdown()
        collector.shutdown()
    services = [rm.resource.attributes[0].value.string_value for rm in resource_metrics(sink.metrics)]
    assert services == ["first", "second", "third"]
    assert [len(request.resource_metrics) for request in sink.metrics] == [1, 2]
    assert (forwarder.exported, forwarder.export_failures) == (15, 0)
    assert registry.get_sample_value("prism_agent_otlp_forward_queue_metrics_bytes") == 0


@pytest.mark.parametrize("upstream", ["grpc", "http/protobuf"])
def test_refused_batches_are_counted_and_forwarding_goes_on(
    monkeypatch: pytest.MonkeyPatch,
    upstream: str,
) -> None:
    sink = Sink()
    refusals = [1]

    def refuse_once(request: ExportLogsServiceRequest) -> None:
        if refusals:
            refusals.pop()
            raise RuntimeError("the collector's own fault")
        sink.on_logs(request)

    collector = logs_collector(refuse_once, http_port=EPHEMERAL_PORT)
    set_upstream(monkeypatch, collector, upstream)
    registry = CollectorRegistry()
    forwarder = RequestForwarder(RequestExporter("logs", upstream), interval_s=60.0, registry=registry)
    try:
        forwarder.submit(log_request("lost", "too"))
        assert forwarder.force_flush(WAIT_S)
        assert (forwarder.exported, forwarder.export_failures) == (0, 1)
        assert registry.get_sample_value("prism_agent_otlp_forward_logs_failures_total") == 1
        forwarder.submit(log_request("kept"))
    finally:
        forwarder.shutdown()  # exports what is queued first
        collector.shutdown()
    assert [r.body.string_value for r in log_records(sink.logs)[0].scope_logs[0].log_records] == ["kept"]
    assert (forwarder.exported, forwarder.export_failures, forwarder.dropped) == (1, 1, 0)
    forwarder.submit(log_request("after", "shutdown"))
    assert forwarder.dropped == 2, "after shutdown nothing is taken"
    assert registry.get_sample_value("prism_agent_otlp_forward_dropped_log_records_total") == 2


def test_a_busy_upstream_is_retried(
    serve: Callable[..., OtlpReceiver],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = Sink()
    registry = CollectorRegistry()
    collector = serve(sink, grpc_port=0, max_connections=1, read_timeout_s=WAIT_S, registry=registry)
    set_upstream(monkeypatch, collector, "http/protobuf")
    forwarder = RequestForwarder(RequestExporter("logs", "http/protobuf"), interval_s=0.01)
    try:
        with socket.create_connection(("127.0.0.1", collector.http_port or 0), timeout=WAIT_S):
            wait_for(lambda: registry.get_sample_value("prism_agent_otlp_http_connections") == 1, WAIT_S, "the holder")
            forwarder.submit(log_request("retried"))
            wait_for(lambda: collector.rejects["http"].counts().get("too_many_connections"), WAIT_S, "a refusal")
        # the upstream has room again by the time the exporter retries (its Retry-After is 1 s)
        assert forwarder.force_flush(WAIT_S)
    finally:
        forwarder.shutdown()
    assert (forwarder.exported, forwarder.export_failures) == (1, 0)
    assert [r.body.string_value for r in log_records(sink.logs)[0].scope_logs[0].log_records] == ["retried"]


def exposed(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as /metrics shows it, read back by prometheus_client's parser."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def trace_path() -> Iterator[Callable[[], tuple[TracePath, SpanSignals, CollectorRegistry]]]:
    """The agent's trace path on ephemeral loopback ports, without eBPF; closed after the test."""
    made: list[TracePath] = []

    def make() -> tuple[TracePath, SpanSignals, CollectorRegistry]:
        registry = CollectorRegistry()
        signals = SpanSignals(invalid=InvalidValues(registry))
        config = AgentConfig(
            node_id="passthrough", ebpf=False, otlp_grpc_port=EPHEMERAL_PORT, otlp_http_port=EPHEMERAL_PORT
        )
        path = TracePath(config, None, signals, registry)
        path.start()
        made.append(path)
        return path, signals, registry

    yield make
    for path in made:
        path.close()


@pytest.mark.parametrize(
    ("app", "upstream"), [("grpc", "grpc"), ("http", "http/protobuf"), ("grpc", "http/protobuf"), ("http", "grpc")]
)
def test_the_agent_passes_metrics_and_logs_on_unchanged(
    serve: Callable[..., OtlpReceiver],  # noqa: F811
    trace_path: Callable[[], tuple[TracePath, SpanSignals, CollectorRegistry]],
    monkeypatch: pytest.MonkeyPatch,
    app: str,
    upstream: str,
) -> None:
    sink = Sink()
    collector = serve(sink)
    set_upstream(monkeypatch, collector, upstream)
    path, signals, registry = trace_path()
    assert path.receiver is not None
    port = path.receiver.grpc_port if app == "grpc" else path.receiver.http_port
    assert port is not None
    metrics_app = app_metric_exporter(app, port)
    logs_app = app_log_exporter(app, port)
    emit_metrics(metrics_app)
    emit_logs(logs_app)
    assert all(forwarder.force_flush(WAIT_S) for forwarder in path.passthrough.values())

    assert resource_metrics(sink.metrics) == resource_metrics(metrics_app.sent)
    assert collector.metric_points_received == METRIC_POINTS
    assert log_records(sink.logs) == log_records(logs_app.sent)
    assert count_records(sink.logs) == 5
    assert signals.fragmentation_ratio(60.0) == 0.4, "the agent still reads the metrics it uses"
    samples = exposed(registry)
    assert samples[("prism_agent_otlp_metric_points_received_total", ())] == METRIC_POINTS
    assert samples[("prism_agent_otlp_forwarded_metric_points_total", ())] == METRIC_POINTS
    assert samples[("prism_agent_otlp_log_records_received_total", ())] == 5
    assert samples[("prism_agent_otlp_forwarded_log_records_total", ())] == 5
    for dropped in ("metric_points", "log_records"):
        assert samples[(f"prism_agent_otlp_forward_dropped_{dropped}_total", ())] == 0
    for signal in ("metrics", "logs"):
        assert samples[(f"prism_agent_otlp_forward_{signal}_failures_total", ())] == 0
    wire = "grpc" if app == "grpc" else "http"
    assert samples[("prism_agent_otlp_requests_total", (("protocol", wire), ("signal", "logs")))] >= 1


def test_upstreams_follow_the_standard_variables(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    own = [("127.0.0.1", 4317), ("127.0.0.1", 4318)]
    with caplog.at_level(logging.INFO, logger="prism.agent.forward"):
        assert passthrough_forwarders(own) == {}
    assert "logs are received but not forwarded" in caplog.text
    assert "metrics are received but not forwarded" in caplog.text

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector.example:4317")
    forwarders = passthrough_forwarders(own)
    try:
        assert sorted(forwarders) == ["logs", "metrics"]
        assert {forwarder.exporter.protocol for forwarder in forwarders.values()} == {"grpc"}
    finally:
        for forwarder in forwarders.values():
            forwarder.shutdown()

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "http/protobuf")
    forwarders = passthrough_forwarders(own)
    try:
        assert {signal: forwarder.exporter.protocol for signal, forwarder in forwarders.items()} == {
            "metrics": "grpc",
            "logs": "http/protobuf",
        }
    finally:
        for forwarder in forwarders.values():
            forwarder.shutdown()

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://localhost:4318/v1/metrics")
    with pytest.raises(ConfigError, match="metrics would loop"):
        passthrough_forwarders(own)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="http/json"):
        passthrough_forwarders(own)
