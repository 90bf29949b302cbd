"""The agent's OTLP receiver: traces and metrics over gRPC and HTTP (protobuf or JSON), as a collector takes them.

Settings: argument, then variable, then default. `PRISM_OTLP_HOST` (127.0.0.1), `PRISM_OTLP_GRPC_PORT` (4317)
and `PRISM_OTLP_HTTP_PORT` (4318); port 0 turns that protocol off, the argument `EPHEMERAL_PORT` picks a free one.
Bad input is answered (gRPC INVALID_ARGUMENT; HTTP 400, 404, 405, 411, 413 or 415 with a `google.rpc.Status`
body), counted by kind in `prism_rejected_messages_total{receiver="otlp_grpc"|"otlp_http"}`, logged once per
kind, and never stops the server. Spans with trace or span ids of the wrong length are removed and reported
back as a partial success.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import socket
import socketserver
import threading
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.rpc.status_pb2 import Status
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
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_client import CollectorRegistry, Counter

from prismlb.wire import ConfigError, RejectCounter, WireError

_log = logging.getLogger("prism.agent.otlp")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_GRPC_PORT = 4317
DEFAULT_HTTP_PORT = 4318
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
DEFAULT_GRPC_WORKERS = 8
EPHEMERAL_PORT = -1
"""Port argument: bind a free port chosen by the kernel (tests); read it back from `grpc_port`/`http_port`."""

_POLL_S = 0.1  # how soon the HTTP server notices shutdown
_DRAIN_LIMIT = 1 << 20  # an oversized HTTP body up to this size is read and discarded to keep the connection
_BAD_IDS = "spans rejected: a trace id must be 16 bytes and a span id 8 bytes"
_ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})
_RPC_CODE = {  # google.rpc.Code for each HTTP status the receiver answers with
    HTTPStatus.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    HTTPStatus.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    HTTPStatus.METHOD_NOT_ALLOWED: grpc.StatusCode.UNIMPLEMENTED,
    HTTPStatus.LENGTH_REQUIRED: grpc.StatusCode.INVALID_ARGUMENT,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: grpc.StatusCode.INVALID_ARGUMENT,
    HTTPStatus.INTERNAL_SERVER_ERROR: grpc.StatusCode.INTERNAL,
}

_Req = TypeVar("_Req", ExportTraceServiceRequest, ExportMetricsServiceRequest)

TracesCallback = Callable[[ExportTraceServiceRequest], None]
MetricsCallback = Callable[[ExportMetricsServiceRequest], None]


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


def _count_spans(request: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def _count_points(request: ExportMetricsServiceRequest) -> int:
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


def _screen_spans(request: ExportTraceServiceRequest, response: ExportTraceServiceResponse) -> int:
    """Remove spans with malformed ids, report them in `response.partial_success`; how many were removed."""
    rejected = 0
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            keep = [span for span in ss.spans if _ids_ok(span)]
            if len(keep) != len(ss.spans):
                rejected += len(ss.spans) - len(keep)
                del ss.spans[:]
                ss.spans.extend(keep)
    if rejected:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = _BAD_IDS
    return rejected


def _no_screen(_request: ExportMetricsServiceRequest, _response: ExportMetricsServiceResponse) -> int:
    """Metrics are passed on as sent."""
    return 0


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


def _port(value: int | None, env: str, default: int, environ: Mapping[str, str]) -> int:
    """The port from the argument, else from `env`, else `default`; ConfigError when out of range."""
    source = "argument" if value is not None else env
    raw = value if value is not None else environ.get(env) or default
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"{source}: OTLP port {raw!r} is not an integer") from None
    lowest = EPHEMERAL_PORT if value is not None else 0
    if not lowest <= port <= 65535:
        raise ConfigError(f"{source}: OTLP port must be 0 (off) to 65535, got {port}")
    return port


class _HttpServer(ThreadingHTTPServer):
    def __init__(self, host: str, port: int, receiver: OtlpReceiver) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.receiver = receiver
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__((host, port), _HttpHandler)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's would look the host's name up in DNS
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def close_connections(self) -> None:
        """End every open keep-alive connection, so no request arrives after shutdown."""
        with self.connections_lock:
            for conn in self.connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.debug("OTLP/HTTP connection from %s failed", client_address, exc_info=True)


class _HttpHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30
    server: _HttpServer

    def setup(self) -> None:
        super().setup()
        with self.server.connections_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.connections_lock:
            self.server.connections.discard(self.connection)
        super().finish()

    def do_POST(self) -> None:
        receiver = self.server.receiver
        media_type = self._media_type()
        is_json = media_type == "application/json"
        body_read = False
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
            body = self._body(receiver.max_message_bytes)
            body_read = True
            encoding = self.headers.get("Content-Encoding", "").strip().lower()
            request = _parse(_decompress(body, encoding, receiver.max_message_bytes), is_json, signal.request_type)
            response = receiver._accept(signal, request, "http")
        except _Rejected as exc:
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

    def _body(self, limit: int) -> bytes:
        """The request body as sent, at most `limit` bytes."""
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
        try:
            body = self.rfile.read(length)
        except OSError:
            body = b""
        if len(body) != length:
            self.close_connection = True
            raise _Rejected("truncated", HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of {length} bytes")
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
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if is_json else "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("OTLP/HTTP %s: " + format, self.client_address[0], *args)


class OtlpReceiver:
    """OTLP traces and metrics over gRPC and HTTP; parsed requests go to `on_traces` and `on_metrics`.

    Ports are bound when it is made (read them from `grpc_port`/`http_port`); `start` serves them.
    The callbacks run on the receiver's threads, concurrently, and should return quickly.
    """

    def __init__(
        self,
        on_traces: TracesCallback,
        on_metrics: MetricsCallback,
        *,
        host: str | None = None,
        grpc_port: int | None = None,
        http_port: int | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        grpc_workers: int = DEFAULT_GRPC_WORKERS,
        registry: CollectorRegistry | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.host = host if host is not None else env.get("PRISM_OTLP_HOST") or DEFAULT_HOST
        grpc_wanted = _port(grpc_port, "PRISM_OTLP_GRPC_PORT", DEFAULT_GRPC_PORT, env)
        http_wanted = _port(http_port, "PRISM_OTLP_HTTP_PORT", DEFAULT_HTTP_PORT, env)
        if max_message_bytes <= 0 or grpc_workers <= 0:
            raise ConfigError("OTLP receiver: max_message_bytes and grpc_workers must be positive")
        self.max_message_bytes = max_message_bytes
        registry = registry if registry is not None else CollectorRegistry()
        self.rejects = {protocol: RejectCounter(f"otlp_{protocol}", _log, registry) for protocol in ("grpc", "http")}
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
        }
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {"grpc": 0, "http": 0}
        self._received = {"traces": 0, "metrics": 0}
        traces = _Signal(
            "traces",
            "/v1/traces",
            trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name,
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
            on_traces,
            _count_spans,
            _screen_spans,
        )
        metrics = _Signal(
            "metrics",
            "/v1/metrics",
            metrics_service_pb2.DESCRIPTOR.services_by_name["MetricsService"].full_name,
            ExportMetricsServiceRequest,
            ExportMetricsServiceResponse,
            on_metrics,
            _count_points,
            _no_screen,
        )
        self._signals: dict[str, _Signal[Any]] = {traces.path: traces, metrics.path: metrics}
        self._grpc: grpc.Server | None = None
        self._http: _HttpServer | None = None
        self._http_thread: threading.Thread | None = None
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        try:
            if grpc_wanted:
                self._grpc, self.grpc_port = self._bind_grpc(max(grpc_wanted, 0), grpc_workers)
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

    def _bind_grpc(self, port: int, workers: int) -> tuple[grpc.Server, int]:
        server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prism-otlp-grpc"),
            handlers=[self._grpc_handler(signal) for signal in self._signals.values()],
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a second agent must fail to bind, not split the traffic
            ],
            maximum_concurrent_rpcs=workers * 4,
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

        handler = grpc.unary_unary_rpc_method_handler(
            export, response_serializer=signal.response_type.SerializeToString
        )
        return grpc.method_handlers_generic_handler(signal.service, {"Export": handler})

    def _accept(self, signal: _Signal[_Req], request: _Req, protocol: str) -> Message:
        """Screen, count and deliver one parsed request; the response to send back."""
        response = signal.response_type()
        if signal.screen(request, response):
            self.rejects[protocol].record(_Rejected("invalid_id", HTTPStatus.BAD_REQUEST, _BAD_IDS))
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

    def start(self) -> None:
        """Serve the bound ports on background threads."""
        if self._grpc is not None:
            self._grpc.start()
        if self._http is not None and self._http_thread is None:
            self._http_thread = threading.Thread(
                target=self._http.serve_forever, args=(_POLL_S,), name="prism-otlp-http", daemon=True
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
