"""The brain's relay of the routers' queued prefill work and placements: `RouterLoad`s in, `ClusterLoad`s out.

A router knows only the requests it placed itself. With many routers embedded in callers, each sees a fraction of
every node's queue, and all of them send the next long prompt to the node that looks idle to each: with 16
routers on eight nodes the replay's goodput fell to 0.14–0.50 of one router's on five of six workloads
(docs/router.md). So every router
reports its own queued prefill tokens per node (`RouterLoad`, its whole figure each time) and the relay publishes
the sums over every router heard within `expiry_s`: when they changed, at most every `publish_s`, and at least
every `refresh_s` so that routers can tell a quiet cluster from a silent brain. A router subtracts its own last
report from the sums, which leaves its peers' work.

Reports also carry the prompts each router placed since its last one; the relay passes them on in the next
`ClusterLoad` and every other router claims them in its prefix index, as the placing router does: a long prompt's
blocks reach the engine's KV events only once it is computed, seconds later, and meanwhile the requests that
share its prefix would go elsewhere from every other router (measured on the Mooncake trace with four routers,
docs/router.md).

Reports also name the head of each of the router's waiting rooms (the request it lets go next, `RoomHead`); the
relay passes on, per slice, the two most urgent over every router, their times counted to the sending, so that a
router lets its head go only when no peer's is due sooner (`Settings.share_turns`): one order over every router's
room, where each would otherwise order its own share of the requests and all of them fill the same free engine at
once.

Bounded: at most `max_routers` routers (a report from one more is refused and counted) and
`MAX_ROUTER_LOAD_NODES` nodes per report (the message's own limit). The sums are kept as reports come (the
router's previous figure out, the new one in) and recomputed from the reports at every refresh, so floating-point
drift never builds up.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prismlb.service import kind_counter
from prismlb.wire import MAX_CLUSTER_HEADS, ClusterLoad, Placed, RoomHead, RouterLoad

EXPIRY_S = 2.0
PUBLISH_S = 0.02
REFRESH_S = 0.5
MAX_ROUTERS = 10_000
MAX_PLACED = 1_000_000
"""Placed block hashes held for the next `ClusterLoad` (9 MB on the wire at most, under the 16 MiB frame limit)."""


@dataclass
class _Report:
    seq: int
    loads: dict[str, float]
    heard: float
    zone: str = ""
    heads: list[RoomHead] = field(default_factory=list)


class LoadRelay:
    """The latest report of every live router and their per-node sums. Single-threaded: the brain's loop calls
    everything."""

    def __init__(
        self,
        brain_id: str,
        *,
        expiry_s: float = EXPIRY_S,
        publish_s: float = PUBLISH_S,
        refresh_s: float = REFRESH_S,
        max_routers: int = MAX_ROUTERS,
        max_placed: int = MAX_PLACED,
    ) -> None:
        if not 0 < publish_s <= refresh_s < expiry_s or max_routers < 1:
            raise ValueError("need 0 < publish_s <= refresh_s < expiry_s and max_routers >= 1")
        self.brain_id = brain_id
        self.expiry_s, self.publish_s, self.refresh_s, self.max_routers = expiry_s, publish_s, refresh_s, max_routers
        self.max_placed = max_placed
        self._reports: dict[str, _Report] = {}
        self._sums: dict[str, float] = {}
        self._placed: list[Placed] = []
        self._placed_blocks = 0
        self._changed = False
        self._published_at = -float("inf")
        self.seq = 0
        """The last `ClusterLoad`'s number (0: none yet)."""
        self.counts = {
            "reports": 0,  # RouterLoads taken
            "stale": 0,  # RouterLoads older than one already taken from the same router
            "overflow": 0,  # RouterLoads refused because max_routers were already held
            "expired": 0,  # routers dropped after expiry_s without a report
            "placed_dropped": 0,  # placements left out because max_placed blocks were waiting already
            "published": 0,  # ClusterLoads returned
        }

    @property
    def routers(self) -> int:
        return len(self._reports)

    def accept(self, report: RouterLoad, now: float) -> None:
        """Take a router's report in place of its previous one."""
        held = self._reports.get(report.router_id)
        if held is None and len(self._reports) >= self.max_routers:
            self.counts["overflow"] += 1
            return
        if held is not None and report.seq <= held.seq:
            self.counts["stale"] += 1
            return
        if held is not None:
            self._add(held.loads, -1.0)
        loads = dict(report.loads)
        self._reports[report.router_id] = _Report(report.seq, loads, now, report.zone, list(report.heads))
        self._add(loads, 1.0)
        for placement in report.placed:
            if self._placed_blocks + len(placement.blocks) > self.max_placed:
                self.counts["placed_dropped"] += 1
                continue
            self._placed.append(msgspec.structs.replace(placement, router_id=report.router_id))
            self._placed_blocks += len(placement.blocks)
        self._changed = True
        self.counts["reports"] += 1

    def demand_by_zone(self) -> dict[str, float]:
        """Each caller zone's share of the routers' demand: of their queued prefill tokens while any are queued, else
        of the routers themselves (a router that reported counts one). Routers that name no zone are left out;
        empty when none names one (the zone split then assumes equal demand)."""
        tokens: dict[str, float] = {}
        routers: dict[str, float] = {}
        for report in self._reports.values():
            if report.zone:
                tokens[report.zone] = tokens.get(report.zone, 0.0) + sum(report.loads.values())
                routers[report.zone] = routers.get(report.zone, 0.0) + 1.0
        weights = tokens if sum(tokens.values()) > 0 else routers
        total = sum(weights.values())
        return {zone: weight / total for zone, weight in weights.items()} if total > 0 else {}

    def _add(self, loads: dict[str, float], sign: float) -> None:
        sums = self._sums
        for node_id, tokens in loads.items():
            total = sums.get(node_id, 0.0) + sign * tokens
            if total > 1e-9:
                sums[node_id] = total
            else:
                sums.pop(node_id, None)

    def next_due(self) -> float:
        """When `due` has something to publish at the latest, with no report coming in meanwhile."""
        return self._published_at + (self.publish_s if self._changed else self.refresh_s)

    def due(self, now: float) -> ClusterLoad | None:
        """The sums to publish now, if any: after a change once `publish_s` has passed since the last, and every
        `refresh_s` regardless (recomputed from the reports then, routers silent past `expiry_s` dropped)."""
        since = now - self._published_at
        if since >= self.refresh_s:
            for router_id in [r for r, report in self._reports.items() if now - report.heard > self.expiry_s]:
                del self._reports[router_id]
                self.counts["expired"] += 1
            self._sums = {}
            for report in self._reports.values():
                self._add(report.loads, 1.0)
        elif not (self._changed and since >= self.publish_s):
            return None
        placed, self._placed, self._placed_blocks = self._placed, [], 0
        self._changed = False
        self._published_at = now
        self.seq += 1
        self.counts["published"] += 1
        return ClusterLoad(
            brain_id=self.brain_id,
            seq=self.seq,
            routers=len(self._reports),
            loads=dict(self._sums),
            placed=placed,
            heads=self._heads(now),
        )

    def _heads(self, now: float) -> list[RoomHead]:
        """Per slice, the two most urgent room heads of the routers heard, their times aged to `now`; the most
        urgent slices first, up to the message's limit."""
        by_slice: dict[str, list[RoomHead]] = {}
        for router_id, report in self._reports.items():
            age = max(0.0, now - report.heard)
            for head in report.heads:
                aged = RoomHead.at(head.slice, _first(head), age, router_id)
                kept = by_slice.setdefault(head.slice, [])
                kept.append(aged)
                kept.sort(key=_first)
                del kept[2:]
        ranked = sorted(by_slice.values(), key=lambda kept: _first(kept[0]))
        return [head for kept in ranked for head in kept][:MAX_CLUSTER_HEADS]


def _first(head: RoomHead) -> tuple[int, float]:
    """A head's place in the rooms' order, on a clock at 0 when its times were counted."""
    return head.urgency(0.0)


class LoadRelayCollector(Collector):
    """The relay's counters and size on /metrics."""

    def __init__(self, relay: LoadRelay) -> None:
        self._relay = relay

    def collect(self) -> Iterator[Metric]:
        yield kind_counter(
            "prism_brain_router_load", "Router load relay events by kind (see brain/_load_relay.py)", self._relay.counts
        )
        yield GaugeMetricFamily(
            "prism_brain_router_load_routers", "Routers whose queued prefill is in the sums", value=self._relay.routers
        )
