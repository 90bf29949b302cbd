"""Prometheus view of a router: the table in use, and each endpoint's load and health as this caller sees it."""

from __future__ import annotations

import bisect
import threading
from typing import TYPE_CHECKING, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

if TYPE_CHECKING:
    from ._router import Router


ROUND_TRIP_BUCKETS_S: Final = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
"""Upper bounds of the tokenize round trip's histogram: from a loopback hop to the tokenizer's timeout."""


class RoundTrips:
    """The engines' `/tokenize` round trips made for this router's requests (`EngineTokenizer`): their seconds, in
    a histogram, and how many failed. Any thread records; the collector reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.buckets = [0] * (len(ROUND_TRIP_BUCKETS_S) + 1)
        """Round trips per bucket of `ROUND_TRIP_BUCKETS_S`, the last past them all (not cumulative)."""
        self.seconds = 0.0
        self.failed = 0

    def record(self, seconds: float, ok: bool) -> None:
        with self._lock:
            self.buckets[bisect.bisect_left(ROUND_TRIP_BUCKETS_S, seconds)] += 1
            self.seconds += seconds
            self.failed += not ok

    def families(self) -> list[Metric]:
        with self._lock:
            counts, seconds, failed = list(self.buckets), self.seconds, self.failed
        cumulative, running = [], 0
        for bound, count in zip((*map(str, ROUND_TRIP_BUCKETS_S), "+Inf"), counts, strict=True):
            running += count
            cumulative.append((bound, running))
        trips = HistogramMetricFamily(
            "prism_router_tokenize_seconds",
            "Round trips to an engine's /tokenize for a text request's token ids, answered or failed",
            buckets=cumulative,
            sum_value=seconds,
        )
        failures = CounterMetricFamily(
            "prism_router_tokenize_failures",
            "Of those round trips, the ones that gave no ids (the request kept its text blocks; rejects say why)",
            value=failed,
        )
        return [trips, failures]


class RouterCollector:
    """Exports the router's state on collection; each table gauge is absent while its value is unknown."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def describe(self) -> list[Metric]:
        return self._table_families(None, None, None, None)

    def collect(self) -> list[Metric]:
        router = self._router
        table = router.table
        families = self._table_families(
            None if table is None else table.epoch,
            None if table is None else table.version,
            router.table_age_s,
            router.last_heard_age_s,
        )
        inflight = GaugeMetricFamily(
            "prism_router_inflight_requests", "Requests in flight from this caller", labels=["endpoint"]
        )
        available = GaugeMetricFamily(
            "prism_router_endpoint_available", "1 when the endpoint takes new requests", labels=["endpoint"]
        )
        circuit = GaugeMetricFamily(
            "prism_router_circuit_state", "Circuit breaker: 0 normal, 1 open, 2 half-open", labels=["endpoint"]
        )
        outcomes = CounterMetricFamily(
            "prism_router_requests", "Requests ended, by outcome", labels=["endpoint", "outcome"]
        )
        speed = GaugeMetricFamily(
            "prism_router_first_token_speed_tokens_per_second",
            "Prompt tokens this caller expected the endpoint to compute over the seconds to their first tokens, "
            "since the start (absent before a first token)",
            labels=["endpoint"],
        )
        retransmitted = CounterMetricFamily(
            "prism_router_retransmitted_segments",
            "TCP segments this caller's connections to the endpoint retransmitted (the kernel's TCP_INFO), read as "
            "each response ended",
            labels=["endpoint"],
        )
        stall = GaugeMetricFamily(
            "prism_router_network_stall_seconds",
            "The network stall those retransmits forecast for a request to the endpoint, added to its expected time "
            "to first token (client_stall)",
            labels=["endpoint"],
        )
        for label, status in router.status().items():
            inflight.add_metric([label], status.inflight)
            retransmitted.add_metric([label], status.retransmitted)
            stall.add_metric([label], status.stall_s)
            available.add_metric([label], float(status.available))
            circuit.add_metric([label], int(status.circuit))
            if status.first_token_speed is not None:
                speed.add_metric([label], status.first_token_speed)
            for outcome, count in sorted(status.outcomes.items()):
                outcomes.add_metric([label, outcome.value], count)
        sessions = GaugeMetricFamily("prism_router_sessions", "Sessions remembered for stickiness")
        sessions.add_metric([], router.sessions)
        waiting = GaugeMetricFamily("prism_router_waiting_requests", "Requests waiting for their turn (hold_tokens)")
        waiting.add_metric([], router.turns.waiting)
        turns = CounterMetricFamily(
            "prism_router_turns",
            "Requests let go from the waiting room: granted (room), expired (hold_max_s), left (given up), passed "
            "(cached, no turn: hold_cached_tokens)",
            labels=["outcome"],
        )
        for outcome, count in router.turns.counts.items():
            turns.add_metric([outcome], count)
        deferred = CounterMetricFamily(
            "prism_router_turns_deferred",
            "Times a waiting room's head found room and left it to a peer router whose head was due sooner "
            "(share_turns)",
            value=router.turns.deferred,
        )
        mismatches = CounterMetricFamily(
            "prism_router_kv_block_size_mismatches",
            "Requests placed on a node whose KV events name blocks of another size than the request's hashes: the "
            "prefix index cannot match that node's cache",
            labels=["node"],
        )
        for node, count in sorted(router.kv_block_size_mismatches.items()):
            mismatches.add_metric([node], count)
        return [
            *families,
            *router.round_trips.families(),
            inflight,
            available,
            circuit,
            outcomes,
            speed,
            retransmitted,
            stall,
            sessions,
            waiting,
            turns,
            deferred,
            mismatches,
        ]

    @staticmethod
    def _table_families(
        epoch: int | None, version: int | None, age_s: float | None, heard_s: float | None
    ) -> list[Metric]:
        gauges = (
            ("prism_router_table_epoch", "Epoch of the routing table in use", epoch),
            ("prism_router_table_version", "Version of the routing table in use", version),
            ("prism_router_table_age_seconds", "Seconds since the routing table in use was applied", age_s),
            ("prism_router_last_heard_age_seconds", "Seconds since a brain was last heard", heard_s),
        )
        families: list[Metric] = []
        for name, help_text, value in gauges:
            family = GaugeMetricFamily(name, help_text)
            if value is not None:
                family.add_metric([], value)
            families.append(family)
        return families
