"""The router as an HTTP reverse proxy, for callers that cannot embed it (`prism gateway`).

A caller in any language (curl, a service in Go or JavaScript, an OpenAI SDK) points at the gateway as it would at
one engine. The gateway places each request as an embedded router does, through the same `PrismTransport`:
affinity key, modality, block hashes and cost from the body, expected time to first token over the prefix index,
the request's turn in the waiting room, another endpoint after a refused connect or a 503/429. It relays the
engine's answer as it arrives: a streamed completion's chunks are written to the caller as the engine sends them,
so the caller's first token is the engine's, one hop later.

Its own paths are `GET /health` (200 while an endpoint of its table takes requests, else 503, with the table's epoch
and version) and `GET /metrics` (the router's and the gateway's Prometheus metrics). Every other request is forwarded
with its method, path, query and headers, less the hop-by-hop ones; `X-Forwarded-For` names the caller.

What the gateway itself answers, as OpenAI-style JSON errors (`{"error": {"message", "type", "code"}}`):
- 400 for a request it cannot read (a malformed length or chunk, a target that is not a path), 413 for a body over
  `max_body_bytes`: counted in `prism_rejected_messages_total{receiver="gateway"}`;
- 503 with `Retry-After` when there is nowhere to send it (no table, an empty slice: `no_route`) or its class is
  shed (`shed`), 502 when no endpoint could be reached (`upstream_unreachable`), 504 when the engine sent nothing
  for `upstream_timeout_s` (`upstream_timeout`): counted in `prism_gateway_errors_total{kind}`.
A caller gone mid-answer (`client_gone`) ends the engine's request and its lease; an engine gone mid-answer
(`upstream_broken`) ends the caller's connection without the body's end, so the caller sees the answer cut.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

import httpx
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from prismlb.semantics import callers_speeds, held_speed
from prismlb.service import POLL_S, BoundedHandler, BoundedHttpServer, kind_counter, reply_bytes, reply_json
from prismlb.wire import ConfigError, NoRouteError, RejectCounter, RoutingTable, SliceTable, TableNode

from ._errors import ShedError
from ._httpx import PrismTransport
from ._ring import label
from ._router import Router

_log = logging.getLogger("prism.gateway")

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
"""Headers that describe one connection, not the request or answer: never passed on (the length is recomputed)."""
_MAX_CHUNK_LINE = 1024
"""Longest chunk-size line of a chunked request body (size, extensions) accepted."""


TokenizeSource = Literal["engine", "text"]
TOKENIZE_SOURCES: tuple[TokenizeSource, ...] = get_args(TokenizeSource)


def tokenize_problem(value: object) -> str:
    """What is wrong with `value` as `GatewayConfig.tokenize`."""
    return f"tokenize must be 'engine' or 'text', got {value!r}"


@dataclass(frozen=True)
class GatewayConfig:
    """Where the gateway listens and what it bounds; checked when it is made (ConfigError)."""

    host: str = "127.0.0.1"
    port: int = 8080
    """0: a free port the kernel picks (read it back from `Gateway.port`)."""
    max_connections: int = 1024
    """Callers' connections open at once (a thread each); one more is answered 503 and closed."""
    read_timeout_s: float = 30.0
    """How long a request may take to arrive whole once it begins, and an idle keep-alive connection stays open."""
    max_body_bytes: int = 64 << 20
    """Largest request body taken (a long prompt with inline images is megabytes)."""
    connect_timeout_s: float = 5.0
    """Connecting to an engine; past it the attempt fails and the next endpoint is tried."""
    upstream_timeout_s: float = 600.0
    """Longest wait for an engine's next bytes: a long prompt's prefill comes before its first chunk."""
    tokenize: TokenizeSource = "engine"
    """Where a text request's block hashes come from: `engine`, the token ids an engine's `/tokenize` gives
    (`EngineTokenizer`), which match the engines' KV events, and the text blocks where it gives none; `text`,
    the text blocks alone, which match the routers' own placements for `placed_ttl_s` (no round trip first)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"gateway: port must be 0 to 65535, got {self.port}")
        for name in ("max_connections", "max_body_bytes"):
            if not getattr(self, name) >= 1:
                raise ConfigError(f"gateway: {name} must be at least 1, got {getattr(self, name)!r}")
        if self.tokenize not in TOKENIZE_SOURCES:
            raise ConfigError(f"gateway: {tokenize_problem(self.tokenize)}")
        for name in ("read_timeout_s", "connect_timeout_s", "upstream_timeout_s"):
            if not getattr(self, name) > 0:  # NaN included
                raise ConfigError(f"gateway: {name} must be positive, got {getattr(self, name)!r}")


def static_table(urls: Sequence[str]) -> RoutingTable:
    """A table of `urls` alone, for a gateway without a brain (`prism gateway --worker-url`): one slice, `default`,
    that takes every modality; each worker its own node, named by its host and port, of weight 1. ValueError for a
    URL that is not `http(s)://host[:port][/path]` or names a worker twice."""
    nodes: list[TableNode] = []
    for url in urls:
        parts = urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.query:
            raise ValueError(f"worker URL {url!r} is not http(s)://host[:port][/path]")
        node_id = f"{parts.hostname}:{port}"
        if any(n.node_id == node_id for n in nodes):
            raise ValueError(f"worker {node_id} is named twice")
        nodes.append(TableNode(node_id=node_id, endpoint=url.rstrip("/"), weight=1.0))
    if not nodes:
        raise ValueError("no worker URLs")
    return RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="default", nodes=nodes)])


UNTRIED_SPEED_FACTOR = 2.0
"""A worker of no known speed (no measure, no first token) is expected to prefill this many times as fast as the
fastest known: it is tried, and measured by its first tokens. At the median speed (the brain's rule), a worker idle
since the start stays idle on prefix-sharing traffic: every worker that has taken a request holds the shared
prefix, which the idle one would compute first, so it is never the quickest choice and never measured."""


class WorkerWatch:
    """What a gateway without a brain learns of its workers' prefill speeds, applied to the router as a new version
    of the fixed table (`static_table`) after each round that changed one.

    A worker's speed is, in order: its latest measure from its own `/metrics`, as an agent measures it (the agent's
    `EngineCollector`, over at least 16 finished prefills); else the router's own measure, the prompt tokens it sent
    there over the seconds to their first tokens (`EndpointStatus.first_token_speed`), which a worker has from its
    first streamed answer on, scaled by the median ratio of the two measures over the workers that have both (that
    one reads a busy engine's queue and the hop too; `semantics.callers_speeds`, as every router stands in for a
    speed its table lacks); else, never yet measured, `UNTRIED_SPEED_FACTOR` times the
    fastest known. Speeds are published as the brain publishes them (`held_speed`). Before any measure the table
    carries none and expected times are in tokens, every worker alike. Without the router's own measure a gateway's
    first placements are blind for as long as the 16 prefills take, and prefix-sharing traffic sticks to where they
    went (agents' growing contexts): a slow GPU then takes agents and the fastest may take none. That is all it
    learns: no KV events, predicted tails, kernel signals or host state, which need an agent on the worker's host."""

    def __init__(
        self,
        router: Router,
        urls: Sequence[str],
        *,
        period_s: float = 2.0,
        collector: Callable[[str], Any] | None = None,
    ) -> None:
        from prismlb.agent import EngineCollector  # the agent's own measure, not a second one

        self.router = router
        self.table = static_table(urls)
        make = collector or (lambda url: EngineCollector(url, timeout_s=1.0))
        self._collectors = [(node, make(_metrics_url(node.endpoint))) for node in self.table.slices[0].nodes]
        self._measured: dict[str, float] = {}
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def speeds(self) -> dict[str, float]:
        """The prefill speed the table gives each worker now, tokens per second (none before a first measure)."""
        return {n.node_id: n.prefill_tokens_per_s for n in self.table.slices[0].nodes if n.prefill_tokens_per_s}

    def poll(self) -> bool:
        """Scrape every worker once and read the router's first tokens; apply the table when a worker's speed
        changed (whether it did)."""
        for node, collector in self._collectors:
            rate = collector.sample().prefill_tokens_per_s
            if rate:
                self._measured[node.node_id] = rate
        status = self.router.status()
        seen: dict[str, float] = {}
        for node in self.table.slices[0].nodes:
            endpoint = status.get(label(node))
            if endpoint is not None and endpoint.first_token_speed:
                seen[node.node_id] = endpoint.first_token_speed
        known = self._measured | callers_speeds(self._measured, seen)
        if not known:
            return False
        untried = UNTRIED_SPEED_FACTOR * max(known.values())
        nodes = [
            msgspec.structs.replace(
                n, prefill_tokens_per_s=held_speed(known.get(n.node_id, untried), n.prefill_tokens_per_s)
            )
            for n in self.table.slices[0].nodes
        ]
        if nodes == self.table.slices[0].nodes:
            return False
        slice_ = msgspec.structs.replace(self.table.slices[0], nodes=nodes)
        table = msgspec.structs.replace(
            self.table, version=self.table.version + 1, issued_unix_s=time.time(), slices=[slice_]
        )
        self.router.apply(table)
        self.table = table
        return True

    def start(self) -> None:
        """Poll every `period_s` on a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="prism-gateway-workers", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:  # at once first: each worker's measure counts its prefills from the gateway's start
            try:
                self.poll()
            except Exception:  # a fault here must not end the watch: the last table stays in force
                _log.exception("polling the workers' /metrics failed")
            if self._stop.wait(self.period_s):
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> WorkerWatch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _metrics_url(endpoint: str) -> str:
    """A worker's Prometheus endpoint: `/metrics` at its scheme, host and port (its path prefix is the API's)."""
    parts = urlsplit(endpoint)
    return f"{parts.scheme}://{parts.netloc}/metrics"


class _Refused(Exception):
    """A request the gateway answers itself: its status, the error's type and whether it is the caller's fault
    (counted as a reject) or the cluster's (counted as an error)."""

    def __init__(self, status: HTTPStatus, kind: str, message: str, *, caller: bool) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.caller = caller


class _ClientGone(Exception):
    """Writing to the caller failed: it closed its connection."""


class Gateway:
    """`router` behind an HTTP listener: bound when made (ConfigError when the address cannot be had), served from
    `start` until `close`. `transport` is what reaches the engines (httpx's own by default)."""

    def __init__(
        self,
        router: Router,
        config: GatewayConfig | None = None,
        *,
        registry: CollectorRegistry | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.router = router
        self.config = config or GatewayConfig()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rejects = RejectCounter("gateway", _log, self.registry)
        self._lock = threading.Lock()
        self._errors: dict[str, int] = {}
        self._responses: dict[str, int] = {}
        self.registry.register(_GatewayCollector(self))
        limits = httpx.Limits(
            max_connections=self.config.max_connections, max_keepalive_connections=self.config.max_connections
        )
        inner = transport if transport is not None else httpx.HTTPTransport(limits=limits)
        tokenize: Literal["engine"] | None = "engine" if self.config.tokenize == "engine" else None
        self.transport = PrismTransport(router, transport=inner, tokenize=tokenize)
        """Sends each request through the router; shared by every connection's thread. Called directly, not through
        an `httpx.Client`: a proxy wants none of a client's cookies, redirects or default headers, nor its cost."""
        timeout = httpx.Timeout(self.config.upstream_timeout_s, connect=self.config.connect_timeout_s, pool=None)
        self.timeouts = timeout.as_dict()
        """Each relayed request's timeouts, as httpx's transports read them from the request's extensions."""
        try:
            self._server = _GatewayServer(self)
        except OSError as exc:
            self.transport.close()
            raise ConfigError(f"gateway: cannot listen on {self.config.host}:{self.config.port}: {exc}") from None
        self.port = self._server.server_port
        """The port listened on (the kernel's pick when the config's is 0)."""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve on a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, args=(POLL_S,), name="prism-gateway", daemon=True
            )
            self._thread.start()
            _log.info("relaying on http://%s:%d", self.config.host, self.port)

    def close(self) -> None:
        """Stop taking requests, end the callers' open connections, then close the connections to the engines."""
        try:
            if self._thread is not None:
                self._server.shutdown()
                self._thread.join(timeout=5)
            self._server.server_close()
            self._server.close_connections()
        finally:
            self.transport.close()

    def __enter__(self) -> Gateway:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def errors(self) -> dict[str, int]:
        """Requests not relayed, by kind (`prism_gateway_errors_total`)."""
        with self._lock:
            return dict(self._errors)

    @property
    def responses(self) -> dict[str, int]:
        """Responses begun, by status code (`prism_gateway_responses_total`)."""
        with self._lock:
            return dict(self._responses)

    def _count(self, tally: dict[str, int], key: str) -> None:
        with self._lock:
            tally[key] = tally.get(key, 0) + 1


class _GatewayCollector:
    """The gateway's tallies as Prometheus counters, read at scrape time."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def collect(self) -> Iterator[Metric]:
        gateway = self._gateway
        yield kind_counter("prism_gateway_errors", "Requests the gateway could not relay, by kind", gateway.errors)
        yield kind_counter(
            "prism_gateway_responses", "Responses begun to callers, by status code", gateway.responses, label="code"
        )


class _GatewayServer(BoundedHttpServer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        config = gateway.config
        super().__init__(
            config.host,
            config.port,
            _GatewayHandler,
            max_connections=config.max_connections,
            read_timeout_s=config.read_timeout_s,
            rejects=gateway.rejects,
        )

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.debug("gateway connection from %s failed", client_address, exc_info=True)


class _GatewayHandler(BoundedHandler):
    """One caller's connection: its own paths answered here, every other request relayed."""

    server: _GatewayServer

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path not in ("/health", "/metrics"):
            self._relay()
            return
        try:
            self._body()  # read and dropped, so that the connection's next request starts where it should
        except _Refused as exc:
            if not self.timed_out():
                self._refuse(exc)
            self.close_connection = True
            return
        self.request_read()
        if path == "/health":
            self._health()
        else:
            reply_bytes(self, HTTPStatus.OK, generate_latest(self.server.gateway.registry), CONTENT_TYPE_LATEST)

    def _relay(self) -> None:
        gateway = self.server.gateway
        try:
            request = self._request()
        except _Refused as exc:
            if self.timed_out():  # counted, and the connection shut, by the read deadline
                self.close_connection = True
                return
            self._refuse(exc)
            return
        try:
            response = gateway.transport.handle_request(request)
        except NoRouteError as exc:
            self._refuse(_Refused(HTTPStatus.SERVICE_UNAVAILABLE, "no_route", str(exc), caller=False))
            return
        except ShedError as exc:
            self._refuse(_Refused(HTTPStatus.SERVICE_UNAVAILABLE, "shed", str(exc), caller=False))
            return
        except httpx.TimeoutException as exc:
            message = f"no endpoint answered in time: {exc!r}"
            self._refuse(_Refused(HTTPStatus.GATEWAY_TIMEOUT, "upstream_timeout", message, caller=False))
            return
        except httpx.HTTPError as exc:
            message = f"no endpoint could be reached: {exc!r}"
            self._refuse(_Refused(HTTPStatus.BAD_GATEWAY, "upstream_unreachable", message, caller=False))
            return
        except Exception:  # a fault in the gateway or the router, not in the input: this request alone fails
            _log.exception("relaying %s %s failed inside the gateway", self.command, self.path)
            self._refuse(_Refused(HTTPStatus.INTERNAL_SERVER_ERROR, "internal", "internal error", caller=False))
            return
        try:
            self._answer(response)
        finally:
            response.close()

    do_POST = do_PUT = do_PATCH = do_DELETE = _relay

    def _request(self) -> httpx.Request:
        """The caller's request as the router's transport sends it; `_Refused` for one that cannot be read."""
        if not self.path.startswith("/"):
            self.close_connection = True
            raise _Refused(HTTPStatus.BAD_REQUEST, "bad_target", f"request target {self.path[:80]!r} is not a path")
        body = self._body()
        self.request_read()
        caller = self.client_address[0]
        forwarded = self.headers.get("X-Forwarded-For")
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP | {"x-forwarded-for"}]
        headers.append(("X-Forwarded-For", f"{forwarded}, {caller}" if forwarded else caller))
        extensions = {"timeout": self.server.gateway.timeouts}
        return httpx.Request(
            self.command, f"http://prism.gateway{self.path}", headers=headers, content=body, extensions=extensions
        )

    def _body(self) -> bytes:
        """The request body: chunked, or as long as its Content-Length, or none."""
        limit = self.server.gateway.config.max_body_bytes
        encoding = self.headers.get("Transfer-Encoding", "").strip().lower()
        if encoding:
            if encoding != "chunked":
                self.close_connection = True
                raise _Refused(
                    HTTPStatus.NOT_IMPLEMENTED, "bad_encoding", f"Transfer-Encoding {encoding!r}", caller=True
                )
            return self._chunked(limit)
        raw = self.headers.get("Content-Length")
        if raw is None:
            return b""
        if not raw.strip().isdigit():
            self.close_connection = True
            raise _Refused(
                HTTPStatus.BAD_REQUEST, "bad_length", f"Content-Length {raw[:40]!r} is not a size", caller=True
            )
        length = int(raw)
        if length > limit:
            self.close_connection = True
            raise _Refused(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "oversized", f"body of {length} bytes over {limit}", caller=True
            )
        return self._exactly(length)

    def _chunked(self, limit: int) -> bytes:
        """A chunked body, decoded; trailers are read and dropped."""
        parts: list[bytes] = []
        size = 0
        while True:
            line = self.rfile.readline(_MAX_CHUNK_LINE + 1)
            text = line.split(b";", 1)[0].strip()
            if len(line) > _MAX_CHUNK_LINE or not line.endswith(b"\n") or not text:
                self.close_connection = True
                raise _Refused(HTTPStatus.BAD_REQUEST, "bad_chunk", f"chunk size line {line[:40]!r}", caller=True)
            try:
                chunk = int(text, 16)
            except ValueError:
                self.close_connection = True
                raise _Refused(HTTPStatus.BAD_REQUEST, "bad_chunk", f"chunk size {text[:40]!r}", caller=True) from None
            if chunk == 0:
                break
            size += chunk
            if size > limit:
                self.close_connection = True
                raise _Refused(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "oversized", f"chunked body over {limit} bytes", caller=True
                )
            parts.append(self._exactly(chunk))
            if self.rfile.readline(3).strip():
                self.close_connection = True
                raise _Refused(HTTPStatus.BAD_REQUEST, "bad_chunk", "a chunk longer than its size", caller=True)
        while self.rfile.readline(_MAX_CHUNK_LINE + 1).strip():  # trailers, up to the blank line
            pass
        return b"".join(parts)

    def _exactly(self, length: int) -> bytes:
        data = self.read_exactly(length)
        if data is None:
            raise _Refused(
                HTTPStatus.BAD_REQUEST, "truncated", f"the body ended before its {length} bytes", caller=True
            )
        return data

    def _answer(self, response: httpx.Response) -> None:
        """Relay the engine's answer as it arrives: its length when it gave one, else chunked (HTTP/1.1) or up to
        the connection's end (HTTP/1.0)."""
        gateway = self.server.gateway
        status = response.status_code
        length = response.headers.get("content-length")
        bodiless = status < 200 or status in (HTTPStatus.NO_CONTENT, HTTPStatus.NOT_MODIFIED)
        chunked = length is None and not bodiless and self.request_version == "HTTP/1.1"
        if length is None and not bodiless and not chunked:
            self.close_connection = True
        gateway._count(gateway._responses, str(status))
        try:
            self._write_head(status, response.headers.multi_items(), length, chunked)
            for piece in response.iter_raw():
                if piece:
                    self._write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                self._write(b"0\r\n\r\n")
        except _ClientGone:
            gateway._count(gateway._errors, "client_gone")
            self.close_connection = True
        except httpx.HTTPError as exc:
            gateway._count(gateway._errors, "upstream_broken")
            _log.debug("the engine's answer to %s %s broke off: %r", self.command, self.path, exc)
            self.close_connection = True

    def _write_head(self, status: int, headers: Iterable[tuple[str, str]], length: str | None, chunked: bool) -> None:
        try:
            self.log_request(status)
            self.send_response_only(status)
            for name, value in headers:
                if name.lower() not in _HOP_BY_HOP:
                    self.send_header(name, value)
            if length is not None:
                self.send_header("Content-Length", length)
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
        except OSError as exc:
            raise _ClientGone from exc

    def _write(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
        except OSError as exc:
            raise _ClientGone from exc

    def _refuse(self, exc: _Refused) -> None:
        """Answer `exc` as an OpenAI-style error, counted as the caller's fault or the cluster's."""
        gateway = self.server.gateway
        if exc.caller:
            gateway.rejects.count(exc.kind, exc)
        else:
            gateway._count(gateway._errors, exc.kind)
        gateway._count(gateway._responses, str(int(exc.status)))
        headers = {"Retry-After": "1"} if exc.status == HTTPStatus.SERVICE_UNAVAILABLE else {}
        if self.close_connection:
            headers["Connection"] = "close"
        error = {"error": {"message": str(exc), "type": exc.kind, "code": int(exc.status)}}
        try:
            reply_json(self, exc.status, error, headers)
        except OSError:
            self.close_connection = True

    def _health(self) -> None:
        """200 while some endpoint of the table takes requests; 503 without a table, without endpoints, or with every
        endpoint's circuit open (a balancer in front then sends elsewhere until a circuit half-opens)."""
        router = self.server.gateway.router
        table = router.table
        endpoints = 0 if table is None else len({n.node_id for s in table.slices for n in s.nodes})
        available = sum(1 for status in router.status().values() if status.available)
        if table is None:
            state = "no_table"
        elif not endpoints:
            state = "no_endpoints"
        else:
            state = "ok" if available else "none_available"
        payload = {
            "status": state,
            "table": None if table is None else {"epoch": table.epoch, "version": table.version},
            "endpoints": endpoints,
            "available": available,
        }
        reply_json(self, HTTPStatus.OK if state == "ok" else HTTPStatus.SERVICE_UNAVAILABLE, payload)

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("%s: " + format, self.client_address[0], *args)
