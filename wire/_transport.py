"""ZeroMQ links: agents PUSH node vectors to the brain's PULL; the brain serves routers by the clone
pattern (PUB for every table and a heartbeat, ROUTER for snapshots to late joiners)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.utils.monitor

from ._codec import MAX_TABLE_BYTES, MAX_VECTOR_BYTES, decode, encode
from ._curve import ClientCurve, ServerCurve
from ._exceptions import WireError
from ._messages import Heartbeat, NodeVector, RoutingTable, SnapshotRequest
from ._rejects import RejectCounter

_log = logging.getLogger("prism.wire")
_LOOP_IDLE_S = 0.5  # the subscriber loop wakes at least this often
_FRAME_SLACK = 1024


@dataclass(frozen=True)
class BrainAddress:
    """Where one brain publishes tables (`updates`, PUB) and answers snapshot requests (`snapshot`)."""

    updates: str
    snapshot: str


def _socket(
    ctx: zmq.Context, kind: int, *, hwm: int, max_bytes: int, curve: ClientCurve | ServerCurve | None = None
) -> zmq.Socket:
    """A socket with Prism's limits and, when given, CURVE applied; closed again if set-up fails."""
    sock = ctx.socket(kind)
    try:
        _configure(sock, hwm=hwm, max_bytes=max_bytes)
        if curve is not None:
            curve.apply(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def _configure(sock: zmq.Socket, *, hwm: int, max_bytes: int) -> None:
    sock.linger = 0
    sock.sndhwm = hwm
    sock.rcvhwm = hwm
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + _FRAME_SLACK)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)


def _attach(sock: zmq.Socket, endpoint: str, *, bind: bool) -> zmq.Socket:
    """Bind or connect `sock`; on failure close it so the context can still terminate."""
    try:
        sock.bind(endpoint) if bind else sock.connect(endpoint)
    except BaseException:
        sock.close()
        raise
    return sock


class VectorSender:
    """Agent side: a PUSH socket with a bounded queue; a full queue drops the vector and counts it.

    With CURVE, a brain that refuses this agent's key ends the connection for good (libzmq does not retry a
    failed authentication). The sender watches for that and starts over with a new socket `retry_s` later,
    doubling up to `RETRY_MAX_S` while refusals go on, so an agent started before its key was filed gets in
    once it is. Refusals are counted (`refused`) and logged, once per run of them.
    """

    RETRY_MAX_S = 30.0

    def __init__(
        self, ctx: zmq.Context, endpoint: str, *, curve: ClientCurve | None = None, hwm: int = 64, retry_s: float = 1.0
    ) -> None:
        self._ctx, self._endpoint, self._curve, self._hwm = ctx, endpoint, curve, hwm
        self._retry_s = self._first_retry_s = retry_s
        self._retry_at: float | None = None
        self._monitor: zmq.Socket | None = None
        self.sent = 0
        self.dropped = 0
        self.refused = 0
        self._sock = self._open()

    def _open(self) -> zmq.Socket:
        sock = _socket(self._ctx, zmq.PUSH, hwm=self._hwm, max_bytes=MAX_VECTOR_BYTES, curve=self._curve)
        if self._curve is not None:
            self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        return _attach(sock, self._endpoint, bind=False)

    def _watch(self) -> None:
        """Notice refusals and successful handshakes; after a refusal, start over once `retry_s` has passed."""
        monitor = self._monitor
        if monitor is None:
            return
        now = time.monotonic()
        if self._retry_at is not None:
            if now >= self._retry_at:
                self._close_socket()
                self._retry_at = None
                self._sock = self._open()
            return
        while monitor.poll(0):
            event = zmq.utils.monitor.parse_monitor_message(monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._retry_s = self._first_retry_s
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self._retry_at is None:
                self.refused += 1
                if self._retry_s == self._first_retry_s:
                    _log.error(
                        "the brain at %s refused this agent's CURVE key; retrying every %g s up to %g s "
                        "(file the agent's public key in the brain's authorised folder)",
                        self._endpoint,
                        self._retry_s,
                        self.RETRY_MAX_S,
                    )
                self._retry_at = now + self._retry_s
                self._retry_s = min(self.RETRY_MAX_S, 2 * self._retry_s)

    def send(self, vector: NodeVector) -> bool:
        self._watch()
        try:
            self._sock.send_multipart(encode(vector), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def _close_socket(self, linger: int | None = 0) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._sock.close(linger=linger)

    def close(self) -> None:
        self._close_socket(linger=None)

    def __enter__(self) -> VectorSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class IdentityCheck(Protocol):
    """Decides whether a vector may come from the peer the authenticator named (ZAP `User-Id`), connected
    from `peer_address` (the connection's `Peer-Address`, e.g. to bind the vector's endpoint to it)."""

    def check(self, vector: NodeVector, user_id: str | None, peer_address: str | None) -> None:
        """Raise a `WireError` when `vector` may not come from `user_id` (None: the peer has none)."""


def _property(frame: zmq.Frame, name: str) -> str | None:
    try:
        value = frame.get(name)
    except zmq.ZMQError:
        return None
    return value if isinstance(value, str) else None


class VectorReceiver:
    """Brain side: a bound PULL socket; malformed vectors, and with `identity` vectors it refuses, are
    counted by `rejects` and skipped.

    The socket takes frames up to OVERSIZE_COUNTED times the vector limit, so that a vector over the limit
    reaches `decode` and is counted as `oversized` instead of libzmq silently cutting the sender's connection
    (it still does so beyond that multiple). `backlog` counts consecutive `drain` calls that stopped at their
    limit: 0 while the brain keeps up, growing while vectors wait in the socket's queue.
    """

    OVERSIZE_COUNTED = 4
    DRAIN_LIMIT = 2_000
    """Messages per `drain` by default: at 50-100 µs a realistic vector, the brain's loop still gets to its
    table cycle (0.2 s) while overloaded; what waits longer is dropped by the senders' full queues and counted
    by the brain as sequence gaps."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        rejects: RejectCounter,
        *,
        curve: ServerCurve | None = None,
        identity: IdentityCheck | None = None,
        hwm: int = 10_000,
    ) -> None:
        sock = _socket(ctx, zmq.PULL, hwm=hwm, max_bytes=self.OVERSIZE_COUNTED * MAX_VECTOR_BYTES, curve=curve)
        self.socket = _attach(sock, endpoint, bind=True)
        self._rejects = rejects
        self._identity = identity
        self.backlog = 0

    def drain(self, limit: int = DRAIN_LIMIT) -> list[NodeVector]:
        """Every vector waiting now, up to `limit` messages; never blocks."""
        out: list[NodeVector] = []
        recv, identity = self.socket.recv_multipart, self._identity
        for _ in range(limit):
            try:
                if identity is None:
                    frames, user_id, peer_address = recv(flags=zmq.NOBLOCK), None, None
                else:  # only frames received without copying carry the authenticator's User-Id
                    parts = recv(flags=zmq.NOBLOCK, copy=False)
                    frames = [part.bytes for part in parts]
                    user_id, peer_address = _property(parts[0], "User-Id"), _property(parts[0], "Peer-Address")
            except zmq.Again:
                self.backlog = 0
                break
            try:
                vector = decode(frames, (NodeVector,), MAX_VECTOR_BYTES)
                if identity is not None:
                    identity.check(vector, user_id, peer_address)
            except WireError as exc:
                self._rejects.record(exc)
                continue
            out.append(vector)
        else:
            self.backlog += 1
        return out

    def close(self) -> None:
        self.socket.close()


class TablePublisher:
    """Brain side of the clone pattern: PUB for tables and heartbeats, ROUTER for snapshots."""

    def __init__(
        self,
        ctx: zmq.Context,
        updates: str,
        snapshot: str,
        rejects: RejectCounter,
        *,
        curve: ServerCurve | None = None,
    ) -> None:
        self._pub = _attach(_socket(ctx, zmq.PUB, hwm=1000, max_bytes=MAX_TABLE_BYTES, curve=curve), updates, bind=True)
        try:
            sock = _socket(ctx, zmq.ROUTER, hwm=1000, max_bytes=MAX_VECTOR_BYTES, curve=curve)
            self.snapshot_socket = _attach(sock, snapshot, bind=True)
        except BaseException:
            self._pub.close()
            raise
        self._rejects = rejects
        self.current: RoutingTable | None = None
        self._current_frames: list[bytes] = []
        self.snapshots_served = 0

    def publish(self, table: RoutingTable) -> None:
        """Send `table` to every subscriber; raises `WireError` for a table routers would reject."""
        frames = encode(table)
        decode(frames, (RoutingTable,), MAX_TABLE_BYTES)
        self.current = table
        self._current_frames = frames
        self._pub.send_multipart(self._current_frames)

    def heartbeat(self) -> None:
        if self.current is not None:
            hb = Heartbeat(epoch=self.current.epoch, version=self.current.version, issued_unix_s=time.time())
            self._pub.send_multipart(encode(hb))

    def serve_snapshots(self) -> None:
        """Answer every waiting snapshot request with the current table; never blocks."""
        while True:
            try:
                frames = self.snapshot_socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                decode(body, (SnapshotRequest,), MAX_VECTOR_BYTES)
            except WireError as exc:
                self._rejects.record(exc)
                continue
            if self.current is not None:
                try:
                    self.snapshot_socket.send_multipart([identity, *self._current_frames], flags=zmq.NOBLOCK)
                    self.snapshots_served += 1
                except zmq.Again:
                    pass

    def close(self) -> None:
        self._pub.close()
        self.snapshot_socket.close()


class _SubscriberLoop:
    """One thread per ZeroMQ context serving every TableSubscriber made on it.

    A process that embeds several routers on one context (or many subscribers, as the propagation benchmark
    does) then wakes one thread per table instead of one per subscriber: the threads would otherwise queue for
    the interpreter lock and the CPUs one after another. The thread owns the subscribers' sockets, creates them
    when a subscriber starts, closes them when it stops, and ends (closing its own sockets) with its last
    subscriber, so the context can be terminated once every subscriber has stopped.
    """

    _registry: dict[int, _SubscriberLoop] = {}
    _registry_lock = threading.Lock()

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._requests: list[tuple[bool, TableSubscriber, threading.Event]] = []
        self._requests_lock = threading.Lock()
        address = f"inproc://prism-table-subscribers-{id(self)}"
        self._wake_in = ctx.socket(zmq.PAIR)
        self._wake_in.bind(address)
        self._wake_out = ctx.socket(zmq.PAIR)
        self._wake_out.connect(address)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="prism-table-subscribers", daemon=True)
        self._thread.start()

    @classmethod
    def submit(cls, ctx: zmq.Context, subscriber: TableSubscriber, add: bool) -> threading.Event:
        """Ask the context's loop (started if needed) to add or remove `subscriber`; set when done."""
        done = threading.Event()
        with cls._registry_lock:
            loop = cls._registry.get(id(ctx))
            if loop is None:
                if not add:
                    done.set()
                    return done
                loop = cls._registry[id(ctx)] = _SubscriberLoop(ctx)
            with loop._requests_lock:
                loop._requests.append((add, subscriber, done))
            with loop._wake_lock:
                loop._wake_out.send(b"", flags=zmq.NOBLOCK)
        return done

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        owners: dict[zmq.Socket, TableSubscriber] = {}
        subscribers: list[TableSubscriber] = []
        while True:
            now = time.monotonic()
            due = min((s.due() for s in subscribers), default=math.inf)
            timeout = max(0.0, min(due - now, _LOOP_IDLE_S)) * 1000
            ready = [sock for sock, _ in poller.poll(timeout=timeout)]
            if self._wake_in in ready:
                while self._wake_in.poll(0):
                    self._wake_in.recv()
                if not self._apply_requests(poller, owners, subscribers):
                    return
            now = time.monotonic()
            for subscriber in subscribers:
                try:
                    subscriber.tick(now)
                except Exception:  # one subscriber's failure must not stop the others
                    _log.exception("asking for a routing-table snapshot failed; asking again later")
            for sock in ready:
                owner = owners.get(sock)
                if owner is not None:
                    try:
                        owner.readable(sock)
                    except Exception:  # one subscriber's failure must not stop the others
                        _log.exception("receiving routing tables failed; the subscriber goes on")

    def _apply_requests(
        self, poller: zmq.Poller, owners: dict[zmq.Socket, TableSubscriber], subscribers: list[TableSubscriber]
    ) -> bool:
        """Open or close subscribers as asked; False (everything closed) when the last one has gone."""
        with self._requests_lock:
            requests, self._requests = self._requests, []
        finished: list[threading.Event] = []
        for add, subscriber, done in requests:
            if add:
                for sock in subscriber.open():
                    owners[sock] = subscriber
                    poller.register(sock, zmq.POLLIN)
                subscribers.append(subscriber)
                done.set()
            else:
                if subscriber in subscribers:
                    subscribers.remove(subscriber)
                    for sock in [k for k, v in owners.items() if v is subscriber]:
                        poller.unregister(sock)
                        del owners[sock]
                    subscriber.close()
                finished.append(done)
        if not subscribers:
            with self._registry_lock, self._requests_lock:
                if not self._requests:  # nobody is waiting to join: end, closing everything of ours
                    del self._registry[id(self._ctx)]
                    self._wake_in.close(linger=0)
                    self._wake_out.close(linger=0)
                    for done in finished:
                        done.set()
                    return False
        for done in finished:
            done.set()
        return True


class TableSubscriber:
    """Router side of the clone pattern: subscribes to every brain, asks each for a snapshot at start until it
    answers (and all again whenever a heartbeat shows a newer table than ours), and hands each newer table
    to `on_table`.
    Tables are ordered by (epoch, version), so with two brains the router follows the highest; a table
    counts as received only when `on_table` returns True. Its sockets live on its context's `_SubscriberLoop`
    thread, which also calls `on_table`."""

    def __init__(
        self,
        ctx: zmq.Context,
        brains: Sequence[BrainAddress],
        on_table: Callable[[RoutingTable], bool],
        rejects: RejectCounter,
        *,
        curve: ClientCurve | None = None,
        snapshot_retry_s: float = 0.25,
    ) -> None:
        if not brains:
            raise ValueError("at least one brain address is needed")
        self._ctx = ctx
        self._brains = list(brains)
        self._on_table = on_table
        self._rejects = rejects
        self._curve = curve
        self._retry_s = snapshot_retry_s
        self._started = False
        self._sockets: list[zmq.Socket] = []
        self._dealers: list[zmq.Socket] = []
        self._unanswered: set[zmq.Socket] = set()  # brains asked for a snapshot that have not answered yet
        self._next_request = 0.0
        self.current_order: tuple[int, int] = (-1, -1)
        self.last_heard_monotonic: float | None = None

    def start(self) -> None:
        if self._started:
            raise RuntimeError("the subscriber is already started")
        self._started = True
        _SubscriberLoop.submit(self._ctx, self, add=True).wait()

    def stop(self) -> None:
        if self._started:
            self._started = False
            _SubscriberLoop.submit(self._ctx, self, add=False).wait(timeout=5)

    # --- on the loop's thread -----------------------------------------------------------------------------

    def _make(self, kind: int, max_bytes: int) -> zmq.Socket:
        return _socket(self._ctx, kind, hwm=1000, max_bytes=max_bytes, curve=self._curve)

    def open(self) -> list[zmq.Socket]:
        """Create and connect the sockets; the ones to poll."""
        sub = self._make(zmq.SUB, MAX_TABLE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, b"prism.")
        self._dealers = []
        for _ in self._brains:
            dealer = self._make(zmq.DEALER, MAX_TABLE_BYTES)
            dealer.sndhwm = 1
            dealer.setsockopt(zmq.IMMEDIATE, 1)
            self._dealers.append(dealer)
        for brain, dealer in zip(self._brains, self._dealers, strict=True):
            sub.connect(brain.updates)
            dealer.connect(brain.snapshot)
        self._sockets = [sub, *self._dealers]
        self._unanswered = set(self._dealers)
        self._next_request = 0.0
        return self._sockets

    def due(self) -> float:
        """When `tick` next has something to do (inf: nothing until a message comes)."""
        return self._next_request if self._unanswered else math.inf

    def tick(self, now: float) -> None:
        """Ask the brains that have not answered for a snapshot, every `snapshot_retry_s`."""
        if not self._unanswered or now < self._next_request:
            return
        for dealer in self._unanswered:
            try:
                dealer.send_multipart(encode(SnapshotRequest()), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
        self._next_request = now + self._retry_s

    def readable(self, sock: zmq.Socket) -> None:
        self._unanswered.discard(sock)
        if self._receive(sock):
            self._unanswered = set(self._dealers)
            self._next_request = 0.0

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets, self._dealers, self._unanswered = [], [], set()

    def _receive(self, sock: zmq.Socket) -> bool:
        """Handle every waiting message on `sock`; True when a heartbeat shows we are behind."""
        behind = False
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return behind
            try:
                msg = decode(frames, (RoutingTable, Heartbeat), MAX_TABLE_BYTES)
            except WireError as exc:
                self._rejects.record(exc)
                continue
            self.last_heard_monotonic = time.monotonic()
            order = (msg.epoch, msg.version)
            if order <= self.current_order:
                continue
            if isinstance(msg, Heartbeat):
                behind = True
            elif self._deliver(msg):
                self.current_order = order

    def _deliver(self, table: RoutingTable) -> bool:
        """Hand `table` to the callback; a callback failure is logged and the table not taken."""
        try:
            return self._on_table(table)
        except Exception:
            _log.exception("routing table %d.%d was not applied", table.epoch, table.version)
            return False
