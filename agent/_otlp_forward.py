"""Forwarding what the agent receives to the upstream collector through the official OTLP exporters, so that an
application sending its telemetry through the agent loses none of it.

Spans: each proto span is turned back into an SDK `ReadableSpan` (with its Resource and InstrumentationScope)
and exported as it came, plus whatever attributes the join added. What the SDK's encoder cannot carry: the low
8 bits (W3C trace flags) of `Span.flags`, the trace state of links, the dropped-attribute counts of Resource and
scope, a status message on a status other than ERROR, and SPAN_KIND_UNSPECIFIED (sent as INTERNAL).

Metrics and logs are passed on unchanged: the encoded requests, joined into batches, through the SDK's metric
and log exporters' own transport (settings, retries, timeouts).

Each signal's upstream is set by the standard `OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT` /
`OTEL_EXPORTER_OTLP_ENDPOINT` and `..._PROTOCOL` variables (grpc or http/protobuf); with no endpoint set,
forwarding of that signal is off. Each forwarder has a bounded queue; what does not fit is dropped and counted,
as are batches the upstream refuses.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar
from urllib.parse import urlsplit

import psutil
from google.protobuf.message import Message
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcLogExporter
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, SpanFlags
from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_LOGS_ENDPOINT,
    OTEL_EXPORTER_OTLP_LOGS_PROTOCOL,
    OTEL_EXPORTER_OTLP_METRICS_ENDPOINT,
    OTEL_EXPORTER_OTLP_METRICS_PROTOCOL,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
)
from opentelemetry.sdk.metrics.export import MetricExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.util import types
from prometheus_client import CollectorRegistry, Counter, Gauge

from prismlb.service import BoundedWorker, QueueEntry
from prismlb.wire import ConfigError

from ._otlp_receiver import DEFAULT_MAX_MESSAGE_BYTES, count_log_records, count_metric_points, count_spans

_log = logging.getLogger("prism.agent.forward")

_KIND = {
    Span.SpanKind.SPAN_KIND_INTERNAL: SpanKind.INTERNAL,
    Span.SpanKind.SPAN_KIND_SERVER: SpanKind.SERVER,
    Span.SpanKind.SPAN_KIND_CLIENT: SpanKind.CLIENT,
    Span.SpanKind.SPAN_KIND_PRODUCER: SpanKind.PRODUCER,
    Span.SpanKind.SPAN_KIND_CONSUMER: SpanKind.CONSUMER,
}
_IS_REMOTE = SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_TRACE_FLAGS = SpanFlags.SPAN_FLAGS_TRACE_FLAGS_MASK
_PROTOCOLS = ("grpc", "http/protobuf")
_WILDCARDS = ("", "0.0.0.0", "::")
_T = TypeVar("_T")
_E = TypeVar("_E")

Signal = Literal["traces", "metrics", "logs"]
Passed = Literal["metrics", "logs"]
"""The signals passed upstream unchanged."""

DEFAULT_MAX_BATCH_BYTES = 1 << 20
"""Requests joined into one export up to this size: a quarter of a collector's default 4 MiB gRPC message limit.
A larger request goes alone, as its sender made it."""

_VARIABLES: dict[Signal, tuple[str, str]] = {  # each signal's own endpoint and protocol variables
    "traces": (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL),
    "metrics": (OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, OTEL_EXPORTER_OTLP_METRICS_PROTOCOL),
    "logs": (OTEL_EXPORTER_OTLP_LOGS_ENDPOINT, OTEL_EXPORTER_OTLP_LOGS_PROTOCOL),
}


def _value(value: AnyValue) -> types.AnyValue:
    field = value.WhichOneof("value")
    if field is None:
        return None
    if field == "array_value":
        return tuple(_value(item) for item in value.array_value.values)
    if field == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    result: types.AnyValue = getattr(value, field)
    return result


def _attributes(kvs: Iterable[KeyValue], dropped: int = 0) -> BoundedAttributes:
    attributes = BoundedAttributes(attributes={kv.key: _value(kv.value) for kv in kvs})
    attributes.dropped += dropped
    return attributes


def _bounded(items: list[_T], dropped: int) -> Sequence[_T]:
    """`items` in the SDK's BoundedList, which is how a ReadableSpan reports dropped events and links."""
    bounded: BoundedList[_T] = BoundedList.from_seq(None, items)
    bounded.dropped = dropped
    return bounded


def _trace_state(header: str) -> TraceState:
    return TraceState.from_header([header]) if header else TraceState()


def _status(status: ProtoStatus) -> Status:
    if status.code == ProtoStatus.STATUS_CODE_ERROR:
        return Status(StatusCode.ERROR, status.message or None)
    return Status(StatusCode.OK if status.code == ProtoStatus.STATUS_CODE_OK else StatusCode.UNSET)


def _readable(span: Span, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    trace_id = int.from_bytes(span.trace_id, "big")
    context = SpanContext(
        trace_id,
        int.from_bytes(span.span_id, "big"),
        is_remote=False,
        trace_flags=TraceFlags(span.flags & _TRACE_FLAGS),
        trace_state=_trace_state(span.trace_state),
    )
    parent = None
    if span.parent_span_id:
        parent = SpanContext(
            trace_id, int.from_bytes(span.parent_span_id, "big"), is_remote=bool(span.flags & _IS_REMOTE)
        )
    events = [
        Event(e.name, _attributes(e.attributes, e.dropped_attributes_count), e.time_unix_nano) for e in span.events
    ]
    links = [
        Link(
            SpanContext(
                int.from_bytes(link.trace_id, "big"),
                int.from_bytes(link.span_id, "big"),
                is_remote=bool(link.flags & _IS_REMOTE),
                trace_flags=TraceFlags(link.flags & _TRACE_FLAGS),
                trace_state=_trace_state(link.trace_state),
            ),
            _attributes(link.attributes, link.dropped_attributes_count),
        )
        for link in span.links
    ]
    return ReadableSpan(
        name=span.name,
        context=context,
        parent=parent,
        resource=resource,
        attributes=_attributes(span.attributes, span.dropped_attributes_count),
        events=_bounded(events, span.dropped_events_count),
        links=_bounded(links, span.dropped_links_count),
        kind=_KIND.get(span.kind, SpanKind.INTERNAL),
        status=_status(span.status),
        start_time=span.start_time_unix_nano,
        end_time=span.end_time_unix_nano,
        instrumentation_scope=scope,
    )


def readable_spans(request: ExportTraceServiceRequest) -> Iterator[ReadableSpan]:
    """The request's spans as SDK spans, each with its Resource and InstrumentationScope; ids must be valid."""
    for resource_spans in request.resource_spans:
        resource = Resource(_attributes(resource_spans.resource.attributes), resource_spans.schema_url)
        for scope_spans in resource_spans.scope_spans:
            scope = InstrumentationScope(
                scope_spans.scope.name,
                scope_spans.scope.version,
                scope_spans.schema_url,
                _attributes(scope_spans.scope.attributes),
            )
            for span in scope_spans.spans:
                yield _readable(span, resource, scope)


@dataclass(frozen=True)
class _Names:
    """What one forwarder's counts are called, in log lines and on /metrics."""

    thread: str
    items: str
    unit: str
    queued: str
    forwarded: str
    dropped: str
    failures: str
    queue: str


_SPANS = _Names(
    thread="span",
    items="spans",
    unit="spans",
    queued="Spans",
    forwarded="prism_agent_otlp_forwarded_spans",
    dropped="prism_agent_otlp_forward_dropped_spans",
    failures="prism_agent_otlp_forward_failures",
    queue="prism_agent_otlp_forward_queue_spans",
)
_PASSED_NAMES: dict[Passed, _Names] = {
    "metrics": _Names(
        thread="metrics",
        items="metric points",
        unit="bytes",
        queued="Bytes of metrics requests",
        forwarded="prism_agent_otlp_forwarded_metric_points",
        dropped="prism_agent_otlp_forward_dropped_metric_points",
        failures="prism_agent_otlp_forward_metrics_failures",
        queue="prism_agent_otlp_forward_queue_metrics_bytes",
    ),
    "logs": _Names(
        thread="logs",
        items="log records",
        unit="bytes",
        queued="Bytes of logs requests",
        forwarded="prism_agent_otlp_forwarded_log_records",
        dropped="prism_agent_otlp_forward_dropped_log_records",
        failures="prism_agent_otlp_forward_logs_failures",
        queue="prism_agent_otlp_forward_queue_logs_bytes",
    ),
}


class _Forwarder(BoundedWorker[_E]):
    """Exports what is submitted in batches from a bounded queue on its own thread (`BoundedWorker`); submitting
    never blocks. What does not fit is dropped and its items counted (`dropped`); a failed export counts in
    `export_failures` (batches) and its items are lost. Each count is also on /metrics, under `names`.
    Subclasses set their fields before this `__init__`, which starts the thread."""

    def __init__(
        self, names: _Names, max_queue: int, max_batch: int, interval_s: float, registry: CollectorRegistry | None
    ) -> None:
        self._names = names
        self._failing = False
        self.exported = 0
        self.export_failures = 0
        super().__init__(f"{names.thread}-forward", max_queue, max_batch, interval_s)
        registry = registry if registry is not None else CollectorRegistry()
        items = names.items
        self._exported_metric = Counter(
            names.forwarded, f"{items.capitalize()} exported to the upstream collector.", registry=registry
        )
        self._dropped_metric = Counter(
            names.dropped,
            f"{items.capitalize()} dropped because the queue to the upstream collector was full.",
            registry=registry,
        )
        self._failures_metric = Counter(
            names.failures,
            f"Batches of {items} the upstream collector did not accept (their {items} are lost).",
            registry=registry,
        )
        Gauge(names.queue, f"{names.queued} waiting to be forwarded.", registry=registry).set_function(
            lambda: self.queued
        )

    @abstractmethod
    def _send(self, batch: list[_E], items: int) -> bool:
        """Export one batch (of `items` items); True when the upstream took it."""

    @abstractmethod
    def _close(self) -> None:
        """Shut the exporter down."""

    def _on_drop(self, dropped: int, first: bool) -> None:
        self._dropped_metric.inc(dropped)
        if first:
            _log.warning(
                "%s forwarder dropped %d %s: its queue of %d %s is full (upstream slow or down) or it is "
                "shut down; further drops are only counted",
                self._names.thread,
                dropped,
                self._names.items,
                self._max_queue,
                self._names.unit,
            )

    def _on_shutdown(self, finished: bool, timeout_s: float) -> None:
        """After the queue was exported (or `timeout_s` passed), shut the exporter down."""
        if not finished:
            _log.warning(
                "upstream export still running after %.3g s; %d queued %s not forwarded",
                timeout_s,
                self.queued_items,
                self._names.items,
            )
        self._close()

    def _process(self, batch: list[_E], items: int) -> None:
        try:
            ok = self._send(batch, items)
            error = "" if ok else "the exporter reported failure"
        except Exception as exc:  # an exporter bug must not end the forwarding thread
            ok, error = False, repr(exc)
        if ok:
            with self._lock:
                self.exported += items
            self._exported_metric.inc(items)
            if self._failing:
                _log.info("forwarding %s to the upstream collector works again", self._names.items)
                self._failing = False
            return
        with self._lock:
            self.export_failures += 1
        self._failures_metric.inc()
        if not self._failing:
            _log.warning(
                "forwarding %d %s upstream failed (%s); further failures only counted", items, self._names.items, error
            )
            self._failing = True


class SpanForwarder(_Forwarder[ReadableSpan]):
    """Exports submitted spans in batches of up to `max_batch` from a queue of at most `max_queue` spans; the
    spans of a request that do not fit are dropped (`dropped`), in part or whole."""

    def __init__(
        self,
        exporter: SpanExporter,
        max_queue: int = 4096,
        max_batch: int = 512,
        interval_s: float = 1.0,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._exporter = exporter
        super().__init__(_SPANS, max_queue, max_batch, interval_s, registry)

    def submit(self, request: ExportTraceServiceRequest) -> None:
        """Queue the request's spans for export; the spans that do not fit are dropped and counted."""
        self._offer((QueueEntry(span, 1, 1) for span in readable_spans(request)), count_spans(request))

    def _send(self, batch: list[ReadableSpan], items: int) -> bool:
        return self._exporter.export(batch) is SpanExportResult.SUCCESS

    def _close(self) -> None:
        self._exporter.shutdown()


@dataclass(frozen=True)
class _Encoded:
    """Requests of one signal, encoded and joined, and how many items they carry: what `_PreEncoded` sends."""

    body: bytes
    items: int


class _PreEncoded:
    """For the SDK's gRPC exporters: send `_Encoded` requests instead of encoding SDK data. These two hooks are
    the ones the SDK's gRPC exporter base leaves to its subclasses; everything else (channel, credentials,
    headers, compression, timeout, retries with backoff) stays the SDK's."""

    request_type: type[Message]

    def _translate_data(self, data: _Encoded) -> Message:
        return self.request_type.FromString(data.body)

    def _count_data(self, data: _Encoded) -> int:
        return data.items


class _GrpcMetrics(_PreEncoded, GrpcMetricExporter):
    request_type = ExportMetricsServiceRequest


class _GrpcLogs(_PreEncoded, GrpcLogExporter):
    request_type = ExportLogsServiceRequest


class RequestExporter:
    """Sends encoded OTLP metrics or logs requests upstream through the SDK's exporter for that signal and
    protocol, configured by the standard `OTEL_EXPORTER_OTLP_[METRICS_|LOGS_]*` variables as the SDK reads them,
    with its retries and timeouts: the same handling the spans get."""

    def __init__(self, signal: Passed, protocol: str) -> None:
        _check_protocol(protocol)
        self.signal: Passed = signal
        self.protocol = protocol
        self._grpc: _GrpcMetrics | _GrpcLogs | None = None
        self._http: HttpMetricExporter | HttpLogExporter | None = None
        if protocol == "grpc":
            self._grpc = _GrpcMetrics() if signal == "metrics" else _GrpcLogs()
        else:
            self._http = HttpMetricExporter() if signal == "metrics" else HttpLogExporter()

    def export(self, body: bytes, items: int) -> bool:
        """Send `body` (one or more encoded requests joined); True when the upstream took it."""
        if self._grpc is not None:
            result = self._grpc.export(_Encoded(body, items))  # type: ignore[arg-type]
            return result in (MetricExportResult.SUCCESS, LogRecordExportResult.SUCCESS)
        assert self._http is not None
        # The SDK's HTTP client of the exporter: it sends bytes as they are, with the exporter's settings.
        return bool(self._http._client.export(body).success)

    def shutdown(self) -> None:
        if self._grpc is not None:
            self._grpc.shutdown()
        if self._http is not None:
            self._http.shutdown()


class RequestForwarder(_Forwarder[bytes]):
    """Passes OTLP metrics or logs requests upstream unchanged. Each is queued encoded and whole, so the queue's
    bound, `max_queue_bytes`, is the memory it takes; a request that does not fit is dropped whole and its items
    (data points, log records) counted. A batch is queued requests joined up to `max_batch_bytes`, which
    protobuf reads as one request holding all their ResourceMetrics or ResourceLogs, in order, as sent."""

    def __init__(
        self,
        exporter: RequestExporter,
        max_queue_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        interval_s: float = 1.0,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.exporter = exporter
        self._count = count_metric_points if exporter.signal == "metrics" else count_log_records
        super().__init__(_PASSED_NAMES[exporter.signal], max_queue_bytes, max_batch_bytes, interval_s, registry)

    def submit(self, request: ExportMetricsServiceRequest | ExportLogsServiceRequest) -> None:
        """Queue the request for export; when it does not fit it is dropped and its items counted."""
        body = request.SerializeToString()
        if body:
            items = self._count(request)  # type: ignore[arg-type]
            self._offer([QueueEntry(body, len(body), items)], items)

    def _send(self, batch: list[bytes], items: int) -> bool:
        return self.exporter.export(b"".join(batch), items)

    def _close(self) -> None:
        self.exporter.shutdown()


def _check_protocol(protocol: str) -> None:
    if protocol not in _PROTOCOLS:
        raise ConfigError(f"OTLP protocol {protocol!r} is not supported for forwarding; use grpc or http/protobuf")


def _host_port(endpoint: str, protocol: str) -> tuple[str, int]:
    parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"OTLP upstream endpoint {endpoint!r}: {exc}") from None
    if not parts.hostname:
        raise ConfigError(f"OTLP upstream endpoint {endpoint!r} has no host")
    default = 443 if protocol == "grpc" or parts.scheme == "https" else 80
    return parts.hostname, port if port is not None else default


def _ips(host: str) -> set[str]:
    """The addresses `host` resolves to; empty when it does not resolve."""
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()


def _local_ips() -> set[str]:
    """Every address of this host's interfaces."""
    families = (socket.AF_INET, socket.AF_INET6)
    return {a.address.partition("%")[0] for nic in psutil.net_if_addrs().values() for a in nic if a.family in families}


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.partition("%")[0]).is_loopback
    except ValueError:
        return False


def _is_own(host: str, port: int, listening: Iterable[tuple[str, int]]) -> bool:
    """True when `host:port` reaches one of the agent's own listening addresses."""
    targets = _ips(host) | {host}
    for listen_host, listen_port in listening:
        if listen_port != port:
            continue
        if listen_host in _WILDCARDS:
            if any(_is_loopback(ip) for ip in targets) or targets & _local_ips():
                return True
        elif targets & (_ips(listen_host) | {listen_host}):
            return True
    return False


def _upstream_protocol(signal: Signal, listening: Iterable[tuple[str, int]]) -> str | None:
    """The protocol over which `signal` goes upstream, as the standard variables say (the signal's own, else
    the general one); None when no endpoint is set: forwarding of it is off. ConfigError for a protocol the
    forwarders cannot speak, or for an endpoint that is one of the agent's own `listening` addresses."""
    endpoint_variable, protocol_variable = _VARIABLES[signal]
    source = endpoint_variable if os.environ.get(endpoint_variable) else OTEL_EXPORTER_OTLP_ENDPOINT
    endpoint = os.environ.get(source, "")
    if not endpoint:
        _log.info(
            "%s forwarding off: neither %s nor %s is set, so %s are received but not forwarded",
            signal,
            endpoint_variable,
            OTEL_EXPORTER_OTLP_ENDPOINT,
            signal,
        )
        return None
    protocol = (os.environ.get(protocol_variable) or os.environ.get(OTEL_EXPORTER_OTLP_PROTOCOL) or "grpc").strip()
    _check_protocol(protocol)
    host, port = _host_port(endpoint, protocol)
    if _is_own(host, port, listening):
        raise ConfigError(
            f"{source}={endpoint} is this agent's own OTLP receiver: {signal} would loop; set it to the upstream "
            "collector"
        )
    _log.info("forwarding %s to %s over %s", signal, endpoint, protocol)
    return protocol


def upstream_exporter(listening: Iterable[tuple[str, int]]) -> SpanExporter | None:
    """The OTLP span exporter the standard `OTEL_EXPORTER_OTLP_*` variables configure, or None (forwarding off).

    `listening` is the agent's own OTLP addresses; an upstream that is one of them is a ConfigError.
    """
    protocol = _upstream_protocol("traces", listening)
    if protocol is None:
        return None
    return GrpcSpanExporter() if protocol == "grpc" else HttpSpanExporter()


def passthrough_forwarders(
    listening: Iterable[tuple[str, int]], registry: CollectorRegistry | None = None
) -> dict[Passed, RequestForwarder]:
    """A forwarder for metrics and one for logs, each where the standard variables set an upstream for it (with
    only `OTEL_EXPORTER_OTLP_ENDPOINT` set, all signals go to that one collector). Every upstream is checked
    before any forwarder starts."""
    addresses = list(listening)
    protocols = {signal: _upstream_protocol(signal, addresses) for signal in _PASSED_NAMES}
    return {
        signal: RequestForwarder(RequestExporter(signal, protocol), registry=registry)
        for signal, protocol in protocols.items()
        if protocol is not None
    }
