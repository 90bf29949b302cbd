"""Forwarding received spans to the upstream collector through the official OTLP span exporters.

Each proto span is turned back into an SDK `ReadableSpan` (with its Resource and InstrumentationScope) and
exported as it came, plus whatever attributes the join added. The upstream is set by the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` and `..._PROTOCOL` variables; with no
endpoint set, forwarding is off. What the SDK's encoder cannot carry: the low 8 bits (W3C trace flags) of
`Span.flags`, the trace state of links, the dropped-attribute counts of Resource and scope, a status message
on a status other than ERROR, and SPAN_KIND_UNSPECIFIED (sent as INTERNAL).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import TypeVar
from urllib.parse import urlsplit

import psutil
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, SpanFlags
from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.util import types
from prometheus_client import CollectorRegistry, Counter, Gauge

from prismlb.wire import ConfigError

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


class SpanForwarder:
    """Exports submitted spans in batches from a bounded queue on its own thread; `submit` never blocks.

    A full queue drops the excess spans of a request (`dropped_spans`); a failed export counts in
    `export_failures` (batches) and its spans are lost.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        max_queue: int = 4096,
        max_batch: int = 512,
        interval_s: float = 1.0,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if max_queue < 1 or not 1 <= max_batch <= max_queue or not interval_s > 0:
            raise ConfigError(
                f"span forwarder: need 1 <= max_batch ({max_batch}) <= max_queue ({max_queue}) and interval_s > 0"
            )
        self._exporter = exporter
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._interval_s = interval_s
        self._queue: deque[ReadableSpan] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._flushes: list[threading.Event] = []
        self._stopping = False
        self._failing = False
        self.exported_spans = 0
        self.dropped_spans = 0
        self.export_failures = 0
        registry = registry if registry is not None else CollectorRegistry()
        self._exported_metric = Counter(
            "prism_agent_otlp_forwarded_spans", "Spans exported to the upstream collector.", registry=registry
        )
        self._dropped_metric = Counter(
            "prism_agent_otlp_forward_dropped_spans",
            "Spans dropped because the queue to the upstream collector was full.",
            registry=registry,
        )
        self._failures_metric = Counter(
            "prism_agent_otlp_forward_failures",
            "Batches of spans the upstream collector did not accept (their spans are lost).",
            registry=registry,
        )
        Gauge("prism_agent_otlp_forward_queue_spans", "Spans waiting to be forwarded.", registry=registry).set_function(
            lambda: len(self._queue)
        )
        self._thread = threading.Thread(target=self._run, name="prism-span-forward", daemon=True)
        self._thread.start()

    def submit(self, request: ExportTraceServiceRequest) -> None:
        """Queue the request's spans for export; the spans that do not fit are dropped and counted."""
        total = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        room = 0 if self._stopping else self._max_queue - len(self._queue)  # a hint; rechecked under the lock
        spans = list(islice(readable_spans(request), max(room, 0)))
        with self._lock:
            accepted = 0 if self._stopping else min(len(spans), self._max_queue - len(self._queue))
            self._queue.extend(spans[:accepted])
            self.dropped_spans += total - accepted
            batch_ready = len(self._queue) >= self._max_batch
            first_drop = total > accepted and self.dropped_spans == total - accepted
        if total > accepted:
            self._dropped_metric.inc(total - accepted)
            if first_drop:
                _log.warning(
                    "span forwarder dropped %d spans: its queue of %d is full (upstream slow or down) or it is "
                    "shut down; further drops are only counted",
                    total - accepted,
                    self._max_queue,
                )
        if batch_ready:
            self._wake.set()

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export everything submitted so far; False if that did not finish within `timeout_s`."""
        done = threading.Event()
        with self._lock:
            if self._stopping:
                return not self._queue
            self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Export what is queued (for up to `timeout_s`), then shut the exporter down."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            _log.warning(
                "upstream export still running after %.3g s; %d queued spans not forwarded", timeout_s, len(self._queue)
            )
        self._exporter.shutdown()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            with self._lock:
                flushes, self._flushes = self._flushes, []
                stopping = self._stopping
            self._drain()
            for done in flushes:
                done.set()
            if stopping:
                return

    def _drain(self) -> None:
        """Export, in batches, the spans queued now (not those that arrive meanwhile)."""
        left = len(self._queue)
        while left > 0:
            with self._lock:
                batch = [self._queue.popleft() for _ in range(min(self._max_batch, left, len(self._queue)))]
            if not batch:
                return
            left -= len(batch)
            self._export(batch)

    def _export(self, batch: list[ReadableSpan]) -> None:
        try:
            ok = self._exporter.export(batch) is SpanExportResult.SUCCESS
            error = "" if ok else "the exporter reported failure"
        except Exception as exc:  # an exporter bug must not end the forwarding thread
            ok, error = False, repr(exc)
        if ok:
            self.exported_spans += len(batch)
            self._exported_metric.inc(len(batch))
            if self._failing:
                _log.info("forwarding to the upstream collector works again")
                self._failing = False
            return
        self.export_failures += 1
        self._failures_metric.inc()
        if not self._failing:
            _log.warning("forwarding %d spans upstream failed (%s); further failures only counted", len(batch), error)
            self._failing = True


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


def upstream_exporter(listening: Iterable[tuple[str, int]]) -> SpanExporter | None:
    """The OTLP span exporter the standard `OTEL_EXPORTER_OTLP_*` variables configure, or None (forwarding off).

    `listening` is the agent's own OTLP addresses; an upstream that is one of them is a ConfigError.
    """
    source = (
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
        if os.environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
        else OTEL_EXPORTER_OTLP_ENDPOINT
    )
    endpoint = os.environ.get(source, "")
    if not endpoint:
        _log.info(
            "span forwarding off: neither %s nor %s is set, so spans are received and joined but not forwarded",
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
            OTEL_EXPORTER_OTLP_ENDPOINT,
        )
        return None
    protocol = (
        os.environ.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or os.environ.get(OTEL_EXPORTER_OTLP_PROTOCOL) or "grpc"
    ).strip()
    if protocol not in _PROTOCOLS:
        raise ConfigError(f"OTLP protocol {protocol!r} is not supported for forwarding; use grpc or http/protobuf")
    host, port = _host_port(endpoint, protocol)
    if _is_own(host, port, listening):
        raise ConfigError(
            f"{source}={endpoint} is this agent's own OTLP receiver: spans would loop; set it to the upstream collector"
        )
    _log.info("forwarding spans to %s over %s", endpoint, protocol)
    return GrpcSpanExporter() if protocol == "grpc" else HttpSpanExporter()
