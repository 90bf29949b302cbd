"""Join OTLP spans to the TCP connections the kernel saw, and enrich them with `prism.net.*` attributes.

Server spans join by exact 4-tuple (the span's peer address/port and local port) at the span's time;
client spans by remote address/port plus the span's process id and time window; the span's thread and
time are the last resort. Kernel times arrive already aligned to the epoch (see `_conntrack.py`).
"""

from __future__ import annotations

import ipaddress
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from ._connections import Connection

SERVER = Span.SpanKind.SPAN_KIND_SERVER
CLIENT = Span.SpanKind.SPAN_KIND_CLIENT

# Attribute names, newest semantic conventions first, then the older `net.*` names.
PEER_ADDRESS = ("network.peer.address", "net.sock.peer.addr", "client.address", "net.peer.ip")
PEER_PORT = ("network.peer.port", "net.sock.peer.port", "client.port", "net.peer.port")
LOCAL_ADDRESS = ("network.local.address", "net.sock.host.addr")
LOCAL_PORT = ("network.local.port", "net.sock.host.port", "server.port", "net.host.port")
CLIENT_REMOTE_ADDRESS = ("network.peer.address", "net.sock.peer.addr", "server.address", "net.peer.name")
CLIENT_REMOTE_PORT = ("network.peer.port", "net.sock.peer.port", "server.port", "net.peer.port")
TRANSPORT = ("network.transport", "net.transport")

Stats = Callable[[int, int, int], "tuple[int, int, int] | None"]
"""(sock_id, local port, remote port) -> a live connection's (bytes sent, bytes received, retransmits), or None."""


NORMALISED_MAX = 8192
"""Addresses whose canonical form is kept: a host's connections and spans name few distinct addresses, and parsing
one (`ipaddress`) costs several µs, on both ends of every connection event and on every span."""


@lru_cache(maxsize=NORMALISED_MAX)
def normalise_address(text: str) -> str | None:
    """The canonical form of an IP address (IPv4-mapped IPv6 as IPv4); None for a host name."""
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _normalise(conn: Connection) -> None:
    conn.local_addr = normalise_address(conn.local_addr) or conn.local_addr
    conn.remote_addr = normalise_address(conn.remote_addr) or conn.remote_addr


CLOSE_EVENT_WAIT_S = 0.2
"""How long a span waits for the close event of a connection the kernel has just dropped, for its final counts."""


class ConnectionIndex:
    """Recent connections, found by 4-tuple or by remote endpoint; bounded in count and age.

    Written by the kernel-event thread, read by the join thread: every method takes the lock.
    """

    def __init__(self, retention_s: float = 300.0, max_connections: int = 200_000) -> None:
        self.retention_ns = int(retention_s * 1e9)
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._close_seen = threading.Condition(self._lock)
        self._waiting = 0
        self._live: dict[int, Connection] = {}
        self._by_remote: dict[tuple[str, int], deque[Connection]] = {}
        self._order: deque[Connection] = deque()
        self.evicted = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._order)

    def wait_closed(self, conn: Connection, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for `conn`'s close event (the kernel dropped it, the event is on its way)."""
        with self._lock:
            self._waiting += 1
            try:
                return self._close_seen.wait_for(lambda: conn.closed_unix_ns is not None, timeout_s)
            finally:
                self._waiting -= 1

    def established(self, conn: Connection) -> None:
        _normalise(conn)
        with self._lock:
            self._live[conn.sock_id] = conn
            self._add(conn)

    def closed(self, final: Connection) -> None:
        """Record the close; a connection first seen at its close is added as well."""
        _normalise(final)
        with self._lock:
            conn = self._live.pop(final.sock_id, None)
            if conn is None or conn.four_tuple != final.four_tuple:
                self._add(final)
                return
            conn.closed_unix_ns = final.closed_unix_ns
            conn.bytes_sent, conn.bytes_received = final.bytes_sent, final.bytes_received
            conn.retransmits = final.retransmits
            conn.pid = conn.pid or final.pid
            conn.tid = conn.tid or final.tid
            conn.comm = conn.comm or final.comm
            conn.process_start_unix_s = conn.process_start_unix_s or final.process_start_unix_s
            if self._waiting:
                self._close_seen.notify_all()

    def _add(self, conn: Connection) -> None:
        """Index `conn` by remote endpoint and age (the lock held). Each remote endpoint's connections are in the
        order they were added, as `_order` is, so the oldest of all is also the first of its endpoint's."""
        key = (conn.remote_addr, conn.remote_port)
        bucket = self._by_remote.get(key)
        if bucket is None:
            bucket = self._by_remote[key] = deque()
        bucket.append(conn)
        self._order.append(conn)
        self._evict(conn.established_unix_ns)

    def _evict(self, now_ns: int) -> None:
        horizon = now_ns - self.retention_ns
        order = self._order
        while order and (
            len(order) > self.max_connections
            or (order[0].closed_unix_ns is not None and order[0].closed_unix_ns < horizon)
        ):
            old = order.popleft()
            key = (old.remote_addr, old.remote_port)
            bucket = self._by_remote[key]
            bucket.popleft()
            if not bucket:
                del self._by_remote[key]
            if self._live.get(old.sock_id) is old:
                del self._live[old.sock_id]
            self.evicted += 1

    def candidates(self, remote_addr: str, remote_port: int) -> list[Connection]:
        with self._lock:
            return list(self._by_remote.get((remote_addr, remote_port), ()))

    def by_thread(self, pid: int, tid: int | None) -> list[Connection]:
        with self._lock:
            return [c for c in self._order if c.pid == pid and (tid is None or c.tid == tid)]


@dataclass
class JoinCounts:
    """What the joiner saw and joined since start, for the agent's `prism_agent_join_*` counters."""

    server_spans: int = 0
    """Server spans received, whatever their transport."""
    server_spans_with_peer: int = 0
    """Server spans over TCP naming the peer's address and port and the local port: those a join could find."""
    server_spans_joined: int = 0
    """Server spans joined to a connection by its 4-tuple."""
    client_spans: int = 0
    """Client spans over TCP (or of no stated transport)."""
    client_spans_joined: int = 0
    """Client spans joined to a connection, by peer and process or by thread."""
    joined_by_thread: int = 0
    """Of `client_spans_joined`, those found only by the thread that opened the connection."""

    @property
    def coverage(self) -> float | None:
        """Joined server spans over server spans that named a TCP peer; None before any."""
        if not self.server_spans_with_peer:
            return None
        return self.server_spans_joined / self.server_spans_with_peer


def _attributes(kvs: Iterable[KeyValue]) -> dict[str, str | int]:
    out: dict[str, str | int] = {}
    for kv in kvs:
        kind = kv.value.WhichOneof("value")
        if kind == "string_value":
            out[kv.key] = kv.value.string_value
        elif kind == "int_value":
            out[kv.key] = kv.value.int_value
    return out


def _first(attrs: dict[str, str | int], names: tuple[str, ...]) -> str | int | None:
    for name in names:
        if name in attrs:
            return attrs[name]
    return None


def _port(value: str | int | None) -> int | None:
    try:
        port = int(value) if value is not None else None
    except ValueError:
        return None
    return port if port is not None and 0 < port < 65536 else None


def _kv(key: str, value: str | int | float | bool) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


class SpanJoiner:
    """Finds each span's connection in a `ConnectionIndex` and adds `prism.net.*` attributes in place."""

    def __init__(self, index: ConnectionIndex, stats: Stats | None = None, slack_s: float = 0.05) -> None:
        self.index = index
        self._stats = stats
        self._slack_ns = int(slack_s * 1e9)
        self.counts = JoinCounts()

    def enrich(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            pid = _port_or_pid(resource.get("process.pid"))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self._join(span, pid)

    def _join(self, span: Span, pid: int | None) -> None:
        attrs = _attributes(span.attributes)
        transport = _first(attrs, TRANSPORT)
        tcp = transport is None or str(transport).lower() == "tcp" or str(transport) == "ip_tcp"
        conn: Connection | None = None
        how = ""
        if span.kind == SERVER:
            self.counts.server_spans += 1
            peer = normalise_address(str(_first(attrs, PEER_ADDRESS) or ""))
            peer_port = _port(_first(attrs, PEER_PORT))
            local_port = _port(_first(attrs, LOCAL_PORT))
            if tcp and peer is not None and peer_port is not None and local_port is not None:
                self.counts.server_spans_with_peer += 1
                local = normalise_address(str(_first(attrs, LOCAL_ADDRESS) or ""))
                conn = self._server(span, peer, peer_port, local, local_port)
                if conn is not None:
                    self.counts.server_spans_joined += 1
                    how = "4-tuple"
        elif span.kind == CLIENT and tcp:
            self.counts.client_spans += 1
            remote = normalise_address(str(_first(attrs, CLIENT_REMOTE_ADDRESS) or ""))
            remote_port = _port(_first(attrs, CLIENT_REMOTE_PORT))
            if remote is not None and remote_port is not None:
                conn = self._client(span, remote, remote_port, pid, _port(attrs.get("network.local.port")))
                how = "peer+pid"
            if conn is None and pid is not None:
                conn = self._thread(span, pid, _port_or_pid(attrs.get("thread.id")))
                how = "thread"
                if conn is not None:
                    self.counts.joined_by_thread += 1
            if conn is not None:
                self.counts.client_spans_joined += 1
        if conn is not None:
            self._annotate(span, conn, how)

    def _window(self, span: Span) -> tuple[int, int]:
        return span.start_time_unix_nano, max(span.start_time_unix_nano, span.end_time_unix_nano)

    def _server(self, span: Span, peer: str, peer_port: int, local: str | None, local_port: int) -> Connection | None:
        start, _ = self._window(span)
        for conn in reversed(self.index.candidates(peer, peer_port)):
            if (
                conn.role == "server"
                and conn.local_port == local_port
                and (local is None or conn.local_addr == local)
                and conn.alive_at(start, self._slack_ns)
            ):
                return conn
        return None

    def _client(
        self, span: Span, remote: str, remote_port: int, pid: int | None, local_port: int | None
    ) -> Connection | None:
        start, end = self._window(span)
        best: Connection | None = None
        for conn in self.index.candidates(remote, remote_port):
            if conn.role != "client" or (pid is not None and conn.pid != pid):
                continue
            if local_port is not None and conn.local_port != local_port:
                continue
            if conn.established_unix_ns > end:  # no slack here: the next connection may follow within µs
                continue
            if conn.closed_unix_ns is not None and conn.closed_unix_ns < start - self._slack_ns:
                continue
            if best is None or conn.established_unix_ns > best.established_unix_ns:
                best = conn
        return best

    def _thread(self, span: Span, pid: int, tid: int | None) -> Connection | None:
        start, end = self._window(span)
        inside = [
            c
            for c in self.index.by_thread(pid, tid)
            if c.role == "client" and start - self._slack_ns <= c.established_unix_ns <= end
        ]
        if not inside or (tid is None and len(inside) > 1):
            return None  # without a thread id, only an unambiguous connection will do
        return inside[-1]

    def _annotate(self, span: Span, conn: Connection, how: str) -> None:
        start, _ = self._window(span)
        first = conn.first_span_unix_ns
        reused = first is not None and start > first
        if first is None or start < first:
            conn.first_span_unix_ns = start
        live = None
        if conn.closed_unix_ns is None and self._stats is not None:
            live = self._stats(conn.sock_id, conn.local_port, conn.remote_port)
            if live is None:  # closed in the kernel, its close event (with the final counts) not read yet
                self.index.wait_closed(conn, CLOSE_EVENT_WAIT_S)
        sent, received, retransmits = live or (conn.bytes_sent, conn.bytes_received, conn.retransmits)
        extra: list[tuple[str, str | int | float | bool]] = [
            ("prism.net.join", how),
            ("prism.net.role", conn.role),
            ("prism.net.local.address", conn.local_addr),
            ("prism.net.local.port", conn.local_port),
            ("prism.net.peer.address", conn.remote_addr),
            ("prism.net.peer.port", conn.remote_port),
            ("prism.net.connection_age_ms", max(0.0, (start - conn.established_unix_ns) / 1e6)),
            ("prism.net.reused", reused),
            ("prism.net.retransmits", retransmits),
            ("prism.net.bytes_sent", sent),
            ("prism.net.bytes_received", received),
        ]
        if conn.handshake_us is not None:
            extra.append(("prism.net.handshake_us", conn.handshake_us))
        if conn.pid is not None:
            extra.append(("prism.net.pid", conn.pid))
        if conn.process_start_unix_s is not None:
            extra.append(("prism.net.process.start_unix_s", conn.process_start_unix_s))
        span.attributes.extend(_kv(k, v) for k, v in extra)


def _port_or_pid(value: str | int | None) -> int | None:
    try:
        number = int(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and number > 0 else None
