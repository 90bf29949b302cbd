"""HTTP for the services built on `http.server`: whole responses, and a threading server that bounds its
connections and the time a request may take to arrive.

A service's endpoints (the brain's admin API, the OTLP receiver, the emulated engine) answer with a body whose
length is known, so every reply is written alike. The servers that face many clients (the OTLP receiver, the
gateway) serve each connection on its own thread, so they bound how many are open and how long a request may
take to arrive: a client that opens connections and sends nothing, or a byte a minute, holds a thread each.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prismlb.wire import RejectCounter

POLL_S = 0.1
"""How often a `BoundedHttpServer`'s `serve_forever` should poll (its argument): how soon it notices shutdown and a
request past its read deadline."""
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n"


def reply_bytes(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: bytes,
    content_type: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Send `status` and `body` with its Content-Length (so a keep-alive connection knows where the next response
    starts), its `content_type` when given, then `headers`."""
    handler.send_response(status)
    if content_type is not None:
        handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


def reply_json(
    handler: BaseHTTPRequestHandler,
    status: int,
    payload: object,
    headers: Mapping[str, str] | None = None,
    *,
    default: Callable[[Any], Any] | None = None,
) -> None:
    """Send `payload` as JSON (`default` as in `json.dumps`, for values JSON has no type for), as `reply_bytes`."""
    reply_bytes(handler, status, json.dumps(payload, default=default).encode(), "application/json", headers)


@dataclass
class _Slot:
    """One admitted connection: when the request being read must be complete (None while none is being read), and
    whether it was closed for missing that deadline."""

    deadline: float | None
    timed_out: bool = False


class BoundedHttpServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most `max_connections` connections (threads), and a read deadline per request
    enforced by the accepting thread between its polls (`serve_forever(POLL_S)`). A connection over the limit is
    answered 503 and closed at once; refusals and deadlines missed are counted in `rejects` (`too_many_connections`,
    `read_timeout`). Its handler is a `BoundedHandler`."""

    request_queue_size = 128  # a burst of connects waits in the kernel for the accepting thread, not in SYN retries

    def __init__(
        self,
        host: str,
        port: int,
        handler: type[BoundedHandler],
        *,
        max_connections: int,
        read_timeout_s: float,
        rejects: RejectCounter,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.rejects = rejects
        self.connections: dict[socket.socket, _Slot] = {}
        self.connections_lock = threading.Lock()
        super().__init__((host, port), handler)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's would look the host's name up in DNS
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    @property
    def open_connections(self) -> int:
        with self.connections_lock:
            return len(self.connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on its own thread if a slot is free; else answer 503 and close it now."""
        with self.connections_lock:
            admitted = len(self.connections) < self.max_connections
            if admitted:
                self.connections[request] = _Slot(None)
        if not admitted:
            self.rejects.count(
                "too_many_connections",
                f"connection from {client_address[0]} refused: {self.max_connections} already open",
            )
            _refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread to serve it: the caller closes it, the slot is freed here
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: socket.socket) -> None:
        with self.connections_lock:
            self.connections.pop(request, None)

    def arm(self, request: socket.socket, armed: bool) -> None:
        """Start (True) the read deadline of a request that began to arrive, or stop it (False) once read."""
        deadline = time.monotonic() + self.read_timeout_s if armed else None
        with self.connections_lock:
            slot = self.connections.get(request)
            if slot is not None:
                slot.deadline = deadline

    def timed_out(self, request: socket.socket) -> bool:
        with self.connections_lock:
            slot = self.connections.get(request)
            return slot is not None and slot.timed_out

    def service_actions(self) -> None:
        """Close the connections whose request is past its read deadline (called between polls)."""
        now = time.monotonic()
        with self.connections_lock:
            expired = [
                conn
                for conn, slot in self.connections.items()
                if slot.deadline is not None and slot.deadline <= now and not slot.timed_out
            ]
            for conn in expired:
                self.connections[conn].timed_out = True
        for conn in expired:
            self.rejects.count("read_timeout", f"a request was not complete within {self.read_timeout_s:g} s")
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close_connections(self) -> None:
        """End every open keep-alive connection, so no request arrives after shutdown."""
        with self.connections_lock:
            for conn in self.connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


def _refuse(conn: socket.socket) -> None:
    """Answer 503 on a connection that is not served, without ever blocking the accepting thread."""
    conn.setblocking(False)
    with contextlib.suppress(OSError):
        conn.recv(1 << 16)  # what has arrived: closing with it unread would reset the connection before the 503
    with contextlib.suppress(OSError):
        conn.send(_BUSY)


class NoDelayHandler(BaseHTTPRequestHandler):
    """A handler whose connection sends each write at once (TCP_NODELAY), as asyncio's servers (uvicorn, hence
    vLLM and SGLang) and nginx do. `http.server` writes a reply's head and its body, and a stream's every chunk, as
    separate writes; under Nagle's algorithm a write waits for the ACK of the one before, which a client that
    delays its ACKs sends up to 40 ms later: a streamed first token, or a whole small reply, that late."""

    def setup(self) -> None:
        super().setup()
        with contextlib.suppress(OSError):  # not TCP (a Unix socket): nothing to turn off
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class BoundedHandler(NoDelayHandler):
    """One connection's requests on a `BoundedHttpServer`: HTTP/1.1 keep-alive, each request's read deadline armed
    as it begins to arrive. A handler calls `request_read()` once it has read the whole request (from then on it
    may take as long as it needs)."""

    protocol_version = "HTTP/1.1"
    server: BoundedHttpServer

    def handle_one_request(self) -> None:
        """Wait up to the read timeout for the next request to start (an idle keep-alive connection is then
        closed, as any client expects, and not counted), then give the whole request as long to arrive. No
        socket timeout while it does: the server's deadline bounds every read."""
        self.connection.settimeout(self.server.read_timeout_s)
        try:
            started = self.rfile.peek(1)
        except OSError:  # idle for the whole timeout (TimeoutError), or reset
            started = b""
        if not started:
            self.close_connection = True
            return
        self.connection.settimeout(None)
        self.server.arm(self.connection, True)
        super().handle_one_request()

    def read_exactly(self, length: int) -> bytes | None:
        """The next `length` bytes of the request (its body, as its length says); None, the connection then to be
        closed, when the client sent fewer before closing or missing its deadline."""
        try:
            data = self.rfile.read(length)
        except OSError:
            data = b""
        if len(data) != length:
            self.close_connection = True
            return None
        return data

    def request_read(self) -> None:
        """The request is in: its read deadline no longer applies."""
        self.server.arm(self.connection, False)

    def timed_out(self) -> bool:
        """Whether the server closed this connection for missing its read deadline (already counted)."""
        return self.server.timed_out(self.connection)
