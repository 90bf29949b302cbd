"""The embedded router: follows the brain's routing tables and places each request locally."""

from __future__ import annotations

import collections
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Self, TypeVar

import zmq
from prometheus_client import CollectorRegistry

from prismlb.semantics import SLO_SCALE, Slice, ttft_slo_s
from prismlb.wire import (
    MAX_PLACED_BLOCKS,
    MAX_ROOM_HEADS,
    MAX_ROUTER_LOAD_NODES,
    BrainAddress,
    ClientCurve,
    ClusterLoad,
    ConfigError,
    InvalidFieldError,
    NoRouteError,
    Placed,
    RejectCounter,
    RoomHead,
    RouterLoad,
    RoutingTable,
    TableSubscriber,
)

from ._attempts import Attempts
from ._errors import ShedError
from ._health import EndpointState, EndpointStatus
from ._index import PrefixIndex
from ._keys import position
from ._lease import Lease
from ._memory import PrefixMemory
from ._metrics import RoundTrips, RouterCollector
from ._request import CONTEXT_HEADER, SESSION_HEADER, Key, Request, slice_of
from ._sessions import Session, SessionTable
from ._settings import Settings
from ._snapshot import Endpoint, Group, InFlight, SliceRoute, Snapshot, build
from ._turns import Ticket, Turns

_log = logging.getLogger("prism.router")
ECHO_ALPHA = 0.1
"""Weight of the newest sums in the averages of this router's and its peers' queued work behind `echo`
(`Router.apply_cluster_load`): about the last ten sums that had any, a second or two of a busy cluster."""
_M64 = 0xFFFF_FFFF_FFFF_FFFF
_BARE_KEYS = (str, bytes, int)
"""The exact types `route()` takes as a bare affinity key without building a Request (a subclass builds one)."""
MAX_PENDING_PLACED = 4096
"""Placements a router holds for its next load report; past it the oldest go unreported (peers then learn of
those prompts from the engines' KV events alone)."""

T = TypeVar("T")


def _check_config(
    ctx: zmq.Context[zmq.Socket[bytes]], brains: Sequence[BrainAddress], curve: ClientCurve | None
) -> None:
    """Fail in the caller's thread on what would otherwise silently stop the subscriber's thread."""
    probe = ctx.socket(zmq.DEALER)
    try:
        if curve is not None:
            curve.apply(probe)
        for endpoint in (e for brain in brains for e in (brain.updates, brain.snapshot)):
            try:
                probe.connect(endpoint)
            except zmq.ZMQError as exc:
                raise ConfigError(f"cannot use brain endpoint {endpoint!r}: {exc}") from None
    finally:
        probe.close(linger=0)


def describe(table: RoutingTable) -> str:
    return f"epoch {table.epoch} version {table.version}"


def _key_bytes(key: Key) -> bytes:
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, int):
        return (key & _M64).to_bytes(8, "big")
    return key


def _presumed(session: Session, request: Request, depths: dict[str, int]) -> dict[str, int]:
    """`depths` with a session's node taken to hold the blocks of the session's last prompt there (all but its last,
    which may have been partial, when only those match) that this turn's prompt begins with, for a turn in text
    blocks, which no KV event names (the index knows them only while the placements' claims last), where the index
    knows fewer."""
    held, blocks = session.blocks, request.blocks
    if not (held and len(blocks) >= held and blocks[held - 1] == session.last_block):
        held -= 1
        if not (held > 0 and len(blocks) >= held and blocks[held - 1] == session.before_last):
            return depths
    if held <= depths.get(session.node_id, 0):
        return depths
    return {**depths, session.node_id: held}


def _spread(expected: Mapping[int, tuple[float, float]], copies: int, draw: int) -> int:
    """One of the entries that `copies` requests like this one would fill, the least expected time first (a copy
    on an entry adds its own part there: `expected` holds (expected time, own part) per entry), picked by `draw`
    (32 bits: the prompt's hash). Routers placing a burst at the same moment from the same figures would otherwise
    all take the one least-loaded entry; with `copies` 1 it is that entry."""
    level = {i: ttft for i, (ttft, _) in expected.items()}
    for _ in range(draw * copies >> 32):
        i = min(level, key=level.__getitem__)
        level[i] += expected[i][1]
    return min(level, key=level.__getitem__)


PEER_TURN_ROOM = 0.5
"""Share of the room (`Settings.hold_tokens`) an entry must have left for a router to let its head go while a peer's
is due sooner (`Settings.share_turns`): the peer hears of the room only with the brain's next sums, tens of
milliseconds on, and an entry with less than half a room queued would run dry meanwhile. Measured against a quarter
and three quarters with four routers in the replay (docs/router.md)."""


def _urgency(ticket: Ticket, now: float) -> tuple[int, float]:
    """A waiting ticket's place in the rooms' order (smaller goes first), as `Room.head` orders them: (0, deadline) in
    time, (1, when it became late) once late; `RoomHead.urgency` is a peer's on the same scale."""
    return (1, ticket.late_at) if ticket.late_at < now else (0, ticket.deadline)


@dataclass(slots=True)
class Placement:
    """A request with block hashes being placed by expected time to first token: what the choice reads in each
    group it weighs (the arm's, then the slice's overflow entries), built once per placement and only read after.
    Not frozen: a frozen dataclass's constructor costs three times as much, on every placement with blocks."""

    request: Request
    key: Key | None
    """The affinity key (else the session), whose ring position orders each group's candidates."""
    depths: dict[str, int]
    """Leading blocks of the prompt each node holds, by node id (`PrefixIndex.match`); nodes holding none are absent."""
    exclude: Collection[str]
    """Entry labels the request must not go to, such as ones already tried."""
    now: float
    """The router's clock when the placement began."""
    held: tuple[Group, int] | None
    """The session's last entry while it is available (`_sticky`), weighed as the holder of the prompt's prefix."""


class Router:
    """Places requests on the newest routing table it has seen; with no brain it keeps the last one.

    Placement: the request's slice (named, or from its modality; an empty slice goes to its fallback), the
    experiment arm of its session; for a request with block hashes, the least expected time to first token over
    the prefix index, its prefix's holder (its session's endpoint, for a session) kept within the cache affinity;
    without them, its session's endpoint while that is available, else the first endpoint in the key's probe
    order on the weighted ring that is available and under the bounded-load limit.
    `route()` reads one immutable snapshot and never locks or does I/O; `request()` also counts the request
    in flight and reports its outcome. `Router()` starts empty and without network (feed it with `apply`);
    `Router.connect` follows one or more brains.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        settings: Settings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or Settings()
        self.clock = clock
        """Seconds on a monotonic clock for health, breakers, sessions and table age (a simulation passes its own)."""
        self.rejects = RejectCounter("router", _log, registry)
        self._snapshot: Snapshot | None = None
        self._apply_lock = threading.Lock()
        self._lock = threading.Lock()  # accounting: in-flight counts and endpoint health
        self._states: dict[str, EndpointState] = {}
        self._counters: dict[str, InFlight] = {}
        self._sessions = SessionTable(self.settings.session_ttl_s, self.settings.max_sessions)
        self._memory = (
            PrefixMemory(self.settings.prefix_memory)
            if self.settings.prefix_memory and self.settings.load == "prefill"
            else None
        )
        self.shares_load = self.settings.share_load and self.settings.load == "prefill"
        """Whether this router reports its queued prefill and placements and counts its peers' (`Settings.share_load`,
        with `load="prefill"`)."""
        self.router_id = uuid.uuid4().hex
        """This router's name in its load reports (new at every start: a restarted router is a new peer)."""
        self._load_seq = 0
        self._reported: dict[str, float] = {}  # the queued prefill per node in the last report sent
        self._peer_load: dict[str, float] = {}  # peers' queued prefill per node, from the brain's sums
        self._peer_at = -math.inf  # when `_peer_load` arrived
        self._echo = 0.0  # work peers are taken to place per unit this router places (`apply_cluster_load`)
        self._fresh: dict[str, float] = {}  # prefill units this router placed per node since the peers' sums arrived
        self._shares: tuple[float, float] | None = None  # averages of this router's and its peers' queued work
        self._reported_heads: dict[str, tuple[float, float, bool]] = {}  # per slice, the head last reported (`_heads`)
        self._peer_heads: dict[str, tuple[int, float]] = {}  # per slice, the most urgent peer's head (`_urgency`)
        self._placed_out: collections.deque[tuple[str, Sequence[int]]] = collections.deque(maxlen=MAX_PENDING_PLACED)
        """Placements not reported yet: (node, blocks the node did not hold), appended by any caller's thread."""
        self.holds = self.settings.hold_tokens > 0 and self.settings.load == "prefill"
        """Whether requests wait for their turn (`Settings.hold_tokens`, with `load="prefill"`)."""
        self.turns = Turns()
        """The waiting room (`turn`), read under the accounting lock."""
        self.index = PrefixIndex(self.settings.placed_ttl_s)
        """Which nodes cache which prompt blocks: fed by the cluster's KV events (the brain's stream, or the
        caller's own feed) and by this router's placements; read by the expected-TTFT choice."""
        self._reporting: set[str] = set()
        """Nodes whose engines' KV events reach this router (`apply_kv`): the index knows what they cache."""
        self._kv_block_sizes: dict[str, int] = {}
        """The block size, in tokens, of each node's KV events (`apply_kv`)."""
        self.kv_block_size_mismatches: dict[str, int] = {}
        """Requests placed on a node whose KV events name blocks of another size than the request's hashes, by node:
        the prefix index can never match them (an engine's block or page size unlike the callers')."""
        self.round_trips = RoundTrips()
        """The engines' `/tokenize` round trips made for this router's text requests (`EngineTokenizer`)."""
        self._has_table = threading.Event()
        self._drop_refused: tuple[tuple[str, int, int], float] | None = None  # (table, first refused at)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._subscriber: TableSubscriber | None = None
        self._closed = False
        if registry is not None:
            registry.register(RouterCollector(self))

    @classmethod
    def from_table(
        cls,
        table: RoutingTable,
        *,
        settings: Settings | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> Self:
        """A router fixed on `table`, with no network; ValueError when the table cannot be routed on."""
        router = cls(settings=settings, clock=clock, registry=registry)
        router.apply(table)
        return router

    @classmethod
    def connect(
        cls,
        brains: BrainAddress | Sequence[BrainAddress],
        *,
        curve: ClientCurve | None = None,
        registry: CollectorRegistry | None = None,
        settings: Settings | None = None,
        slices: Sequence[str] | None = None,
        brain_timeout_s: float = 3.0,
    ) -> Self:
        """Subscribe to the brains' tables (asking for a snapshot first) in a background thread.

        With several brains the router follows the live one of highest (priority, brain id) and goes over to
        the next within `brain_timeout_s` of the leader's last heartbeat (`wire.TableSubscriber`). `slices`
        names the slices this caller routes to, fallbacks included (None: all): only their entries are
        received and kept, which is what lets a router in a large fleet hold the part of the table it uses.
        With `Settings.prefix_index` (the default) the brains' KV deltas are followed too and fill `index`
        (`apply_kv`); placement never waits for them. With `Settings.share_load` (the default) the router reports
        its queued prefill and placements to the brains and counts its peers' (`load_report`,
        `apply_cluster_load`). Raises ConfigError at once for an unusable CURVE key file or a malformed endpoint.
        """
        addresses = [brains] if isinstance(brains, BrainAddress) else list(brains)
        if not addresses:
            raise ValueError("at least one brain address is needed")
        ctx = zmq.Context()
        try:
            _check_config(ctx, addresses, curve)
        except BaseException:
            ctx.term()
            raise
        router = cls(registry=registry, settings=settings)
        router._ctx = ctx
        router._subscriber = TableSubscriber(
            ctx,
            addresses,
            router._on_table,
            router.rejects,
            curve=curve,
            slices=slices,
            brain_timeout_s=brain_timeout_s,
            on_kv=router.apply_kv if router.settings.prefix_index else None,
            load_report=router.load_report if router.shares_load else None,
            on_load=router._on_cluster_load if router.shares_load else None,
            load_report_s=router.settings.load_report_s,
        )
        router._subscriber.start()
        _log.info("following routing tables from %s", ", ".join(a.updates for a in addresses))
        return router

    # --- tables -------------------------------------------------------------------------------------------

    def apply(self, table: RoutingTable, *, replace: bool = False, guard: bool = False) -> bool:
        """Make `table` current if its (epoch, version) is newer (any table with `replace`, which the
        subscriber uses when it goes over to another brain or to a restarted one); False when it is not, or,
        with `guard` (tables from brains), when it drops too many nodes at once (`Settings.max_drop_share`,
        counted as a `mass_drop` reject).

        Raises ValueError (and keeps the current table) when `table` cannot be routed on.
        """
        current = self._snapshot
        if current is not None and not replace and table.order <= current.table.order:
            return False
        with self._apply_lock:
            current = self._snapshot
            if current is not None and not replace and table.order <= current.table.order:
                return False
            if guard and current is not None and not self._drop_allowed(current.table, table):
                return False
            used_states: set[str] = set()
            used_counters: set[str] = set()

            def state_for(label: str) -> EndpointState:
                used_states.add(label)
                state = self._states.get(label)
                if state is None:
                    state = self._states[label] = EndpointState(label, self.settings, self._peer_states)
                return state

            def counter_for(name: str) -> InFlight:
                used_counters.add(name)
                counter = self._counters.get(name)
                if counter is None:
                    counter = self._counters[name] = InFlight()
                return counter

            snapshot = build(table, self.settings, state_for, counter_for, self.clock(), previous=current)
            self._snapshot = snapshot
            # State of entries and groups no table lists any more goes; a lease still out keeps its own reference.
            self._states = {label: s for label, s in self._states.items() if label in used_states}
            self._counters = {name: c for name, c in self._counters.items() if name in used_counters}
        self._has_table.set()
        self._wake()
        first_of_epoch = current is None or current.table.epoch != table.epoch
        _log.log(
            logging.INFO if first_of_epoch else logging.DEBUG,
            "routing on table %s (%d slices)",
            describe(table),
            len(table.slices),
        )
        if current is None or current.shed != snapshot.shed or current.table.guardian != table.guardian:
            shed = ", ".join(sorted(snapshot.shed)) or "none"
            _log.info("guardian %s: request classes shed: %s", table.guardian, shed)
        return True

    def _drop_allowed(self, current: RoutingTable, table: RoutingTable) -> bool:
        """False while `table` drops more than `max_drop_share` of the current table's nodes, not counting
        the ones the brain says were drained, unless such tables have kept coming for `drop_hold_s`: a brain
        that lost its agents (a restart, a partition) must not empty the routers, while a real loss of many
        nodes is taken once it has lasted (passive health keeps requests off dead nodes meanwhile)."""
        share = self.settings.max_drop_share
        before = {node.node_id for s in current.slices for node in s.nodes}
        if share >= 1.0 or not before:
            return True
        after = {node.node_id for s in table.slices for node in s.nodes}
        dropped = len(before - after - set(table.drained))
        if dropped <= share * len(before):
            self._drop_refused = None
            return True
        now = self.clock()
        key = (table.brain_id, table.epoch, table.version)
        last_key, since = self._drop_refused if self._drop_refused is not None else (None, now)
        if now - since >= self.settings.drop_hold_s:
            _log.warning(
                "table %s drops %d of %d nodes; taken after %.0f s of such tables",
                describe(table),
                dropped,
                len(before),
                now - since,
            )
            self._drop_refused = None
            return True
        if key != last_key:  # counted once per table, however often it is offered
            self.rejects.count(
                "mass_drop",
                f"table {describe(table)} drops {dropped} of {len(before)} nodes at once; the current table is kept "
                f"until such tables have come for {self.settings.drop_hold_s:g} s",
            )
        self._drop_refused = (key, since)
        return False

    def apply_kv(
        self, node_id: str, reset: bool, stored: Sequence[int], removed: Sequence[int], block_size: int | None = None
    ) -> None:
        """One node's prefix-cache change from the cluster's KV stream: with `reset`, its whole set is `stored`
        (empty: unknown or gone); else `removed` leave it, then `stored` join it. `block_size`: the tokens per block
        of the node's KV events, which requests placed there are checked against (`kv_block_size_mismatches`)."""
        if block_size is not None:
            self._kv_block_sizes[node_id] = block_size
        if reset:
            self.index.reset(node_id, stored)
            if stored:
                self._reporting.add(node_id)
            else:
                self._reporting.discard(node_id)
            return
        self._reporting.add(node_id)
        if removed:
            self.index.removed(node_id, removed)
        if stored:
            self.index.stored(node_id, stored)

    # --- queued prefill shared with peer routers ------------------------------------------------------------

    def load_report(self, force: bool = False) -> RouterLoad | None:
        """A report for the brain: this router's queued prefill work per node (prompt tokens sent there without a
        first token yet) and the placements made since the last report; None when neither changed, unless
        `force`. A router loading more than `MAX_ROUTER_LOAD_NODES` nodes reports its heaviest; placements go in
        up to `MAX_PLACED_BLOCKS` hashes per report (the rest wait for the next)."""
        loads: dict[str, float] = {}
        for label, state in self._states.items():
            if state.load > 0:
                node_id = label.partition("/")[0]  # a per-GPU entry's label is node/gpuN
                loads[node_id] = loads.get(node_id, 0.0) + state.load
        if len(loads) > MAX_ROUTER_LOAD_NODES:
            loads = dict(sorted(loads.items(), key=lambda item: -item[1])[:MAX_ROUTER_LOAD_NODES])
        placed: list[Placed] = []
        room = MAX_PLACED_BLOCKS
        pending = self._placed_out
        while pending and room > 0:
            node_id, blocks = pending.popleft()
            if len(blocks) > room:  # the rest of this prompt's blocks go first in the next report
                pending.appendleft((node_id, blocks[room:]))
            placed.append(Placed(node_id=node_id, blocks=list(blocks[:room])))
            room -= len(placed[-1].blocks)
        heads, shown = self._heads()
        if loads == self._reported and not placed and shown == self._reported_heads and not force:
            return None
        self._reported, self._reported_heads = loads, shown
        self._load_seq += 1
        return RouterLoad(
            router_id=self.router_id,
            zone=self.settings.zone,
            seq=self._load_seq,
            loads=loads,
            placed=placed,
            heads=heads,
        )

    def _heads(self) -> tuple[list[RoomHead], dict[str, tuple[float, float, bool]]]:
        """The head of each waiting room with requests waiting, for a load report (`Settings.share_turns`), the
        most urgent `MAX_ROOM_HEADS` of them; and which ticket each is (its deadline and arrival), late or not, to tell
        whether they changed."""
        if not (self.settings.share_turns and self.holds and self.turns.waiting):
            return [], {}
        with self._lock:
            now = self.clock()
            found = [(key, room.head(now)) for key, room in self.turns.rooms.items() if room.waiting]
        ranked = sorted(((_urgency(t, now), key, t) for key, t in found if t is not None), key=lambda item: item[0])
        heads = [RoomHead.at(key, urgency, now) for urgency, key, _ in ranked[:MAX_ROOM_HEADS]]
        shown = {key: (t.deadline, t.joined, bool(urgency[0])) for urgency, key, t in ranked[:MAX_ROOM_HEADS]}
        return heads, shown

    def apply_cluster_load(
        self,
        loads: Mapping[str, float],
        placed: Sequence[Placed] = (),
        routers: int = 1,
        heads: Sequence[RoomHead] = (),
    ) -> None:
        """Every router's queued prefill per node, summed by the brain over `routers` routers: what is not this
        router's own (its last report) is its peers', counted in the expected time to first token for
        `peer_load_ttl_s`. A report the sums do not include yet makes that difference off by this router's change
        since, until the next sums. `placed`, the routers' new placements, are claimed in the prefix index as this
        router's own are.

        Until the next sums, peers' placements are unseen: routers that all see the same figures would all pick the
        same least-loaded node for a burst arriving at once (with four routers on the Mooncake trace, median TTFT
        1.7× one router's). So each unit this router places on a node counts, until then, as `echo` units of its
        peers' too, and the expected-TTFT choice draws among the entries `1 + echo` such requests would fill
        (`_spread`). `echo` is the peers' queued work over this router's own, each averaged over the sums that had
        any (`ECHO_ALPHA`), at most one per peer: what peers sharing the traffic alike place meanwhile, and nothing
        when this router carries the traffic alone. An idle cluster keeps the last averages, since the burst that
        ends the lull reaches every router at once.

        `heads`, the routers' waiting-room heads (two per slice), leave each slice's most urgent of the peers' for
        `_grant` to defer to (`Settings.share_turns`)."""
        now = self.clock()
        peer_heads: dict[str, tuple[int, float]] = {}
        for head in heads:
            if head.router_id != self.router_id:
                urgency = head.urgency(now)
                if head.slice not in peer_heads or urgency < peer_heads[head.slice]:
                    peer_heads[head.slice] = urgency
        self._peer_heads = peer_heads
        for placement in placed:
            if placement.router_id != self.router_id:
                self.index.placed(placement.node_id, placement.blocks, now)
        own = self._reported
        peers: dict[str, float] = {}
        for node_id, total in loads.items():
            rest = total - own.get(node_id, 0.0)
            if rest > 0.5:  # under a token: rounding
                peers[node_id] = rest
        mine = sum(own.values())
        theirs = sum(peers.values())
        if mine > 0 or theirs > 0:
            if self._shares is None:
                self._shares = (mine, theirs)
            else:
                avg_mine, avg_theirs = self._shares
                self._shares = (
                    avg_mine + ECHO_ALPHA * (mine - avg_mine),
                    avg_theirs + ECHO_ALPHA * (theirs - avg_theirs),
                )
        ceiling = max(0, routers - 1)
        if self._shares is None or not ceiling:
            self._echo = 0.0
        else:
            avg_mine, avg_theirs = self._shares
            self._echo = min(ceiling, avg_theirs / avg_mine) if avg_mine > 0 else float(ceiling)
        self._fresh = {}
        self._peer_load, self._peer_at = peers, now
        self._wake()

    def _on_cluster_load(self, load: ClusterLoad) -> None:
        self.apply_cluster_load(load.loads, load.placed, load.routers, load.heads)

    def _on_table(self, table: RoutingTable) -> bool:
        try:
            return self.apply(table, replace=True, guard=True)
        except ValueError as exc:
            self.rejects.record(InvalidFieldError(f"table {describe(table)}: {exc}"))
            return False

    # --- placement ----------------------------------------------------------------------------------------

    def route(self, request: Request | Key, slice_name: str | None = None) -> Endpoint:
        """The endpoint for a request, or for a bare affinity key in `slice_name` (default: the text slice,
        else "default"). Raises NoRouteError without a table or nodes, ShedError for a shed request class."""
        snapshot = self._snapshot
        if snapshot is not None:
            # A bare key in a slice without an experiment has no step before the ring: the C twin of `Group.pick`
            # decides it, or leaves it (None) to the ring step `_place` takes, without building a Request.
            target = snapshot.plain.get(slice_name)
            if target is not None:
                fast = target.group.fast
                if fast is not None:
                    endpoint = fast(request)
                    if endpoint is not None:
                        return endpoint
                if request.__class__ in _BARE_KEYS:
                    pos = position(request)  # type: ignore[arg-type]
                    group, index = self._on_ring(snapshot, target, target.group, pos, (), self.clock())
                    return group.entries[index][4]
        if isinstance(request, Request):
            if slice_name is not None:
                raise TypeError("name the slice in the Request, not as an argument")
            group, index, _, _, _ = self._place(request, ())
            return group.entries[index][4]
        group, index, _, _, _ = self._place(Request(key=request, slice=slice_name), ())
        return group.entries[index][4]

    def request(
        self,
        request: Request | Key,
        slice_name: str | None = None,
        *,
        exclude: Collection[str] = (),
        turn: Ticket | None = None,
        silent: bool = False,
    ) -> Lease:
        """Place a request and return its lease: use it as `with router.request(...) as lease:`.

        `exclude` holds entry labels (`Lease.label`) this request must not go to, such as ones already tried.
        `turn` is the request's granted ticket (`turn`), whose lease beginning lets the slice's next request be
        considered; `silent`: its caller will not report a first token (a response read whole), so its load stays
        to the end and the waiting room does not count it.
        """
        if not isinstance(request, Request):
            request = Request(key=request, slice=slice_name)
        elif slice_name is not None:
            raise TypeError("name the slice in the Request, not as an argument")
        group, index, moved_from, context, units = self._place(request, exclude, remember=True)
        headers: dict[str, str] = {}
        if request.session:
            headers[SESSION_HEADER] = request.session
        if context:
            headers[CONTEXT_HEADER] = context
        state, _, _, _, endpoint = group.entries[index]
        prefill = self.settings.load == "prefill"
        return Lease(
            endpoint,
            headers,
            moved_from,
            state,
            group.inflight,
            self._lock,
            self.settings.slow_s,
            self.clock,
            units=units if prefill else 1,
            tokens=units,
            until_first_token=prefill,
            silent=silent,
            wake=self._wake if self.holds else None,
            placed=None if turn is None else lambda: self._placed(turn),
        )

    def call(
        self, request: Request | Key, fn: Callable[[Lease], T], *, tries: int | None = None, first_tokens: bool = False
    ) -> T:
        """`fn(lease)` inside a lease; when connecting fails (`ConnectionRefusedError`), again on the next probe,
        up to `tries` attempts (default `settings.connect_tries`; `Attempts` decides). `first_tokens`: `fn` calls
        `lease.first_token()` when the first token arrives, so the request waits for its turn (`Settings.hold_tokens`);
        a caller that does not would hold its prefill as queued to the end, and requests would wait behind it."""
        attempts = Attempts(self, request, tries, first_tokens=first_tokens)
        lease = attempts.first()
        while True:
            with lease:
                try:
                    return fn(lease)
                except Exception as exc:
                    following = attempts.raised(lease, exc)
                    if following is None:
                        raise
            lease = following

    async def acall(
        self,
        request: Request | Key,
        fn: Callable[[Lease], Awaitable[T]],
        *,
        tries: int | None = None,
        first_tokens: bool = False,
    ) -> T:
        """`call` for coroutines: `await fn(lease)`, retried on the next probe when connecting fails; the wait for
        the request's turn does not block the event loop."""
        attempts = Attempts(self, request, tries, first_tokens=first_tokens)
        lease = await attempts.afirst()
        while True:
            async with lease:
                try:
                    return await fn(lease)
                except Exception as exc:
                    following = attempts.raised(lease, exc)
                    if following is None:
                        raise
            lease = following

    def turn(self, request: Request) -> Ticket:
        """Join the waiting room (`Settings.hold_tokens`): the request's ticket, granted at once while its slice has
        room and nobody is waiting, or when its prompt is cached but for a few tokens (`Settings.hold_cached_tokens`),
        else when its turn comes. Raises what placing it would: NoRouteError,
        ShedError. Wait with `Ticket.wait`, then place with `request(..., turn=ticket)`, or `leave` it."""
        _, target = self._slice(request)
        now = self.clock()
        group = target.group
        # Its prefill alone on a typical entry of the slice (`Group.slo_rate`, which its SLO is held to) and on its
        # fastest (where it would start soonest), at the speed assumed until the brain has measured one.
        assumed = self.settings.assumed_prefill_tokens_per_s
        typical, quickest = (group.slo_rate, group.top_rate) if group.timed else (assumed, assumed)
        alone_s = request.cost / typical
        if request.slo_s is not None:
            budget = request.slo_s
        else:
            try:
                slice_ = Slice(request.slice) if request.slice is not None else slice_of(request.modality)
            except ValueError:  # a slice of the table's own naming ("default"): the text slice's target
                slice_ = slice_of(None)
            budget = ttft_slo_s(slice_, alone_s, self.settings.slo_scale)
        # `late_margin` at the default SLO, in proportion under a tighter one (the router's or the request's own)
        margin = self.settings.late_margin * min(1.0, budget / (SLO_SCALE * alone_s))
        late_at = now + budget - margin * request.cost / quickest
        ticket = Ticket(request, target.name, now, now + budget, late_at)
        passes = self._cached_in(target, request, now)
        with self._lock:
            if passes:
                self.turns.passed(ticket)
            else:
                self.turns.join(ticket)
                self._grant(now)
        return ticket

    def _cached_in(self, target: SliceRoute, request: Request, now: float) -> bool:
        """Whether the prefix index finds `request`'s prompt cached on a node of its slice (or the slice's overflow)
        but for at most `Settings.hold_cached_tokens`: a request with almost no prefill work, which takes no turn."""
        limit = self.settings.hold_cached_tokens
        if not limit or not request.blocks or not self.settings.prefix_index:
            return False
        if request.cost - len(request.blocks) * request.block_size > limit:  # the tail past its blocks alone is more
            return False
        groups = [g for g in (target.group, target.overflow) if g is not None]
        depth = max(
            (d for node, d in self.index.match(request.blocks, now).items() if any(node in g.by_node for g in groups)),
            default=0,
        )
        return depth > 0 and request.cost - self._cached(request, depth) <= limit

    def leave(self, ticket: Ticket, *, expired: bool = False) -> None:
        """Stop waiting for `ticket`'s turn (`expired`: it waited `hold_max_s` and goes anyway), or give back its
        grant unused (a caller that gave up, or failed before placing it), so the slice's next request is
        considered."""
        with self._lock:
            self.turns.leave(ticket, expired=expired)
            self._grant(self.clock())

    def _placed(self, ticket: Ticket) -> None:
        with self._lock:
            self.turns.placed(ticket)
            self._grant(self.clock())

    def _wake(self) -> None:
        """Some queue fell (a first token, an end, the peers' sums): let go what now has room."""
        if self.turns.waiting:
            with self._lock:
                self._grant(self.clock())

    def _grant(self, now: float) -> None:
        """Under the accounting lock: in every slice with requests waiting, let go those waiting `hold_max_s`, and
        the room's head (`Room.head`: earliest deadline first, late ones last) while an entry of the slice has at most
        `hold_tokens` queued and no other ticket of the slice is granted and not yet placed (one at a time, so each
        sees the queues the last left). While a peer router's head goes first (`_peer_first`), the entry must have
        no more than `PEER_TURN_ROOM` of that queued: the turn is the peer's unless the engine would run dry."""
        if not self.turns.waiting:
            return
        snapshot = self._snapshot
        hold_max_s = self.settings.hold_max_s
        for key, room in self.turns.rooms.items():
            for ticket in room.expired(now - hold_max_s):
                self.turns.grant(ticket, now, expired=True)
            if room.granted is not None and now - room.granted_at < hold_max_s:
                continue
            head = room.head(now)
            if head is None:
                continue
            target = snapshot.routes.get(key) if snapshot is not None else None
            if target is None:  # a slice gone from the table: placing it will say so
                self.turns.grant(head, now)
                continue
            spill = self._spill(target, target.group)
            first = self._peer_first(key, head, now)
            if self._has_room(target, spill, now, PEER_TURN_ROOM if first else 1.0):
                self.turns.grant(head, now)
            elif first and self._has_room(target, spill, now):
                self.turns.deferred += 1

    def _has_room(self, target: SliceRoute, spill: Group | None, now: float, share: float = 1.0) -> bool:
        """Whether `target`'s group, or the overflow entries `spill` its requests may detour to, has room (`_room`)."""
        return self._room(target.group, now, share=share) or (
            spill is not None and self._room(spill, now, target, share)
        )

    def _peer_first(self, key: str, head: Ticket, now: float) -> bool:
        """Whether a peer router's room head for slice `key`, from the brain's last sums while they are fresh, goes
        before this router's `head` in the rooms' one order (`Settings.share_turns`): then the turn is the peer's."""
        theirs = self._peer_heads.get(key)
        return (
            theirs is not None
            and now - self._peer_at <= self.settings.peer_load_ttl_s
            and self.settings.share_turns
            and theirs < _urgency(head, now)
        )

    def _room(self, group: Group, now: float, detour: SliceRoute | None = None, share: float = 1.0) -> bool:
        """Whether some available entry of `group` has at most `hold_tokens` of prefill queued that will report a
        first token (this router's and its peers'), counted in time once the group's speeds are measured: its tokens at
        `assumed_prefill_tokens_per_s` take as long as the entry's queue at the entry's speed, so a fast node has room
        while its queue drains as soon as a slow one's would. In the overflow group of slice `detour`, only among the
        entries a detour may take now (`_owner_waits`; the caller asks only of the group `_spill` gives placement): a
        turn granted for room that placement then passes over would join the pool's full queues. `share`: of
        `hold_tokens`."""
        limit = self.settings.hold_tokens * share
        assumed = self.settings.assumed_prefill_tokens_per_s
        peers, echo, fresh = self._peers(now)
        for i, (state, _, _, _, endpoint) in enumerate(group.entries):
            if state.gated and not state.admits(now):
                continue
            if detour is not None and self._owner_waits(endpoint.node_id, detour):
                continue
            queued = self._queued(group, i, peers, echo, fresh) - state.silent
            if (queued * assumed / group.rates[i] if group.timed else queued) <= limit:
                return True
        return False

    def _peers(self, now: float) -> tuple[Mapping[str, float] | None, float, Mapping[str, float]]:
        """(peers' queued prefill per node, `echo`, this router's fresh placements per node): the peers' sums while
        fresh (`peer_load_ttl_s`), else (None, 0, {})."""
        if now - self._peer_at <= self.settings.peer_load_ttl_s:
            return self._peer_load, self._echo, self._fresh
        return None, 0.0, {}

    @staticmethod
    def _queued(
        group: Group, i: int, peers: Mapping[str, float] | None, echo: float, fresh: Mapping[str, float]
    ) -> float:
        """Entry `i`'s queued prefill work in tokens: this router's, its peers' (spread over the node's per-GPU
        entries) and the `echo` of what it placed since the peers' sums."""
        state, _, _, _, endpoint = group.entries[i]
        node_id = endpoint.node_id
        queued: float = state.load
        if peers and node_id in peers:
            queued += peers[node_id] / len(group.by_node[node_id])
        if echo and node_id in fresh:
            queued += echo * fresh[node_id] / len(group.by_node[node_id])
        return queued

    def slice_of(self, slice_name: str | None = None) -> str:
        """The slice whose entries take a request named for `slice_name` (None: the text slice): that slice, or the
        one it falls back to while it is empty. NoRouteError without a table, or with no slice to take it."""
        snapshot = self._snapshot
        if snapshot is None:
            raise NoRouteError("no routing table yet")
        return self._resolve(snapshot, slice_name, None).name

    def _resolve(self, snapshot: Snapshot, slice_name: str | None, modality: str | None) -> SliceRoute:
        if slice_name is not None:
            try:
                target = snapshot.slices[slice_name]
            except KeyError:
                names = ", ".join(sorted(snapshot.slices)) or "none"
                raise NoRouteError(
                    f"no slice {slice_name!r} in table {describe(snapshot.table)} (slices: {names})"
                ) from None
            if target is None:
                raise NoRouteError(f"slice {slice_name!r} has no nodes in table {describe(snapshot.table)}")
            return target
        wanted = slice_of(modality)
        target = snapshot.implicit[wanted]
        if target is None:
            raise NoRouteError(f"no nodes for slice {wanted.value!r} or 'default' in table {describe(snapshot.table)}")
        return target

    def _place(
        self, request: Request, exclude: Collection[str], *, remember: bool = False
    ) -> tuple[Group, int, str | None, str | None, int]:
        """(group, entry index, node the session moved from, context signature, prefill units: the prompt tokens
        the chosen node is expected to compute) for a request; `remember`: a request being sent, which the prefix
        memory and index (if on) consult and record. Each step is a method; the first to choose an entry wins."""
        snapshot, target = self._slice(request)
        key = request.key if request.key is not None else request.session
        now = self.clock()
        home = self._arm(target, request.session or key)
        spill = self._spill(target, home)
        session = self._sessions.get(request.session, now) if request.session else None
        held = self._sticky(home, spill, session, exclude, now)
        blocks = request.blocks if self.settings.prefix_index else ()
        depths = self.index.match(blocks, now) if blocks else {}
        if session is not None and held is not None and blocks and not request.engine_blocks:
            depths = _presumed(session, request, depths)
        if held is not None and not blocks:
            group, index = held
        else:
            group, index = self._by_prefix(
                target, home, spill, request, key, blocks, depths, exclude, remember, now, held
            )
        if index is None:
            pos = position(key) if key is not None else random.getrandbits(32)
            group, index = self._on_ring(snapshot, target, home, pos, exclude, now)
        moved_from, context, units = self._record(request, key, group, index, session, blocks, depths, remember, now)
        return group, index, moved_from, context, units

    def _block_size_mismatch(self, node_id: str, size: int) -> None:
        """Count a request whose blocks are `size` tokens placed on a node whose KV events name blocks of another
        size, and say so once per node: its cache is invisible to the prefix index, and nothing else tells."""
        count = self.kv_block_size_mismatches.get(node_id, 0)
        self.kv_block_size_mismatches[node_id] = count + 1
        if count == 0:
            _log.warning(
                "node %s's KV events name blocks of %d tokens and requests hash blocks of %d (Request.block_size): "
                "the prefix index cannot match its cache; give the engine the callers' block size (vLLM "
                "--block-size, SGLang --page-size) or the callers the engine's",
                node_id,
                self._kv_block_sizes[node_id],
                size,
            )

    def _spill(self, target: SliceRoute, home: Group) -> Group | None:
        """The overflow entries a request of `target` placed from `home` may detour to: the slice's, while
        `Settings.overflow` is on and `home` is the slice's group or one of its zones (an experiment's arm keeps its
        own nodes). Placement and the waiting room both ask here, so the room counts only what placement can take."""
        return target.overflow if (home is target.group or target.zones) and self.settings.overflow else None

    def _slice(self, request: Request) -> tuple[Snapshot, SliceRoute]:
        """The current table and the request's slice (named, or its modality's; an empty one's fallback). A class
        the guardian sheds is refused here, before it takes any entry's capacity."""
        snapshot = self._snapshot
        if snapshot is None:
            raise NoRouteError("no routing table yet")
        if request.request_class in snapshot.shed:
            raise ShedError(request.request_class, snapshot.table.guardian, f"table {describe(snapshot.table)}")
        return snapshot, self._resolve(snapshot, request.slice, request.modality)

    def _arm(self, target: SliceRoute, arm_key: Key | None) -> Group:
        """The group to place in: the slice's; under an experiment the arm `arm_key` (the session, else the
        affinity key) is assigned to, as the brain assigns it, so a conversation keeps one model version; under the
        brain's zone split, the zone its row assigns `arm_key` (`SliceRoute.zone`). A request with neither key
        draws at random."""
        if not target.arms and not target.zones:
            return target.group
        drawn = _key_bytes(arm_key) if arm_key is not None else random.randbytes(8)
        return target.arm(drawn) if target.arms else target.zone(drawn)

    def _sticky(
        self, home: Group, spill: Group | None, session: Session | None, exclude: Collection[str], now: float
    ) -> tuple[Group, int] | None:
        """The session's last entry, in the arm's group or the slice's overflow entries, while it is available and
        not excluded: a conversation's next turn finds its context cached there. A request without block hashes
        goes there; one with them weighs it as the holder of its prefix in the expected-time choice (`_by_ttft`), so
        that a turn does not wait behind its node's queue however long it is."""
        if session is None:
            return None
        group, index = home, home.index.get(session.label)
        if index is None and spill is not None:
            group, index = spill, spill.index.get(session.label)
        if index is None:
            return None
        state = group.entries[index][0]
        if state.label in exclude or (state.gated and not state.admits(now)):
            return None
        return group, index

    def _by_prefix(
        self,
        target: SliceRoute,
        home: Group,
        spill: Group | None,
        request: Request,
        key: Key | None,
        blocks: Sequence[int],
        depths: dict[str, int],
        exclude: Collection[str],
        remember: bool,
        now: float,
        held: tuple[Group, int] | None = None,
    ) -> tuple[Group, int | None]:
        """Where the prompt's prefix is cached, or is worth computing. A keyed request being sent whose blocks no
        node is known to hold, and that has no session entry (`held`), goes where the prefix memory last sent its key
        (it outlives the index's claims of this router's own placements), unless its blocks are the engines'
        (`Request.engine_blocks`) and that node's engine reports its KV events (`apply_kv`): the index then knows the
        prefix is no longer cached there, and the prompt is placed as any uncached one, not onto a node whose cache
        others may be waiting for. Text blocks no event names, so for them the memory stands. A request with blocks
        takes the expected-TTFT choice (`_by_ttft`, its session's entry weighed as its prefix's holder), which goes to
        the slice's overflow entries while they are `Settings.overflow` times faster and no other slice whose pool
        holds the entry has requests waiting (`Settings.overflow_yields`). Else (`home`, None): the ring decides."""
        memory = self._memory if remember else None
        if memory is not None and key is not None and not depths and held is None:
            index = self._remembered(home, memory, key, request.cost, exclude, now)
            if index is not None and not (
                blocks and request.engine_blocks and home.entries[index][4].node_id in self._reporting
            ):
                return home, index
        if not blocks:
            return home, None
        placement = Placement(request, key, depths, exclude, now, held)
        index, expected = self._by_ttft(home, placement)
        if spill is not None:
            other, detour = self._by_ttft(spill, placement)
            if (
                other is not None
                and detour * self._detour_price(spill, other, placement) < expected
                and not self._owner_waits(spill.entries[other][4].node_id, target)
            ):
                return spill, other
        return home, index

    def _owner_waits(self, node_id: str, target: SliceRoute) -> bool:
        """Whether another slice whose pool holds `node_id` has requests waiting in this router's room
        (`Settings.overflow_yields`): a detour there would take what that slice is short of."""
        snapshot = self._snapshot
        if not self.settings.overflow_yields or snapshot is None:
            return False
        return any(
            room.waiting
            and key != target.name
            and key in snapshot.routes
            and node_id in snapshot.routes[key].group.by_node
            for key, room in self.turns.rooms.items()
        )

    def _detour_price(self, spill: Group, index: int, placement: Placement) -> float:
        """What an overflow entry's expected time is multiplied by against the pool's best: `Settings.overflow`
        for a request new there; for the session's own entry, the cache rule's 1 / `_affinity`, since a turn that
        stays adds little work to the other slice's queue and leaves its context where it is."""
        held = placement.held
        if held is not None and held[0] is spill and held[1] == index:
            node_id = spill.entries[index][4].node_id
            return 1.0 / self._affinity(placement.request, placement.depths.get(node_id, 0))
        return self.settings.overflow

    def _on_ring(
        self, snapshot: Snapshot, target: SliceRoute, group: Group, pos: int, exclude: Collection[str], now: float
    ) -> tuple[Group, int]:
        """Bounded-load consistent hashing (`Group.pick`) at ring position `pos` in `group`; when no entry there is
        available, in the whole slice for a zone's group (the split lagging an outage costs no request), then the
        bounded walk in each of the slice's fallbacks; when none is either, the first entry not
        excluded along the probe order, health ignored (Envoy's panic routing: a request to a possibly failed node
        beats refusing every request)."""
        index = group.pick(pos, exclude, now)
        if index is not None:
            return group, index
        if target.zones and group is not target.group:  # the assigned zone has no entry available: any zone's
            index = target.group.pick(pos, exclude, now)
            if index is not None:
                return target.group, index
        for name in target.fallbacks:
            fallback = snapshot.slices.get(name)
            if fallback is not None:
                index = fallback.group.bounded(fallback.group.ring.index(pos), exclude, now)
                if index is not None:
                    return fallback.group, index
        for index in group.ring.probe(group.ring.index(pos)):
            if group.entries[index][0].label not in exclude:
                return group, index
        raise NoRouteError(f"every endpoint of slice {target.name!r} was tried for this request")

    def _record(
        self,
        request: Request,
        key: Key | None,
        group: Group,
        index: int,
        session: Session | None,
        blocks: Sequence[int],
        depths: dict[str, int],
        remember: bool,
        now: float,
    ) -> tuple[str | None, str | None, int]:
        """(node the session moved from, context signature, prefill units) for the chosen entry, and what the next
        placements learn from it: the session's entry, the prefix memory's for the key, and, for a request being
        sent, the prefix index's claim of its blocks there (queued for the peers' load reports with `share_load`).
        A session that moved carries its context signature, so the new node can load the session's context."""
        state, _, _, _, endpoint = group.entries[index]
        label = state.label
        context = request.context_signature
        moved_from = None
        if session is not None:
            if session.label != label or session.model_version != endpoint.model_version:
                moved_from = session.node_id
            context = context or session.context
        if request.session:
            self._sessions.put(request.session, label, endpoint.node_id, endpoint.model_version, context, now, blocks)
        memory = self._memory if remember else None
        if memory is not None and key is not None:
            memory.put(key, label, request.cost)
        depth = depths.get(endpoint.node_id, 0)
        units = request.cost - self._cached(request, depth)
        if blocks and self._kv_block_sizes.get(endpoint.node_id, request.block_size) != request.block_size:
            self._block_size_mismatch(endpoint.node_id, request.block_size)
        if remember and blocks:
            if self._echo:
                fresh = self._fresh
                fresh[endpoint.node_id] = fresh.get(endpoint.node_id, 0.0) + units
            self.index.placed(endpoint.node_id, blocks, now)
            if depth < len(blocks) and self.shares_load:
                self._placed_out.append((endpoint.node_id, blocks[depth:]))
        return moved_from, context, units

    @staticmethod
    def _cached(request: Request, depth: int) -> int:
        """Prompt tokens a node holding the prompt's first `depth` blocks need not compute (one is always left:
        an engine computes at least the last token to produce the first)."""
        return min(request.cost - 1, depth * request.block_size)

    def _by_ttft(self, group: Group, placement: Placement) -> tuple[int | None, float]:
        """The entry for a request with block hashes and its expected time to first token; (None, inf) when no
        entry is available.

        The entry holding the longest prefix (the session's entry, `Placement.held`, when it is in this group: the node
        holding the conversation) wins while its expected time (`_expected_ttft`) is within the affinity factor for
        the share of the prompt it holds (`_affinity`) times the least one, else the entry with the least. Ties go to
        the first in the key's probe order, so an idle group places keys as the ring does.

        While peer routers place at the same time (`echo`, `apply_cluster_load`), the choice is drawn instead from
        the entries that `1 + echo` requests like this one would fill (`_spread`), a shallower prefix than the
        choice's weighing that factor times its time there: routers deciding a burst from the same figures
        otherwise all take the same entry, and the draw keeps what the cache rule prefers."""
        request, depths, held = placement.request, placement.depths, placement.held
        best: int | None = None
        best_expected = math.inf
        deep: int | None = None
        deep_key = (0, math.inf)
        entries = group.entries
        kept = held[1] if held is not None and held[0] is group else None
        expected, echo = self._expected_ttft(group, placement, kept)
        for i, (ttft, _) in expected.items():
            if ttft < best_expected:
                best, best_expected = i, ttft
            depth = depths.get(entries[i][4].node_id, 0)
            if depth and (-depth, ttft) < deep_key:
                deep, deep_key = i, (-depth, ttft)
        if best is None:
            return None, math.inf
        if kept is not None and kept in expected:
            deep, deep_key = kept, (0, expected[kept][0])
        if deep is not None:
            factor = self._affinity(request, depths.get(entries[deep][4].node_id, 0))
            if deep_key[1] <= factor * best_expected:
                best, best_expected = deep, deep_key[1]
        copies = min(len(expected), 1 + round(echo))
        if copies > 1:
            depth = depths.get(entries[best][4].node_id, 0)
            affinity = self._affinity(request, depth)
            weighed = {
                i: (ttft, own) if depths.get(entries[i][4].node_id, 0) >= depth else (ttft * affinity, own * affinity)
                for i, (ttft, own) in expected.items()
            }
            best = _spread(weighed, copies, position(request.blocks[-1]))
            best_expected = expected[best][0]
        return best, best_expected

    def _affinity(self, request: Request, depth: int) -> float:
        """The affinity factor (`Settings.affinity`) of a node holding the request's first `depth` blocks."""
        return self.settings.affinity(depth, len(request.blocks))

    def _expected_ttft(
        self, group: Group, placement: Placement, kept: int | None = None
    ) -> tuple[dict[int, tuple[float, float]], float]:
        """Each available candidate entry's (expected time to first token, the request's own part of it: its tokens
        the entry's cache lacks), in the key's probe order; and the `echo` in force (0 without fresh peers' sums).

        It is the entry's queued prefill work (what this router and, through the brain, its peer routers sent there
        that has no first token yet: `apply_cluster_load`) plus the request's tokens its cache lacks, over its prefill
        speed, stretched by its weight (`Group.stretch`), plus the network stall its kernel's retransmits forecast
        (`Group.stall`) and the one this router's connections to it forecast (`EndpointState.stall_s`, also only
        while `Group.timed`); where the brain says its engine's KV cache has no room for the request (`Group.admit`),
        the wait for room replaces the queue's part when longer. The queue is weighed by each node's speed, so the
        equal-share bounded-load limit does not apply. In a group larger than `ttft_candidates` only the nodes
        holding the prefix, the `kept` entry (the session's) and the first entries along the key's probe order are
        weighed."""
        request, key, depths = placement.request, placement.key, placement.depths
        exclude, now = placement.exclude, placement.now
        entries = group.entries
        pos = position(key) if key is not None else position(request.blocks[0])
        candidates: list[int] = []
        limit = self.settings.ttft_candidates
        for i in group.ring.probe(group.ring.index(pos)):
            if len(candidates) >= limit:
                break
            candidates.append(i)
        if len(entries) > limit:
            taken = set(candidates)
            candidates += [i for node in depths for i in group.by_node.get(node, ()) if i not in taken]
        if kept is not None and kept not in candidates:
            candidates.append(kept)
        cost = request.cost
        peers, echo, fresh = self._peers(now)
        out: dict[int, tuple[float, float]] = {}
        for i in candidates:
            state, _, _, _, endpoint = entries[i]
            if (state.gated and not state.admits(now)) or (exclude and state.label in exclude):
                continue
            queued = self._queued(group, i, peers, echo, fresh)
            own = cost - self._cached(request, depths.get(endpoint.node_id, 0))
            scale, stall = group.stretch[i] / group.rates[i], group.stall[i]
            if state.retransmits and group.timed:  # most endpoints have lost nothing: no call
                stall += state.stall_s(now)
            out[i] = (max(queued * scale, group.admit[i]) + own * scale + stall, own * scale + stall)
        return out, echo

    def _remembered(
        self, group: Group, memory: PrefixMemory, key: Key, cost: int, exclude: Collection[str], now: float
    ) -> int | None:
        """The entry `key` last went to, if available and under its bound once the request's expected cache hit
        there (the smaller of its cost and the last one) is taken off that entry's queued work."""
        last = memory.get(key)
        index = None if last is None else group.index.get(last[0])
        if index is None or last is None or last[0] in exclude:
            return None
        state = group.entries[index][0]
        if (state.gated and not state.admits(now)) or not group.under(index, less=min(cost, last[1])):
            return None
        return index

    # --- state --------------------------------------------------------------------------------------------

    @property
    def table(self) -> RoutingTable | None:
        snapshot = self._snapshot
        return None if snapshot is None else snapshot.table

    @property
    def table_age_s(self) -> float | None:
        """Seconds since the current table was applied; None without a table."""
        snapshot = self._snapshot
        return None if snapshot is None else self.clock() - snapshot.applied_monotonic

    @property
    def last_heard_age_s(self) -> float | None:
        """Seconds since the brain this router follows was last heard (before it follows one: any brain);
        None when none has been (or there is no network)."""
        heard = None if self._subscriber is None else self._subscriber.last_heard_monotonic
        return None if heard is None else time.monotonic() - heard

    def brains(self) -> dict[str, dict[str, object]]:
        """Every brain heard: seconds since, live, followed, priority, latest (epoch, version) (`TableSubscriber`)."""
        return {} if self._subscriber is None else self._subscriber.brains()

    @property
    def hears_kv(self) -> bool:
        """Whether some node's engine KV events reach this router (`apply_kv`): only then do a request's engine
        blocks find more in the prefix index than its text blocks would."""
        return bool(self._reporting)

    @property
    def sessions(self) -> int:
        """Sessions remembered now (expired ones included until trimmed)."""
        return len(self._sessions)

    def _peer_states(self) -> Collection[EndpointState]:
        """Every endpoint's state, for the cap on open circuits (read under the accounting lock)."""
        return self._states.values()

    def status(self) -> dict[str, EndpointStatus]:
        """Each endpoint of the current table by label: in flight, available, circuit, outcome counts."""
        now = self.clock()
        return {label: state.status(now) for label, state in sorted(self._states.items())}

    def wait_for_table(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for a first table; True when there is one."""
        return self._has_table.wait(timeout_s)

    def close(self) -> None:
        """Stop following the brains; the last table stays usable."""
        if self._closed:
            return
        self._closed = True
        if self._subscriber is not None:
            self._subscriber.stop()
        if self._ctx is not None:
            self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
