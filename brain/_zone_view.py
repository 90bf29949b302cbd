"""What the brain knows of each zone every cycle, and the zone split it publishes from it (`RoutingTable.zones`).

The registry drops a node a few periods after its last vector, which is right for the rings but would hide an
outage from the failover scheduler: a zone whose nodes vanished would look like a smaller healthy zone. So the view
keeps every node it has seen, with its zone and when it last reported, for `forget_s` after that: `nodes` counts
them, `alive` only those heard within 1.5 of their own periods. The scheduler (`_failover.FailoverScheduler`) turns
the observations into each caller zone's shares; they go out rounded to `STEP` (a split that wobbles by a percent
would otherwise make a new table every cycle) and only while the cluster's nodes sit in two or more named zones.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prismlb.wire import ZoneRoute, ZoneShare

from ._failover import FailoverScheduler, ZoneObservation, ZoneSplit
from ._registry import NodeState

FORGET_S = 600.0
"""How long a node that stopped reporting still counts in its zone's `nodes`."""
ALIVE_PERIODS = 1.5
"""A node is alive while its last vector is at most this many of its periods old."""
STEP = 0.05
"""Shares are published in steps of this size."""
DEMAND_SMOOTHING_S = 10.0
"""Time constant of the exponential average of each zone's demand share: the routers' queued prefill is a snapshot
of a moment (one burst in one zone would read as all the cluster's demand), the split needs the sustained share."""


def quantised(row: Mapping[str, float]) -> list[ZoneShare]:
    """A caller zone's shares in steps of `STEP`, summing to 1 (largest remainders first), zero shares left out, in
    the zones' name order: every brain and router lays the same keys over the same intervals."""
    steps = round(1 / STEP)
    total = sum(v for v in row.values() if v > 0) or 1.0
    exact = {zone: max(0.0, v) / total * steps for zone, v in row.items()}
    counts = {zone: int(v) for zone, v in exact.items()}
    for zone in sorted(exact, key=lambda z: (counts[z] - exact[z], z))[: steps - sum(counts.values())]:
        counts[zone] += 1
    return [ZoneShare(zone=zone, fraction=count / steps) for zone, count in sorted(counts.items()) if count]


class ZoneView:
    """The zones' observations and the published split. Single-threaded: the brain's cycle calls it."""

    def __init__(self, scheduler: FailoverScheduler, forget_s: float = FORGET_S) -> None:
        self.scheduler = scheduler
        self.forget_s = forget_s
        self._seen: dict[str, tuple[str, float, float]] = {}  # node id -> (zone, last seen, its period)
        self._demand: dict[str, float] = {}  # zone -> smoothed demand share
        self._demand_at: float | None = None
        self.observations: list[ZoneObservation] = []
        """The last cycle's observations (for the admin API and tests)."""

    def routes(
        self,
        nodes: Mapping[str, NodeState],
        weights: Mapping[str, float],
        demand: Mapping[str, float],
        now: float,
    ) -> list[ZoneRoute]:
        """The split for this cycle from the live nodes, each node's highest table weight and the callers' demand
        share by zone (`LoadRelay.demand_by_zone`; empty: equal shares); [] while fewer than two named zones hold
        nodes, or when any node names none."""
        for node_id, state in nodes.items():
            self._seen[node_id] = (state.vector.zone, state.last_seen, state.vector.period_s)
        for node_id in [n for n, (_, seen, _) in self._seen.items() if now - seen > self.forget_s]:
            del self._seen[node_id]
        zones = sorted({zone for zone, _, _ in self._seen.values()})
        if len(zones) < 2 or "" in zones:
            self.observations = []
            return []
        self.observations = self._observe(zones, nodes, weights, self._smoothed(zones, demand, now), now)
        split = self.scheduler.split(self.observations, now)
        return self.rows(split)

    def _smoothed(self, zones: Sequence[str], demand: Mapping[str, float], now: float) -> dict[str, float]:
        """Each zone's demand share (equal shares when no router names a zone of these), averaged over time with
        `DEMAND_SMOOTHING_S`; a zone new to the view starts at its share of this cycle."""
        known = sum(demand.get(zone, 0.0) for zone in zones)
        shares = {zone: demand.get(zone, 0.0) / known if known > 0 else 1.0 / len(zones) for zone in zones}
        dt = 0.0 if self._demand_at is None else max(0.0, now - self._demand_at)
        alpha = 1.0 - math.exp(-dt / DEMAND_SMOOTHING_S)
        self._demand = {
            zone: share if zone not in self._demand else self._demand[zone] + alpha * (share - self._demand[zone])
            for zone, share in shares.items()
        }
        self._demand_at = now
        return self._demand

    def _observe(
        self,
        zones: Sequence[str],
        nodes: Mapping[str, NodeState],
        weights: Mapping[str, float],
        demand: Mapping[str, float],
        now: float,
    ) -> list[ZoneObservation]:
        total = sum(demand.values()) or 1.0
        known: dict[str, int] = dict.fromkeys(zones, 0)
        live: dict[str, list[NodeState]] = {zone: [] for zone in zones}
        for node_id, (zone, seen, period) in self._seen.items():  # one pass over every node, not one per zone
            known[zone] += 1
            if node_id in nodes and now - seen <= ALIVE_PERIODS * period:
                live[zone].append(nodes[node_id])
        observations = []
        for zone in zones:
            alive = live[zone]
            p99s = [
                latency.ttft_p99_ms
                for state in alive
                for latency in state.vector.latency.values()
                if latency.ttft_p99_ms is not None
            ]
            waiting = [state.vector.metrics.requests_waiting or 0 for state in alive]
            observations.append(
                ZoneObservation(
                    zone=zone,
                    nodes=known[zone],
                    alive=len(alive),
                    weight=sum(weights.get(s.vector.node_id, 0.0) for s in alive) / len(alive) if alive else 0.0,
                    p99_ms=max(p99s, default=0.0),
                    queue=sum(waiting) / len(waiting) if waiting else 0.0,
                    demand=demand[zone] / total,
                )
            )
        return observations

    @staticmethod
    def rows(split: ZoneSplit) -> list[ZoneRoute]:
        return [
            ZoneRoute(caller=caller, shares=quantised(row))
            for caller, row in sorted(split.items())
            if sum(max(0.0, v) for v in row.values()) > 0
        ]


class ZoneViewCollector(Collector):
    """The failover scheduler's decisions, fallbacks and model reloads, and each zone's nodes, on /metrics."""

    def __init__(self, view: ZoneView) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        counts = dict(self._view.scheduler.counts)
        decisions = CounterMetricFamily(
            "prism_brain_failover_decisions", "Zone splits decided, by who decided them", labels=["by"]
        )
        for by in ("student", "rule"):
            decisions.add_metric([by], counts.get(by, 0))
        yield decisions
        fallbacks = CounterMetricFamily(
            "prism_brain_failover_fallbacks",
            "Zone splits the rule decided instead of the student, by reason (brain/_failover.py)",
            labels=["reason"],
        )
        for name, value in sorted(counts.items()):
            if name.startswith("fallback_"):
                fallbacks.add_metric([name.removeprefix("fallback_")], value)
        yield fallbacks
        yield CounterMetricFamily(
            "prism_brain_failover_reloads", "Failover student models loaded after the start", value=counts["reloads"]
        )
        yield CounterMetricFamily(
            "prism_brain_failover_reload_errors",
            "Failover student model files that could not be loaded",
            value=counts["reload_errors"],
        )
        nodes = GaugeMetricFamily(
            "prism_brain_zone_nodes", "Nodes known per zone, and those alive", labels=["zone", "state"]
        )
        for observation in self._view.observations:
            nodes.add_metric([observation.zone, "known"], observation.nodes)
            nodes.add_metric([observation.zone, "alive"], observation.alive)
        yield nodes
