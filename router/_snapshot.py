"""The immutable lookup structures built once per routing table and swapped in by one reference."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from prismlb.semantics import Slice, assign_arm, assign_zone, callers_speeds
from prismlb.wire import Experiment, RoutingTable, SliceTable, TableNode, ZoneRoute

from ._health import EndpointState
from ._request import CORE_CLASS
from ._ring import Ring, label
from ._settings import Settings

try:
    from . import _fastroute as fastroute
except ImportError:  # built without a C compiler: route() takes its pure-Python path alone
    fastroute = None  # type: ignore[assignment]

DEFAULT_SLICE_NAME = "default"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where to send a request: the node's id and the address its inference server listens on, the GPU for a
    per-GPU entry, and the model version it serves."""

    node_id: str
    address: str
    gpu: int | None = None
    model_version: str = ""


class InFlight:
    """Requests this router has in flight in one group (slice or experiment arm), kept across tables."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


Entry = tuple[EndpointState, float, float, float, Endpoint]
"""An entry as placement unpacks it (a plain tuple unpacks fastest, and `_fastroute.Table` reads it too):
`(state, safe, base_load, inv_share, endpoint)`. `base_load` is the brain's load estimate (0 when absent),
`inv_share` the group's total weight over the entry's, and `safe` the count of local requests in flight below
which the entry is surely under its bounded-load limit (the limit only grows as the group's requests in flight
grow)."""


@dataclass(frozen=True, slots=True, eq=False)
class Group:
    """One ring (a slice, or an experiment arm) and its entries, indexed by entry index.

    It holds the bounded-load rule, once for every Python path: consistent hashing with bounded loads, kept as
    Envoy keeps it, one wrapper around the ring's pick. `pick` takes the ring's owner of a position while it
    `fits`, else walks the ring's probe order (`bounded`); `fast` is the same choice in C for bare keys, and
    tests/test_router_fast.py checks that the two agree.
    """

    name: str
    ring: Ring
    entries: tuple[Entry, ...]
    base_total: float  # the brain's load estimates, summed
    inflight: InFlight
    balance: float
    """`Settings.balance`: the bounded-load factor, 0 for no bound."""
    index: Mapping[str, int]  # label -> entry index
    rates: tuple[float, ...]
    """Each entry's prefill speed in prompt tokens per second: the table's, else this router's own from its callers'
    first tokens (`_speeds`), else the median of the group's, else of the table's, else 1 for all (then expected
    times only compare, which is all they are used for)."""
    timed: bool
    """Whether `rates` are on the engines' own scale of tokens per second: some entry of the table has the speed its
    engine measured, and this router's own measures, if any, are scaled to it (`_speeds`). Until then the absolute
    rules that read seconds (the waiting room's limit, a ticket's deadline, the stall and the wait for cache room)
    count as they do with no speed at all: this router's first tokens read a busy engine's queue and the hop too,
    so their scale alone is slower than the engines' by an unknown factor, and the room would hold that many times
    longer. `rates` still order the entries."""
    slo_rate: float
    """The prefill speed a request's TTFT deadline is counted at (`Router.turn`): the median of `rates`, the lower
    of two middles. A typical node's, not the slowest's: one node slowed by a fault (a throttled GPU) would
    otherwise stretch every request's deadline, and the waiting room's order would follow the sick node."""
    top_rate: float
    """The fastest entry's prefill speed (the highest of `rates`): where a waiting request would start soonest, which
    its late margin is counted at (`Router.turn`)."""
    stretch: tuple[float, ...]
    """Each entry's highest weight in the group over its own: how much its expected time to first token is
    stretched for the health and tail latency the brain saw there."""
    stall: tuple[float, ...]
    """Each entry's network stall in seconds (`TableNode.stall_ms`), added to its expected time to first token;
    0 for all while not `timed` (then expected times are not in the engines' seconds)."""
    admit: tuple[float, ...]
    """Each entry's wait for room in its engine's KV cache in seconds (`TableNode.admit_ms`), which its expected
    time to first token takes instead of its queued prefill when longer; 0 for all while not `timed`."""
    by_node: Mapping[str, tuple[int, ...]]
    """node id -> its entries' indices (several for a node with per-GPU entries)."""
    fast: Callable[[object], Endpoint | None] | None
    """`pick` for a bare key in C (`_fastroute.Table.route`): its endpoint, or None where the Python path must
    decide (a gated entry on the way, whose `admits(now)` only Python asks, or not a str, bytes or int key);
    None without the extension."""

    def limit(self) -> float:
        """The bound on an entry's load per unit of weight share (`share`): `balance` times the group's load with
        the request being placed, so it grows as the group's requests in flight grow."""
        return self.balance * (self.base_total + self.inflight.value + 1)

    def share(self, index: int, less: float = 0.0) -> float:
        """Entry `index`'s load (this router's in flight, plus the brain's estimate), less `less`, per unit of its
        weight share: what the bound compares, so that a heavier entry takes proportionally more."""
        state, _, base_load, inv_share, _ = self.entries[index]
        return (state.load + base_load - less) * inv_share

    def under(self, index: int, less: float = 0.0) -> bool:
        """Whether entry `index`, with `less` taken off its load, is under the bound (always, with no bound)."""
        return not self.balance or self.share(index, less) < self.limit()

    def fits(self, index: int) -> bool:
        """Whether entry `index` takes a request without a walk: plainly available (a gated entry goes to the
        walk, which asks `admits(now)`) and under the bound, its precomputed `safe` count first so that the
        common case costs two comparisons."""
        state, safe, _, _, _ = self.entries[index]
        return not state.gated and (state.load < safe or self.share(index) < self.limit())

    def bounded(self, start: int, exclude: Collection[str], now: float) -> int | None:
        """The first entry along the ring's probe order from point `start` that is available, not excluded and
        under the bound; when every available entry is at its bound, the least loaded for its weight (a request
        is never refused for load); None when none is available. The order is deterministic per key and table,
        so under the same loads every router spills a key to the same entry."""
        limit = self.limit()
        best: int | None = None
        best_share = 0.0
        for index in self.ring.probe(start):
            state = self.entries[index][0]
            if (state.gated and not state.admits(now)) or (exclude and state.label in exclude):
                continue
            if not self.balance:
                return index
            share = self.share(index)
            if share < limit:
                return index
            if best is None or share < best_share:
                best, best_share = index, share
        return best

    def pick(self, pos: int, exclude: Collection[str], now: float) -> int | None:
        """Bounded load around the ring's pick for ring position `pos`: its owner while that `fits` (and nothing
        is excluded), else the `bounded` walk from the owner's point."""
        owner = self.ring.owner(pos)
        if not exclude and self.fits(owner):
            return owner
        return self.bounded(self.ring.index(pos), exclude, now)


@dataclass(frozen=True, slots=True, eq=False)
class SliceRoute:
    """A slice's group, its experiment with a group per arm's model version, and its fallback slices."""

    name: str
    group: Group
    experiment: Experiment | None
    arms: Mapping[str, Group]  # model version -> group; empty without an experiment
    fallbacks: tuple[str, ...]
    source: SliceTable  # what it was built from: a later table with the same object reuses its groups
    overflow: Group | None = None
    """The slice's overflow entries (`TableNode.overflow`), outside its ring: taken by expected time to first
    token only (`Settings.overflow`)."""
    zone_route: ZoneRoute | None = None
    """The zone split's row for this router's zone (`Settings.zone`), if the table has one."""
    zones: Mapping[str, Group] = dataclasses.field(default_factory=dict)
    """Serving zone -> a group of the slice's entries in it; empty without `zone_route` or when the slice's entries
    are all in one zone."""

    def arm(self, key: bytes) -> Group:
        """The group of the arm a session or affinity key is assigned to (the brain's `assign_arm`)."""
        assert self.experiment is not None
        return self.arms[assign_arm(self.experiment, key)]

    def zone(self, key: bytes) -> Group:
        """The group of the zone the split assigns a session or affinity key to (`assign_zone`); the whole slice's
        when that zone has no entries in the slice."""
        assert self.zone_route is not None and self.zones
        return self.zones.get(assign_zone(self.zone_route, key), self.group)


@dataclass(frozen=True, slots=True, eq=False)
class Snapshot:
    """Everything route() reads, swapped as one attribute so readers never see half a table."""

    table: RoutingTable
    routes: Mapping[str, SliceRoute]  # the slices with nodes, each by its own name
    slices: Mapping[str, SliceRoute | None]  # None: no nodes and no fallback with nodes
    implicit: Mapping[Slice, SliceRoute | None]  # for requests that name no slice: their modality's, or "default"
    plain: Mapping[str | None, SliceRoute]  # slices without experiments, for bare keys (None: the text slice)
    shed: frozenset[str]
    applied_monotonic: float


@dataclass(frozen=True, slots=True)
class _Speeds:
    """The prefill speeds a table's groups are built with: each entry's (by label) where one is known, and what an
    entry none is known for takes when its group has none either."""

    by_label: Mapping[str, float]
    fleet: float | None
    scaled: bool
    """Whether some entry's speed is its engine's measure, which `by_label` is then on the scale of."""


def _speeds(table: RoutingTable, state_for: Callable[[str], EndpointState]) -> _Speeds:
    """Every entry's prefill speed: the table's, else the router's own from its callers' first tokens on the table's
    scale, pooled over the entries of its GPU class (`semantics.callers_speeds`); `fleet`, the median of these over
    the table (None when none is known: expected times then compare tokens); `scaled`, whether the table has any
    speed, which sets that scale (without one, the router's own measures still order the nodes, but not in the
    engines' seconds)."""
    measured: dict[str, float] = {}
    seen: dict[str, float] = {}
    classes: dict[str, str] = {}
    for slice_table in table.slices:
        for node in slice_table.nodes:
            name = label(node)
            classes[name] = node.gpu_class
            if node.prefill_tokens_per_s:
                measured[name] = node.prefill_tokens_per_s
            speed = state_for(name).first_token_speed  # of the measured nodes too: they set the scale
            if speed:
                seen[name] = speed
    by_label = measured | callers_speeds(measured, seen, classes)
    return _Speeds(by_label, statistics.median_high(by_label.values()) if by_label else None, bool(measured))


@dataclass(frozen=True, slots=True)
class _Builder:
    """What every group of one table is built with: the router's settings, its state objects (`state_for(label)`,
    `counter_for(group name)`, which outlive tables) and the table's speeds."""

    settings: Settings
    state_for: Callable[[str], EndpointState]
    counter_for: Callable[[str], InFlight]
    speeds: _Speeds

    def ring(self, nodes: list[TableNode]) -> Ring:
        settings = self.settings
        return Ring.build(
            nodes, settings.base_points, numa_node=settings.numa_node, max_points=settings.max_ring_points
        )


def _group(name: str, ring: Ring, how: _Builder) -> Group:
    settings, state_for, speeds = how.settings, how.state_for, how.speeds
    total_weight = sum(ring.weights)
    brain_load = settings.load == "requests"  # the brain's estimates count requests
    base_total = sum(node.load or 0.0 for node in ring.entries) if brain_load else 0.0
    entries = tuple(
        (
            state_for(entry),
            settings.balance * (base_total + 1) * weight / total_weight - (node.load or 0.0 if brain_load else 0.0)
            if settings.balance
            else math.inf,
            node.load or 0.0 if brain_load else 0.0,
            total_weight / weight,
            Endpoint(node.node_id, node.endpoint, node.gpu, node.model_version),
        )
        for entry, node, weight in zip(ring.labels, ring.entries, ring.weights, strict=True)
    )
    own = [speeds.by_label.get(entry) for entry in ring.labels]
    known = [rate for rate in own if rate]
    typical = statistics.median_high(known) if known else speeds.fleet
    rates = tuple(rate or typical or 1.0 for rate in own)
    timed = typical is not None and speeds.scaled
    top = max(ring.weights)
    by_node: dict[str, list[int]] = {}
    for i, node in enumerate(ring.entries):
        by_node.setdefault(node.node_id, []).append(i)
    inflight = how.counter_for(name)
    fast = None
    if fastroute is not None:
        args = (ring.points, ring.owners, ring.slots, ring.shift, entries, base_total, inflight, settings.balance)
        fast = fastroute.Table(*args).route
    return Group(
        name=name,
        ring=ring,
        entries=entries,
        base_total=base_total,
        inflight=inflight,
        balance=settings.balance,
        index={entry: i for i, entry in enumerate(ring.labels)},
        rates=rates,
        timed=timed,
        slo_rate=statistics.median_low(rates),
        top_rate=max(rates),
        stretch=tuple(top / w for w in ring.weights),
        stall=tuple((n.stall_ms or 0.0) / 1000 if timed else 0.0 for n in ring.entries),
        admit=tuple((n.admit_ms or 0.0) / 1000 if timed else 0.0 for n in ring.entries),
        by_node={node: tuple(indices) for node, indices in by_node.items()},
        fast=fast,
    )


def _arms(slice_table: SliceTable, experiment: Experiment, base: Group, how: _Builder) -> dict[str, Group]:
    """One group per arm over the slice's nodes of the arm's model version (the whole slice when it has none)."""
    arms: dict[str, Group] = {}
    for arm in experiment.arms:
        nodes: list[TableNode] = [n for n in _regular(slice_table) if n.model_version == arm.model_version]
        if not nodes:
            arms[arm.model_version] = base
            continue
        arms[arm.model_version] = _group(f"{slice_table.name}@{arm.model_version}", how.ring(nodes), how)
    return arms


def _zones(slice_table: SliceTable, route: ZoneRoute | None, how: _Builder) -> dict[str, Group]:
    """One group per serving zone of the split's row over the slice's entries in that zone; none when the row is
    absent or the slice's entries are all in one zone (the split could not change where its requests go)."""
    if route is None:
        return {}
    by_zone: dict[str, list[TableNode]] = {}
    for node in _regular(slice_table):
        by_zone.setdefault(node.zone, []).append(node)
    if len(by_zone) < 2:
        return {}
    groups: dict[str, Group] = {}
    for share in route.shares:
        nodes = by_zone.get(share.zone)
        if nodes and share.zone not in groups:
            groups[share.zone] = _group(f"{slice_table.name}@zone:{share.zone}", how.ring(nodes), how)
    return groups


def _regular(slice_table: SliceTable) -> list[TableNode]:
    """The slice's own entries, on its ring: all but the overflow ones (all of them when every one is)."""
    own = [n for n in slice_table.nodes if not n.overflow]
    return own or slice_table.nodes


def _chain(name: str, fallback_of: Mapping[str, str | None]) -> list[str]:
    """The slices a slice's requests may go to after it, following `fallback` (cycles cut)."""
    chain: list[str] = []
    current = fallback_of.get(name)
    while current is not None and current != name and current not in chain:
        chain.append(current)
        current = fallback_of.get(current)
    return chain


def build(
    table: RoutingTable,
    settings: Settings,
    state_for: Callable[[str], EndpointState],
    counter_for: Callable[[str], InFlight],
    now: float,
    previous: Snapshot | None = None,
) -> Snapshot:
    """Build every slice's rings and arms; ValueError when the table cannot be routed on.

    `state_for(label)` and `counter_for(group name)` give the router's state objects, which outlive tables;
    `now` is the router's clock, for the table's age. A slice whose `SliceTable` is the very object the
    `previous` snapshot was built from, under the same experiment, keeps its groups: a table assembled from
    per-slice updates rebuilds only the slices that changed, and those with an entry of no speed, whose speeds are
    this router's own measures of the moment (`_speeds`).
    """
    fallback_of: dict[str, str | None] = {}
    for slice_table in table.slices:
        if slice_table.name in fallback_of:
            raise ValueError(f"slice {slice_table.name!r} appears more than once")
        fallback_of[slice_table.name] = slice_table.fallback
    nonempty = {s.name for s in table.slices if s.nodes}
    experiments: dict[str, Experiment] = {}
    for listed in table.experiments:
        experiments.setdefault(listed.slice, listed)  # the first experiment on a slice wins
    zone_route = next((row for row in table.zones if row.caller == settings.zone), None) if settings.zone else None
    routes: dict[str, SliceRoute] = {}
    how: _Builder | None = None  # with the table's speeds, worked out for the first slice rebuilt
    for slice_table in table.slices:
        if not slice_table.nodes:
            continue
        experiment = experiments.get(slice_table.name)
        fallbacks = tuple(n for n in _chain(slice_table.name, fallback_of) if n in nonempty)
        before = None if previous is None else previous.routes.get(slice_table.name)
        if (
            before is not None
            and before.source is slice_table
            and before.experiment == experiment
            and before.zone_route == zone_route
            and all(n.prefill_tokens_per_s for n in slice_table.nodes)  # else its speeds are this router's (`_speeds`)
        ):
            spill = () if before.overflow is None else (before.overflow,)
            for group in (before.group, *before.arms.values(), *before.zones.values(), *spill):
                counter_for(group.name)
                for name in group.index:
                    state_for(name)
            routes[slice_table.name] = dataclasses.replace(before, fallbacks=fallbacks)
            continue
        how = how or _Builder(settings, state_for, counter_for, _speeds(table, state_for))
        regular = _regular(slice_table)
        extra = [n for n in slice_table.nodes if n.overflow] if len(regular) < len(slice_table.nodes) else []
        rings: list[Ring] = []
        for nodes in (regular, extra) if extra else (regular,):
            try:
                rings.append(how.ring(nodes))
            except ValueError as exc:
                raise ValueError(f"slice {slice_table.name!r}: {exc}") from None
        base = _group(slice_table.name, rings[0], how)
        spill = _group(f"{slice_table.name}+overflow", rings[1], how) if extra else None
        arms = {} if experiment is None else _arms(slice_table, experiment, base, how)
        zones = _zones(slice_table, zone_route, how) if not arms else {}
        routes[slice_table.name] = SliceRoute(
            slice_table.name,
            base,
            experiment,
            arms,
            fallbacks,
            slice_table,
            spill,
            zone_route,
            zones,
        )
    slices: dict[str, SliceRoute | None] = {}
    for name in fallback_of:
        slices[name] = routes.get(name) or next((routes[n] for n in _chain(name, fallback_of) if n in routes), None)
    implicit = {s: slices.get(s.value) or slices.get(DEFAULT_SLICE_NAME) for s in Slice}
    shed = frozenset(table.shed_classes)
    plain: dict[str | None, SliceRoute] = {}
    if CORE_CLASS not in shed:  # bare keys are core requests: when core is shed, they take the path that refuses
        plain.update((name, r) for name, r in slices.items() if r is not None and not r.arms and not r.zones)
        text = implicit[Slice.LLM]
        if text is not None and not text.arms and not text.zones:
            plain[None] = text
    return Snapshot(table, routes, slices, implicit, plain, shed, now)
