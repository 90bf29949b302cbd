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

from ._codec import MAX_TABLE_BYTES, MAX_VECTOR_BYTES, decode, encode, topic_prefix
from ._curve import ClientCurve, ServerCurve
from ._exceptions import WireError
from ._kv import KvApply, KvFollower
from ._messages import (
    MAX_REPORT_BYTES,
    ClusterLoad,
    Heartbeat,
    KvBlocks,
    KvDelta,
    KvSnapshotEnd,
    NodeVector,
    RouterLoad,
    RoutingTable,
    SliceUpdate,
    SnapshotRequest,
    TableHead,
)
from ._rejects import RejectCounter
from ._tables import TableAssembler, TableEncoder

_log = logging.getLogger("prism.wire")
_LOOP_IDLE_S = 0.5  # the subscriber loop wakes at least this often
LOAD_REFRESH_S = 0.5
"""A router's load report goes at least this often, changed or not, so that the brain keeps it in its sums."""
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

    def send(self, vector: NodeVector | KvBlocks) -> bool:
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

    def check_node(self, node_id: str, user_id: str | None) -> object:
        """Raise a `WireError` when a message about `node_id` (its KV blocks) may not come from `user_id`."""


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

    def drain(self, limit: int = DRAIN_LIMIT, *, kv: list[KvBlocks] | None = None) -> list[NodeVector]:
        """Every vector waiting now, up to `limit` messages; never blocks. With `kv`, agents' `KvBlocks` are
        taken too (appended to it, in arrival order; they count towards `limit`); without, they are rejected
        as an unexpected kind, as before there were any."""
        out: list[NodeVector] = []
        expect: tuple[type, ...] = (NodeVector,) if kv is None else (NodeVector, KvBlocks)
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
                message = decode(frames, expect, MAX_VECTOR_BYTES)
                if identity is not None:
                    if isinstance(message, NodeVector):
                        identity.check(message, user_id, peer_address)
                    else:
                        identity.check_node(message.node_id, user_id)
            except WireError as exc:
                self._rejects.record(exc)
                continue
            if isinstance(message, NodeVector):
                out.append(message)
            elif kv is not None:
                kv.append(message)
        else:
            self.backlog += 1
        return out

    def close(self) -> None:
        self.socket.close()


class TablePublisher:
    """Brain side of the clone pattern: PUB for slice updates, table heads, heartbeats and KV deltas; ROUTER for
    snapshots (`_tables.TableEncoder` makes the table's messages; `kv_snapshot`, when set, the KV index's)."""

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
            sock = _socket(ctx, zmq.ROUTER, hwm=1000, max_bytes=MAX_REPORT_BYTES, curve=curve)
            self.snapshot_socket = _attach(sock, snapshot, bind=True)
        except BaseException:
            self._pub.close()
            raise
        self._rejects = rejects
        self._encoder = TableEncoder()
        self.current: RoutingTable | None = None
        self.kv_snapshot: Callable[[], list[list[bytes]]] | None = None
        """The KV index as snapshot messages (`KvRelay.snapshot`), for requests with `kv`; None: not served."""
        self.on_router_load: Callable[[RouterLoad], None] | None = None
        """Takes the routers' `RouterLoad` reports, which come on the snapshot socket; None: they are ignored."""
        self.snapshots_served = 0
        self.snapshots_dropped = 0
        self.bytes_published = 0

    def publish(self, table: RoutingTable) -> None:
        """Send what changed since the last table to every subscriber; raises `WireError` (or ValueError) for a
        table routers would reject, and then nothing is sent."""
        messages = self._encoder.update(table)
        self.current = table
        for frames in messages:
            self._pub.send_multipart(frames)
            self.bytes_published += sum(len(f) for f in frames)

    def publish_kv(self, deltas: Sequence[KvDelta]) -> None:
        """Send KV deltas on their own topic; a subscriber whose queue is full loses them (and sees the gap)."""
        for delta in deltas:
            frames = encode(delta)
            self._pub.send_multipart(frames)
            self.bytes_published += sum(len(f) for f in frames)

    def publish_load(self, load: ClusterLoad) -> None:
        """Send the routers' summed queued prefill work on its own topic."""
        frames = encode(load)
        self._pub.send_multipart(frames)
        self.bytes_published += sum(len(f) for f in frames)

    def heartbeat(self) -> None:
        if self.current is not None:
            current = self.current
            hb = Heartbeat(
                epoch=current.epoch,
                version=current.version,
                issued_unix_s=time.time(),
                brain_id=current.brain_id,
                priority=current.priority,
            )
            self._pub.send_multipart(encode(hb))

    def serve_snapshots(self) -> None:
        """Answer every waiting snapshot request with the current table's state, and hand routers' load reports
        to `on_router_load`; never blocks (a reply that does not fit the router's queue is cut short and counted:
        the router asks again)."""
        while True:
            try:
                frames = self.snapshot_socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                request = decode(body, (SnapshotRequest, RouterLoad), MAX_REPORT_BYTES)
            except WireError as exc:
                self._rejects.record(exc)
                continue
            if isinstance(request, RouterLoad):
                if self.on_router_load is not None:
                    self.on_router_load(request)
                continue
            if request.kv:
                messages = self.kv_snapshot() if self.kv_snapshot is not None else []
            else:
                messages = self._encoder.snapshot(request.slices)
            if not messages:
                continue
            try:
                for message in messages:
                    self.snapshot_socket.send_multipart([identity, *message], flags=zmq.NOBLOCK)
                self.snapshots_served += 1
            except zmq.Again:
                self.snapshots_dropped += 1

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


@dataclass
class BrainView:
    """What a router knows of one brain: when it was last heard, the order it last announced, and its latest
    whole table."""

    brain_id: str
    priority: int = 0
    last_heard: float = -math.inf
    announced: tuple[int, int] = (-1, -1)
    latest: RoutingTable | None = None
    restarted: bool = False
    assembler: TableAssembler | None = None

    def live(self, now: float, timeout_s: float) -> bool:
        return now - self.last_heard <= timeout_s


class TableSubscriber:
    """Router side of the clone pattern, over one or more brains.

    Every brain's slice updates and heads are assembled into whole tables (`_tables.TableAssembler`), so
    the router holds each brain's latest table. It follows one brain, the leader: of the brains heard within
    `brain_timeout_s` (heartbeats come every second), the one with the highest (priority, brain_id). When
    the leader goes silent the next live brain leads and its latest table is handed over at once; when a
    brain's announced (epoch, version) goes back, it restarted without its state, and its tables are taken
    again from the first. Within one brain, tables are handed on in increasing (epoch, version) only.

    At start, and whenever a heartbeat shows a brain ahead of what we assembled from it or a head cannot be
    completed, the brains are asked for a snapshot until they answer. A table counts as received only when
    `on_table` returns True. Sockets live on the context's `_SubscriberLoop` thread, which also calls
    `on_table`. `slices` names the slices to follow (None: all): only their updates are received.

    With `on_kv`, the brains' KV deltas are received too (their topic is subscribed to only then) and those of the
    brain followed are handed to `on_kv` in order by a `_kv.KvFollower`: at the first table, whenever the router
    goes over to another brain and when a delta is missing, the followed brain is asked for a KV snapshot, every
    `kv_snapshot_retry_s` until it answers; tables never wait for it.

    With `load_report`, the router's queued prefill work goes to every brain (on the snapshot dealers) every
    `load_report_s` while it changes and every `LOAD_REFRESH_S` regardless; the followed brain's `ClusterLoad`
    sums are handed to `on_load` (their topic is subscribed to only then).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        brains: Sequence[BrainAddress],
        on_table: Callable[[RoutingTable], bool],
        rejects: RejectCounter,
        *,
        curve: ClientCurve | None = None,
        snapshot_retry_s: float = 0.25,
        brain_timeout_s: float = 3.0,
        slices: Sequence[str] | None = None,
        on_kv: KvApply | None = None,
        kv_snapshot_retry_s: float = 1.0,
        load_report: Callable[[bool], RouterLoad | None] | None = None,
        on_load: Callable[[ClusterLoad], None] | None = None,
        load_report_s: float = 0.02,
    ) -> None:
        if not brains:
            raise ValueError("at least one brain address is needed")
        if not brain_timeout_s > 0:
            raise ValueError(f"brain_timeout_s must be positive, got {brain_timeout_s}")
        self._ctx = ctx
        self._brains = list(brains)
        self._on_table = on_table
        self._rejects = rejects
        self._curve = curve
        self._retry_s = snapshot_retry_s
        self.brain_timeout_s = brain_timeout_s
        self.slices = None if slices is None else tuple(slices)
        self._started = False
        self._sockets: list[zmq.Socket] = []
        self._dealers: list[zmq.Socket] = []
        self._unanswered: set[zmq.Socket] = set()  # brains asked for a snapshot that have not answered yet
        self._next_request = 0.0
        self._views: dict[str, BrainView] = {}
        self.following: str | None = None
        """The brain whose table was handed on last."""
        self.current_order: tuple[int, int] = (-1, -1)
        self.switches = 0
        """Times the router went over to another brain's tables."""
        self.kv = KvFollower(on_kv) if on_kv is not None else None
        """The KV stream's state and counters (None: not received)."""
        self._kv_retry_s = kv_snapshot_retry_s
        self._kv_next_request = 0.0
        self._dealer_of: dict[str, zmq.Socket] = {}  # brain id -> the dealer its table snapshot came on
        self._kinds: tuple[type, ...] = (SliceUpdate, TableHead, Heartbeat)
        if self.kv is not None:
            self._kinds += (KvDelta, KvSnapshotEnd)
        self._load_report = load_report
        self._on_load = on_load
        self._load_report_s = load_report_s
        self._next_report = 0.0
        self._next_refresh = 0.0
        self.load_reports_sent = 0
        if on_load is not None:
            self._kinds += (ClusterLoad,)

    def start(self) -> None:
        if self._started:
            raise RuntimeError("the subscriber is already started")
        self._started = True
        _SubscriberLoop.submit(self._ctx, self, add=True).wait()

    def stop(self) -> None:
        if self._started:
            self._started = False
            _SubscriberLoop.submit(self._ctx, self, add=False).wait(timeout=5)

    @property
    def last_heard_monotonic(self) -> float | None:
        """When the brain followed now was last heard (any brain, before one is followed); None: never."""
        view = self._views.get(self.following) if self.following is not None else None
        if view is not None:
            return view.last_heard
        heard = [v.last_heard for v in dict(self._views).values()]  # a copy: the loop thread may add a brain
        return max(heard) if heard else None

    def brains(self, now: float | None = None) -> dict[str, dict[str, object]]:
        """Each brain heard so far: seconds since it was last heard, whether it is live and followed, and the
        (epoch, version) of its latest table."""
        now = time.monotonic() if now is None else now
        return {
            brain_id: {
                "age_s": now - view.last_heard,
                "live": view.live(now, self.brain_timeout_s),
                "following": brain_id == self.following,
                "priority": view.priority,
                "order": None if view.latest is None else view.latest.order,
            }
            for brain_id, view in sorted(dict(self._views).items())
        }

    # --- on the loop's thread -----------------------------------------------------------------------------

    def _make(self, kind: int, max_bytes: int) -> zmq.Socket:
        return _socket(self._ctx, kind, hwm=1000, max_bytes=max_bytes, curve=self._curve)

    def open(self) -> list[zmq.Socket]:
        """Create and connect the sockets; the ones to poll."""
        sub = self._make(zmq.SUB, MAX_TABLE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, topic_prefix(Heartbeat))
        sub.setsockopt(zmq.SUBSCRIBE, topic_prefix(TableHead))
        for name in self.slices if self.slices is not None else (None,):
            sub.setsockopt(zmq.SUBSCRIBE, topic_prefix(SliceUpdate, name))
        if self.kv is not None:
            sub.setsockopt(zmq.SUBSCRIBE, topic_prefix(KvDelta))
        if self._on_load is not None:
            sub.setsockopt(zmq.SUBSCRIBE, topic_prefix(ClusterLoad))
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
        self._ask_all()
        return self._sockets

    def _ask_all(self) -> None:
        self._unanswered = set(self._dealers)
        self._next_request = 0.0

    def due(self) -> float:
        """When `tick` next has something to do: a snapshot request, or a liveness check of the leader."""
        check = math.inf
        if self.following is not None:
            check = self._views[self.following].last_heard + self.brain_timeout_s
            if check <= time.monotonic():  # already silent: the loop's idle wake-up checks again
                check = math.inf
        kv = self._kv_next_request if self._kv_dealer() is not None else math.inf
        report = self._next_report if self._load_report is not None else math.inf
        return min(self._next_request if self._unanswered else math.inf, check, kv, report)

    def _kv_dealer(self) -> zmq.Socket | None:
        """The dealer to ask for a KV snapshot now, if one is wanted and the followed brain's dealer is known."""
        if self.kv is None or not self.kv.wants_snapshot or self.kv.brain_id is None:
            return None
        return self._dealer_of.get(self.kv.brain_id)

    def tick(self, now: float) -> None:
        """Follow the leader if it changed (a brain died), send the router's load report when due, and ask the
        brains that have not answered for a snapshot, every `snapshot_retry_s`."""
        self._follow(now)
        if self._load_report is not None and now >= self._next_report:
            self._send_load(now)
        dealer = self._kv_dealer()
        if dealer is not None and now >= self._kv_next_request:
            try:
                dealer.send_multipart(encode(SnapshotRequest(kv=True)), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            self._kv_next_request = now + self._kv_retry_s
        if not self._unanswered or now < self._next_request:
            return
        request = encode(SnapshotRequest(slices=None if self.slices is None else list(self.slices)))
        for dealer in self._unanswered:
            try:
                dealer.send_multipart(request, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
        self._next_request = now + self._retry_s

    def _send_load(self, now: float) -> None:
        """The router's report to every brain, if it changed or a refresh is due; a dealer not connected yet or
        full drops it (the next report replaces it anyway), and a report no brain took is sent again next time."""
        assert self._load_report is not None
        self._next_report = now + self._load_report_s
        report = self._load_report(now >= self._next_refresh)
        if report is None:
            return
        frames = encode(report)
        for dealer in self._dealers:
            try:
                dealer.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                continue
            self.load_reports_sent += 1
            self._next_refresh = now + LOAD_REFRESH_S

    def readable(self, sock: zmq.Socket) -> None:
        wanted = self.kv is not None and self.kv.wants_snapshot
        if self._receive(sock):
            self._ask_all()
        self._follow(time.monotonic())
        if self.kv is not None and self.kv.wants_snapshot and not wanted:
            self._kv_next_request = 0.0  # a gap just found: ask at once

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets, self._dealers, self._unanswered, self._dealer_of = [], [], set(), {}

    def _view(self, brain_id: str, priority: int, now: float) -> BrainView:
        view = self._views.get(brain_id)
        if view is None:
            view = self._views[brain_id] = BrainView(brain_id, assembler=TableAssembler(self.slices))
            _log.info("brain %s heard (priority %d)", brain_id or "(unnamed)", priority)
        view.priority = priority
        view.last_heard = now
        return view

    def _announce(self, view: BrainView, order: tuple[int, int]) -> None:
        """A brain's heartbeat or head on the update stream says it is at `order`; lower than before means it
        restarted. Snapshot answers do not announce: the stream is in order, they are not. One asked for before a
        newer table was published can be read after it (a false restart would take the router back to the older
        table), and one answered before a restart can be read after it (ahead of all the stream now says: it is
        dropped, and a later heartbeat asks again if the router is behind)."""
        if order < view.announced:
            _log.warning(
                "brain %s went back from %d.%d to %d.%d: restarted without its state; following its new tables",
                view.brain_id or "(unnamed)",
                *view.announced,
                *order,
            )
            view.restarted, view.latest = True, None
            if view.assembler is not None:
                view.assembler.forget_after(order)
        view.announced = order

    def _receive(self, sock: zmq.Socket) -> bool:
        """Handle every waiting message on `sock`; True when a snapshot is needed (a brain is ahead of what
        we hold from it, or a head could not be completed). A dealer counts as answered when a table message
        comes on it (a KV snapshot's are not the table's answer)."""
        behind = False
        dealer = sock is not self._sockets[0]
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return behind
            try:
                msg = decode(frames, self._kinds, MAX_TABLE_BYTES)
            except WireError as exc:
                self._rejects.record(exc)
                continue
            if isinstance(msg, KvDelta | KvSnapshotEnd):
                self._receive_kv(msg, dealer)
                continue
            if isinstance(msg, ClusterLoad):
                if self._on_load is not None and msg.brain_id == self.following:
                    self._on_load(msg)
                continue
            if dealer:
                self._unanswered.discard(sock)
                self._dealer_of[msg.brain_id] = sock
            now = time.monotonic()
            if isinstance(msg, SliceUpdate):
                view = self._views.get(msg.brain_id)
                if view is None:
                    view = self._view(msg.brain_id, 0, now)
                assert view.assembler is not None
                view.assembler.slice_update(msg, snapshot=dealer)
                continue
            view = self._view(msg.brain_id, msg.priority, now)
            if not dealer:
                self._announce(view, msg.order)
            elif (-1, -1) < view.announced < msg.order:  # ahead of the stream: sent before the brain restarted
                continue
            held = (-1, -1) if view.latest is None else view.latest.order
            if isinstance(msg, Heartbeat):
                behind = behind or msg.order > held
                continue
            assert view.assembler is not None
            table = view.assembler.head(msg)
            if table is None:
                behind = True
            elif table.order > held:
                view.latest = table

    def _receive_kv(self, msg: KvDelta | KvSnapshotEnd, from_dealer: bool) -> None:
        """A KV delta (live on the PUB socket, or a snapshot's part on a dealer) or a snapshot's end."""
        kv = self.kv
        assert kv is not None
        if isinstance(msg, KvSnapshotEnd):
            if from_dealer:
                kv.snapshot_end(msg)
        elif from_dealer:
            kv.snapshot_part(msg)
        else:
            kv.delta(msg)

    def _leader(self, now: float) -> BrainView | None:
        live = [v for v in self._views.values() if v.live(now, self.brain_timeout_s) and v.latest is not None]
        return max(live, key=lambda v: (v.priority, v.brain_id), default=None)

    def _follow(self, now: float) -> None:
        """Hand the leader's latest table on, if it is newer than what was handed on (or from another brain)."""
        leader = self._leader(now)
        if leader is None or leader.latest is None:
            return
        table = leader.latest
        switching = leader.brain_id != self.following
        if not switching and not leader.restarted and table.order <= self.current_order:
            return
        if self._deliver(table):
            if switching and self.following is not None:
                self.switches += 1
                _log.warning(
                    "brain %s silent for %.1f s or outranked: following brain %s (table %d.%d)",
                    self.following or "(unnamed)",
                    now - self._views[self.following].last_heard,
                    leader.brain_id or "(unnamed)",
                    *table.order,
                )
            self.following = leader.brain_id
            leader.restarted = False
            self.current_order = table.order
            if self.kv is not None:
                self.kv.follow(leader.brain_id)

    def _deliver(self, table: RoutingTable) -> bool:
        """Hand `table` to the callback; a callback failure is logged and the table not taken."""
        try:
            return self._on_table(table)
        except Exception:
            _log.exception("routing table %d.%d was not applied", table.epoch, table.version)
            return False
