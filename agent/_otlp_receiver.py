"""The agent's OTLP receiver: traces, metrics and logs over gRPC and HTTP (protobuf or JSON), as a collector
takes them, so that an application changes nothing but its endpoint to send them through the agent.

It takes its settings as arguments (the agent's come from its settings table, `agent/_config.py`): the host
(127.0.0.1), the gRPC port (4317) and the HTTP port (4318); port 0 turns that protocol off, `EPHEMERAL_PORT` picks
a free one.
Bad input is answered (gRPC INVALID_ARGUMENT; HTTP 400, 404, 405, 411, 413 or 415 with a `google.rpc.Status`
body), counted by kind in `prism_rejected_messages_total{receiver="otlp_grpc"|"otlp_http"}`, logged once per
kind, and never stops the server. Spans and log records with trace or span ids of the wrong length are removed
and reported back as a partial success (`invalid_id`): passed on, they would make the upstream collector refuse
the whole batch they travel in.

What many clients at once can take is bounded, so that a flood costs the agent refusals, not its memory:
- `max_connections` (64) open HTTP connections, one thread each; the next is answered 503 and
  closed at once (`too_many_connections`).
- `read_timeout_s` (10): each HTTP request, from its first byte to its last, must arrive within it,
  however slowly it trickles, or the connection is closed (`read_timeout`); a connection idle that long
  between requests is closed too (uncounted: clients expect that of keep-alive).
- `max_grpc_rpcs` (8) gRPC exports at once, each on its own thread; more are answered
  RESOURCE_EXHAUSTED (`too_many_rpcs`) by spare threads, so without waiting for an export to end.
- `max_inflight_bytes` (64 MiB) of request bodies held at once, both protocols together: an HTTP
  body is reserved from its Content-Length before it is read (and grown by what it inflates to), a gRPC one
  once gRPC has read it (one per thread: at most `max_grpc_rpcs` + 2 at once); one that does not
  fit is answered 503 or RESOURCE_EXHAUSTED (`over_budget`). It must be at least the message limit.
Clients retry these answers with backoff. Open connections and bytes held are on /metrics.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_client import CollectorRegistry, Counter, Gauge

from prismlb.service import POLL_S, BoundedHandler, BoundedHttpServer, reply_bytes
from prismlb.wire import ConfigError, RejectCounter, WireError

_log = logging.getLogger("prism.agent.otlp")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_GRPC_PORT = 4317
DEFAULT_HTTP_PORT = 4318
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_MAX_INFLIGHT_BYTES = 64 << 20
DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_GRPC_RPCS = 8
EPHEMERAL_PORT = -1
"""Port argument: bind a free port chosen by the kernel (tests); read it back from `grpc_port`/`http_port`."""

_REFUSAL_THREADS = 2  # gRPC threads beyond the admitted exports, so a refusal never waits for an export to end
_GRPC_BACKLOG = 4  # gRPC itself refuses, uncounted, beyond this many calls a thread: refusals piling up in a flood
_DRAIN_LIMIT = 1 << 20  # a refused HTTP body up to this size (over the limit) is read and discarded, not reset
_BAD_IDS = "spans rejected: a trace id must be 16 bytes and a span id 8 bytes"
_BAD_LOG_IDS = "log records rejected: a trace id must be empty or 16 bytes, a span id empty or 8 bytes"
_ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})
_RPC_CODE = {  # google.rpc.Code for each HTTP status the receiver answers with
    HTTPStatus.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    HTTPStatus.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    HTTPStatus.METHOD_NOT_ALLOWED: grpc.StatusCode.UNIMPLEMENTED,
    HTTPStatus.LENGTH_REQUIRED: grpc.StatusCode.INVALID_ARGUMENT,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: grpc.StatusCode.INVALID_ARGUMENT,
    HTTPStatus.INTERNAL_SERVER_ERROR: grpc.StatusCode.INTERNAL,
    HTTPStatus.SERVICE_UNAVAILABLE: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

_Req = TypeVar("_Req", ExportTraceServiceRequest, ExportMetricsServiceRequest, ExportLogsServiceRequest)
_Number = TypeVar("_Number", int, float)

TracesCallback = Callable[[ExportTraceServiceRequest], None]
MetricsCallback = Callable[[ExportMetricsServiceRequest], None]
LogsCallback = Callable[[ExportLogsServiceRequest], None]


class _Rejected(WireError):
    """Input the receiver refuses; `kind` names it for counting, `status` is the HTTP answer."""

    def __init__(self, kind: str, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


@dataclass(frozen=True)
class _Signal(Generic[_Req]):
    """One OTLP signal: its messages, where it is served, and what is done with a parsed request."""

    name: str
    path: str
    service: str
    request_type: type[_Req]
    response_type: type[Message]
    deliver: Callable[[_Req], None]
    count: Callable[[_Req], int]
    screen: Callable[[_Req, Any], int]


def _span_lists(request: ExportTraceServiceRequest) -> Iterator[Any]:
    """Each scope's repeated field of spans."""
    return (ss.spans for rs in request.resource_spans for ss in rs.scope_spans)


def _log_record_lists(request: ExportLogsServiceRequest) -> Iterator[Any]:
    """Each scope's repeated field of log records."""
    return (sl.log_records for rl in request.resource_logs for sl in rl.scope_logs)


def count_spans(request: ExportTraceServiceRequest) -> int:
    """How many spans the request carries."""
    return sum(len(spans) for spans in _span_lists(request))


def count_log_records(request: ExportLogsServiceRequest) -> int:
    """How many log records the request carries."""
    return sum(len(records) for records in _log_record_lists(request))


def count_metric_points(request: ExportMetricsServiceRequest) -> int:
    """How many data points the request's metrics carry, of every kind."""
    total = 0
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                data = metric.WhichOneof("data")
                if data is not None:
                    total += len(getattr(metric, data).data_points)
    return total


def _ids_ok(span: Span) -> bool:
    """True when the span's ids have the lengths OTLP requires (16-byte trace id, 8-byte span ids)."""
    return (
        len(span.trace_id) == 16
        and len(span.span_id) == 8
        and len(span.parent_span_id) in (0, 8)
        and all(len(link.trace_id) == 16 and len(link.span_id) == 8 for link in span.links)
    )


def _log_ids_ok(record: LogRecord) -> bool:
    """True when the log record's ids are absent or have the lengths OTLP requires."""
    return len(record.trace_id) in (0, 16) and len(record.span_id) in (0, 8)


def _remove(lists: Iterable[Any], ok: Callable[[Any], bool]) -> int:
    """Remove the items that fail `ok` from each repeated field in `lists`; how many were removed."""
    removed = 0
    for items in lists:
        keep = [item for item in items if ok(item)]
        if len(keep) != len(items):
            removed += len(items) - len(keep)
            del items[:]
            items.extend(keep)
    return removed


def _screen(
    lists: Callable[[_Req], Iterable[Any]], ok: Callable[[Any], bool], rejected_field: str, message: str
) -> Callable[[_Req, Any], int]:
    """A signal's screen: remove the items of `lists(request)` that fail `ok` (malformed ids) and report them in
    the response's `partial_success` (their count in `rejected_field`, `message` saying why); how many were
    removed."""

    def screen(request: _Req, response: Any) -> int:
        rejected = _remove(lists(request), ok)
        if rejected:
            setattr(response.partial_success, rejected_field, rejected)
            response.partial_success.error_message = message
        return rejected

    return screen


_screen_spans = _screen(_span_lists, _ids_ok, "rejected_spans", _BAD_IDS)
_screen_logs = _screen(_log_record_lists, _log_ids_ok, "rejected_log_records", _BAD_LOG_IDS)


def _no_screen(_request: ExportMetricsServiceRequest, _response: ExportMetricsServiceResponse) -> int:
    """Metrics are passed on as sent."""
    return 0


def _discard(_request: ExportLogsServiceRequest) -> None:
    """Logs taken without a callback: counted, then dropped."""


def _hex_ids_to_base64(node: Any) -> Any:
    """OTLP/JSON writes trace and span ids in hex; protobuf's JSON mapping reads bytes as base64."""
    if isinstance(node, dict):
        return {
            key: base64.b64encode(bytes.fromhex(value)).decode()
            if key in _ID_FIELDS and isinstance(value, str)
            else _hex_ids_to_base64(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_hex_ids_to_base64(item) for item in node]
    return node


def _parse(body: bytes, is_json: bool, request_type: type[_Req]) -> _Req:
    request = request_type()
    if is_json:
        try:
            document = json.loads(body)
            if not isinstance(document, dict):
                raise ValueError("the body is not a JSON object")
            json_format.ParseDict(_hex_ids_to_base64(document), request, ignore_unknown_fields=True)
        except (ValueError, RecursionError, json_format.ParseError) as exc:
            raise _Rejected("malformed_json", HTTPStatus.BAD_REQUEST, f"undecodable OTLP/JSON body: {exc}") from None
        return request
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise _Rejected("malformed_protobuf", HTTPStatus.BAD_REQUEST, f"undecodable OTLP protobuf: {exc}") from None
    return request


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """`body` decoded per Content-Encoding (identity, gzip or deflate), never more than `limit` bytes."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise _Rejected(
            "unsupported_encoding", HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {encoding!r} not supported"
        )
    decoder = zlib.decompressobj(wbits=47)  # 32 + 15: gzip or zlib header, detected
    try:
        data = decoder.decompress(body, limit + 1)
    except zlib.error as exc:
        raise _Rejected("bad_compression", HTTPStatus.BAD_REQUEST, f"body is not valid {encoding}: {exc}") from None
    if len(data) > limit:
        raise _Rejected("oversized", HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body inflates beyond {limit} bytes")
    if not decoder.eof or decoder.unused_data:
        raise _Rejected("bad_compression", HTTPStatus.BAD_REQUEST, f"{encoding} body is truncated or has trailing data")
    return data


def _status(status: HTTPStatus, message: str) -> Status:
    """The `google.rpc.Status` body OTLP/HTTP sends with an error."""
    return Status(code=_RPC_CODE[status].value[0], message=message)


def _port(value: int, protocol: str) -> int:
    """ConfigError unless `value` is a port, 0 (off) or `EPHEMERAL_PORT`."""
    if not EPHEMERAL_PORT <= value <= 65535:
        raise ConfigError(f"OTLP receiver: {protocol} port must be 0 (off) to 65535 or EPHEMERAL_PORT, got {value}")
    return value


def _positive(value: _Number, name: str) -> _Number:
    """ConfigError unless `value` is a positive number."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"OTLP receiver: {name} must be positive, got {value!r}")
    return value


class _Budget:
    """Bytes of request bodies held at once, shared by the HTTP and gRPC servers."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        """Reserve `size` bytes; False, reserving nothing, when they would exceed the limit."""
        with self._lock:
            if self._held + size > self.limit:
                return False
            self._held += size
            return True

    def give(self, size: int) -> None:
        """Return `size` reserved bytes."""
        with self._lock:
            self._held -= size

    @property
    def held(self) -> int:
        with self._lock:
            return self._held


class _HttpServer(BoundedHttpServer):
    """The receiver's HTTP server: its bounds are the receiver's, its refusals counted in its `http` rejects."""

    def __init__(self, host: str, port: int, receiver: OtlpReceiver) -> None:
        self.receiver = receiver
        super().__init__(
            host,
            port,
            _HttpHandler,
            max_connections=receiver.max_connections,
            read_timeout_s=receiver.read_timeout_s,
            rejects=receiver.rejects["http"],
        )

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.debug("OTLP/HTTP connection from %s failed", client_address, exc_info=True)


class _HttpHandler(BoundedHandler):
    """One connection's requests."""

    server: _HttpServer

    def do_POST(self) -> None:
        receiver = self.server.receiver
        media_type = self._media_type()
        is_json = media_type == "application/json"
        body_read = False
        held = 0
        try:
            signal = receiver._signals.get(urlsplit(self.path).path)
            if signal is None:
                raise _Rejected("not_found", HTTPStatus.NOT_FOUND, f"no OTLP endpoint at {self.path}")
            if media_type not in ("application/x-protobuf", "application/json"):
                raise _Rejected(
                    "unsupported_media_type",
                    HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                    f"Content-Type {media_type!r}: use application/x-protobuf or application/json",
                )
            held = self._reserve(receiver.max_message_bytes)
            body = self._body(held)
            body_read = True
            self.request_read()
            encoding = self.headers.get("Content-Encoding", "").strip().lower()
            data = _decompress(body, encoding, receiver.max_message_bytes)
            if len(data) > len(body):
                if not receiver.budget.take(len(data) - len(body)):
                    raise receiver.over_budget(len(data))
                held += len(data) - len(body)
            del body
            request = _parse(data, is_json, signal.request_type)
            response = receiver._accept(signal, request, "http")
        except _Rejected as exc:
            if self.timed_out():  # counted, and the connection shut, by the deadline
                self.close_connection = True
                return
            receiver.rejects["http"].record(exc)
            self.close_connection = self.close_connection or not body_read
            self._reply(exc.status, _status(exc.status, str(exc)), is_json)
            return
        except Exception:  # a fault in the agent's own callback, not in the input
            _log.exception("OTLP/HTTP request to %s failed inside the agent", self.path)
            self._reply(
                HTTPStatus.INTERNAL_SERVER_ERROR, _status(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error"), is_json
            )
            return
        finally:
            receiver.budget.give(held)
        self._reply(HTTPStatus.OK, response, is_json)

    def _not_post(self) -> None:
        self.close_connection = True  # any body is left unread
        path = urlsplit(self.path).path
        if path in self.server.receiver._signals:
            exc = _Rejected("method_not_allowed", HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command} {path}: use POST")
        else:
            exc = _Rejected("not_found", HTTPStatus.NOT_FOUND, f"no OTLP endpoint at {path}")
        self.server.receiver.rejects["http"].record(exc)
        self._reply(exc.status, _status(exc.status, str(exc)), False)

    do_GET = do_PUT = do_DELETE = do_PATCH = _not_post

    def _media_type(self) -> str:
        return self.headers.get("Content-Type", "").partition(";")[0].strip().lower()

    def _reserve(self, limit: int) -> int:
        """The body's Content-Length (at most `limit`), reserved from the receiver's budget."""
        raw = self.headers.get("Content-Length")
        if raw is None:
            self.close_connection = True
            raise _Rejected("length_required", HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        if not raw.strip().isdigit():
            self.close_connection = True
            raise _Rejected("bad_length", HTTPStatus.BAD_REQUEST, f"Content-Length {raw!r} is not a size")
        length = int(raw)
        if length > limit:
            if length - limit <= _DRAIN_LIMIT:
                self._discard(length)
            else:
                self.close_connection = True
            raise _Rejected("oversized", HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes over {limit}")
        if not self.server.receiver.budget.take(length):
            if length <= _DRAIN_LIMIT:  # read and dropped, so the client gets the 503, not a reset mid-send
                self._discard(length)
            else:
                self.close_connection = True
            raise self.server.receiver.over_budget(length)
        return length

    def _body(self, length: int) -> bytes:
        """The request body, `length` bytes as its Content-Length says."""
        body = self.read_exactly(length)
        if body is None:
            raise _Rejected("truncated", HTTPStatus.BAD_REQUEST, f"the body ended before its {length} bytes")
        return body

    def _discard(self, length: int) -> None:
        try:
            while length > 0:
                chunk = self.rfile.read(min(length, 1 << 16))
                if not chunk:
                    break
                length -= len(chunk)
        except OSError:
            pass
        self.close_connection = self.close_connection or length > 0

    def _reply(self, status: HTTPStatus, message: Message, is_json: bool) -> None:
        body = json_format.MessageToJson(message, indent=None).encode() if is_json else message.SerializeToString()
        headers: dict[str, str] = {}
        if status == HTTPStatus.SERVICE_UNAVAILABLE:
            headers["Retry-After"] = "1"  # OTLP clients wait this long before they retry
        if self.close_connection:
            headers["Connection"] = "close"
        reply_bytes(self, status, body, "application/json" if is_json else "application/x-protobuf", headers)

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("OTLP/HTTP %s: " + format, self.client_address[0], *args)


class OtlpReceiver:
    """OTLP traces, metrics and logs over gRPC and HTTP; parsed requests go to `on_traces`, `on_metrics` and
    `on_logs` (without it, logs are taken and counted, then dropped).

    Ports are bound when it is made (read them from `grpc_port`/`http_port`); `start` serves them.
    The callbacks run on the receiver's threads, concurrently, and should return quickly.
    """

    def __init__(
        self,
        on_traces: TracesCallback,
        on_metrics: MetricsCallback,
        *,
        on_logs: LogsCallback | None = None,
        host: str = DEFAULT_HOST,
        grpc_port: int = DEFAULT_GRPC_PORT,
        http_port: int = DEFAULT_HTTP_PORT,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_grpc_rpcs: int = DEFAULT_MAX_GRPC_RPCS,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.host = host
        grpc_wanted = _port(grpc_port, "gRPC")
        http_wanted = _port(http_port, "HTTP")
        self.max_message_bytes = _positive(max_message_bytes, "max_message_bytes")
        self.max_connections = _positive(max_connections, "max_connections")
        self.read_timeout_s = _positive(read_timeout_s, "read_timeout_s")
        self.max_grpc_rpcs = _positive(max_grpc_rpcs, "max_grpc_rpcs")
        inflight = _positive(max_inflight_bytes, "max_inflight_bytes")
        if inflight < max_message_bytes:
            raise ConfigError(
                f"OTLP receiver: max_inflight_bytes ({inflight}) must be at least max_message_bytes"
                f" ({max_message_bytes}), or the largest messages could never be taken"
            )
        self.budget = _Budget(inflight)
        registry = registry if registry is not None else CollectorRegistry()
        self.rejects = {protocol: RejectCounter(f"otlp_{protocol}", _log, registry) for protocol in ("grpc", "http")}
        Gauge(
            "prism_agent_otlp_inflight_bytes", "OTLP request bytes held now (both protocols)", registry=registry
        ).set_function(lambda: self.budget.held)
        Gauge("prism_agent_otlp_http_connections", "Open OTLP/HTTP connections", registry=registry).set_function(
            self._http_connections
        )
        self._rpcs_lock = threading.Lock()
        self._rpcs = 0
        self._requests_metric = Counter(
            "prism_agent_otlp_requests",
            "OTLP export requests accepted, by protocol and signal.",
            ["protocol", "signal"],
            registry=registry,
        )
        self._items_metric = {
            "traces": Counter("prism_agent_otlp_spans_received", "Spans received over OTLP.", registry=registry),
            "metrics": Counter(
                "prism_agent_otlp_metric_points_received", "Metric data points received over OTLP.", registry=registry
            ),
            "logs": Counter(
                "prism_agent_otlp_log_records_received", "Log records received over OTLP.", registry=registry
            ),
        }
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {"grpc": 0, "http": 0}
        self._received = {"traces": 0, "metrics": 0, "logs": 0}
        traces = _Signal(
            "traces",
            "/v1/traces",
            trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name,
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
            on_traces,
            count_spans,
            _screen_spans,
        )
        metrics = _Signal(
            "metrics",
            "/v1/metrics",
            metrics_service_pb2.DESCRIPTOR.services_by_name["MetricsService"].full_name,
            ExportMetricsServiceRequest,
            ExportMetricsServiceResponse,
            on_metrics,
            count_metric_points,
            _no_screen,
        )
        logs = _Signal(
            "logs",
            "/v1/logs",
            logs_service_pb2.DESCRIPTOR.services_by_name["LogsService"].full_name,
            ExportLogsServiceRequest,
            ExportLogsServiceResponse,
            on_logs if on_logs is not None else _discard,
            count_log_records,
            _screen_logs,
        )
        self._signals: dict[str, _Signal[Any]] = {signal.path: signal for signal in (traces, metrics, logs)}
        self._grpc: grpc.Server | None = None
        self._http: _HttpServer | None = None
        self._http_thread: threading.Thread | None = None
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        try:
            if grpc_wanted:
                self._grpc, self.grpc_port = self._bind_grpc(max(grpc_wanted, 0))
            if http_wanted:
                self._http = self._bind_http(max(http_wanted, 0))
                self.http_port = int(self._http.server_address[1])
        except BaseException:
            self.shutdown()
            raise

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every protocol served."""
        return [(self.host, port) for port in (self.grpc_port, self.http_port) if port is not None]

    def over_budget(self, size: int) -> _Rejected:
        """The refusal of a body of `size` bytes that does not fit in what is left of the in-flight budget."""
        return _Rejected(
            "over_budget",
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"body of {size} bytes does not fit: {self.budget.held} of {self.budget.limit} bytes in flight",
        )

    def _http_connections(self) -> int:
        http = self._http
        return 0 if http is None else http.open_connections

    def _bind_grpc(self, port: int) -> tuple[grpc.Server, int]:
        server = grpc.server(
            ThreadPoolExecutor(max_workers=self.max_grpc_rpcs + _REFUSAL_THREADS, thread_name_prefix="prism-otlp-grpc"),
            handlers=[self._grpc_handler(signal) for signal in self._signals.values()],
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a second agent must fail to bind, not split the traffic
            ],
            maximum_concurrent_rpcs=(self.max_grpc_rpcs + _REFUSAL_THREADS) * _GRPC_BACKLOG,
        )
        target = f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"
        try:
            bound = server.add_insecure_port(target)
        except RuntimeError as exc:
            bound, reason = 0, str(exc)
        else:
            reason = "address in use or not local"
        if not bound:
            server.stop(None)
            raise ConfigError(f"cannot listen for OTLP/gRPC on {target}: {reason}")
        return server, bound

    def _bind_http(self, port: int) -> _HttpServer:
        try:
            return _HttpServer(self.host, port, self)
        except OSError as exc:
            raise ConfigError(f"cannot listen for OTLP/HTTP on {self.host}:{port}: {exc}") from None

    def _grpc_handler(self, signal: _Signal[Any]) -> grpc.GenericRpcHandler:
        def export(body: bytes, context: grpc.ServicerContext) -> Message:
            if not self._admit_rpc():
                self.rejects["grpc"].count(
                    "too_many_rpcs", f"gRPC export refused: {self.max_grpc_rpcs} already in progress"
                )
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_grpc_rpcs} exports in progress")
            try:
                if not self.budget.take(len(body)):
                    exc = self.over_budget(len(body))
                    self.rejects["grpc"].record(exc)
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                try:
                    return self._export(signal, body, context)
                finally:
                    self.budget.give(len(body))
            finally:
                self._end_rpc()

        handler = grpc.unary_unary_rpc_method_handler(
            export, response_serializer=signal.response_type.SerializeToString
        )
        return grpc.method_handlers_generic_handler(signal.service, {"Export": handler})

    def _export(self, signal: _Signal[Any], body: bytes, context: grpc.ServicerContext) -> Message:
        try:
            request = _parse(body, False, signal.request_type)
        except _Rejected as exc:
            self.rejects["grpc"].record(exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            return self._accept(signal, request, "grpc")
        except Exception:  # a fault in the agent's own callback, not in the input
            _log.exception("OTLP/gRPC %s export failed inside the agent", signal.name)
            context.abort(grpc.StatusCode.INTERNAL, "internal error")

    def _admit_rpc(self) -> bool:
        """Take one of the `max_grpc_rpcs` slots; False when all are taken."""
        with self._rpcs_lock:
            if self._rpcs >= self.max_grpc_rpcs:
                return False
            self._rpcs += 1
            return True

    def _end_rpc(self) -> None:
        with self._rpcs_lock:
            self._rpcs -= 1

    def _accept(self, signal: _Signal[_Req], request: _Req, protocol: str) -> Message:
        """Screen, count and deliver one parsed request; the response to send back."""
        response = signal.response_type()
        if signal.screen(request, response):
            message = response.partial_success.error_message
            self.rejects[protocol].record(_Rejected("invalid_id", HTTPStatus.BAD_REQUEST, message))
        items = signal.count(request)
        signal.deliver(request)
        with self._lock:
            self.requests[protocol] += 1
            self._received[signal.name] += items
        self._requests_metric.labels(protocol, signal.name).inc()
        self._items_metric[signal.name].inc(items)
        return response

    @property
    def spans_received(self) -> int:
        with self._lock:
            return self._received["traces"]

    @property
    def metric_points_received(self) -> int:
        with self._lock:
            return self._received["metrics"]

    @property
    def log_records_received(self) -> int:
        with self._lock:
            return self._received["logs"]

    def start(self) -> None:
        """Serve the bound ports on background threads."""
        if self._grpc is not None:
            self._grpc.start()
        if self._http is not None and self._http_thread is None:
            self._http_thread = threading.Thread(
                target=self._http.serve_forever, args=(POLL_S,), name="prism-otlp-http", daemon=True
            )
            self._http_thread.start()
        served = ", ".join(
            f"{name} on {self.host}:{port}"
            for name, port in (("gRPC", self.grpc_port), ("HTTP", self.http_port))
            if port
        )
        _log.info("OTLP receiver: %s", served or "off (both ports 0)")

    def shutdown(self, grace_s: float = 2.0) -> None:
        """Stop serving and free the ports; gRPC calls in flight get `grace_s` to finish, HTTP connections end now."""
        if self._grpc is not None:
            self._grpc.stop(grace_s).wait(grace_s + 1)
            self._grpc = None
        if self._http is not None:
            if self._http_thread is not None:
                self._http.shutdown()
                self._http_thread.join(grace_s)
            self._http.server_close()
            self._http.close_connections()
            self._http = None
