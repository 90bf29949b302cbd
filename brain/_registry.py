"""The brain's view of live nodes: latest vector per node, staleness, and the weights it holds per table entry."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prismlb.semantics import STALL_SMOOTHING_S, Health, Slice, health, network_stall_ms
from prismlb.wire import FutureSampleError, NodeMetrics, NodeVector

_log = logging.getLogger("prism.brain")

ALARM_DERATE = 0.5
MAX_CLOCK_SKEW_S = 30.0
"""How far ahead of the brain's clock a vector's sample time may be: more is refused, so a vector stamped in
the future (a spoofed one, or a host with a broken clock) can hold off its node's real vectors (which look
older) for at most this long."""
QUALITY_SMOOTHING_S = STALL_SMOOTHING_S
"""Time constant of the exponential averages of a node's quality and network stall (the stall's, shared with the
routers' own): one window's noise cannot swing its weight or its expected time."""


def quality(h: Health) -> float:
    """Health × 0.5 per alarming dimension: what a node's weight is made of besides its latency."""
    return h.score * ALARM_DERATE ** len(h.alarms)


def stall_ms(metrics: NodeMetrics) -> float | None:
    """The network stall one request on the node can expect: the segments its host retransmitted per request it
    served, each a retransmission timeout (`semantics.network_stall_ms`). None without both rates (no eBPF tracer,
    no requests).

    A time to add, not a factor: a lost segment costs a short request what it costs a long one, which the health
    score's share of the weight (a stretch of the expected time) cannot say."""
    retransmits, requests = metrics.tcp_retransmits_per_s, metrics.requests_per_s
    if retransmits is None or not requests:
        return None
    return network_stall_ms(retransmits, requests)


MAX_ADMIT_MS = 60_000.0
"""The longest wait for cache room published: a minute says the node is full, and its health and circuit breaker
say the rest."""


def admit_ms(metrics: NodeMetrics) -> float | None:
    """The wait for room in the node's KV cache a new request can expect there; None while the cache has room for
    it and every request waiting, or when the engine does not tell.

    The running requests hold `kv_cache_usage_ratio` of the cache between them (the engine's count, in which a
    cached block no request holds is free), so its free rest holds `(1 - usage) / usage × running` more requests
    of their mean size. The waiting requests and the new one past that many wait for running ones to end, the
    k-th past it for k ends, and requests end at `requests_per_s`: the wait is that count, rounded up, over the
    pace. No threshold says when a cache is full: a cache with room for every waiting request gives None however
    busy the node, and a prefill-bound engine's waiting requests are what the routers' queued prompt tokens
    count already. With long replies a full cache admits nothing until one ends, however short the prefill
    queue, and this is how the routers see it."""
    usage, running, waiting, pace = (
        metrics.kv_cache_usage_ratio,
        metrics.requests_running,
        metrics.requests_waiting,
        metrics.requests_per_s,
    )
    if usage is None or waiting is None or not running or not pace or usage <= 0:
        return None
    short = waiting + 1 - (1 - usage) / usage * running
    if short <= 0:
        return None
    return min(math.ceil(short) / pace * 1000, MAX_ADMIT_MS)


EntryKey = tuple[Slice, int | None]
"""A node's table entry: its slice and, in topology-aware slices, its GPU index (None: the whole node)."""


@dataclass
class NodeState:
    vector: NodeVector
    last_seen: float
    health: Health
    weights: dict[EntryKey, float] = field(default_factory=dict)  # held by compute_weights (hysteresis)
    prefill_rate: float | None = None  # held by prefill_rates (hysteresis)
    quality: float = math.nan
    """`quality(health)` averaged over the node's vectors with time constant QUALITY_SMOOTHING_S."""
    stall_ms: float | None = None
    """`stall_ms` averaged over the node's vectors that measure it, with the same time constant."""
    published_stall_ms: float | None = None  # held by compute_weights (hysteresis)
    measured_rate: float | None = None
    """The node's latest measured prefill speed: `NodeMetrics.prefill_tokens_per_s` of the last vector that carried
    one. An agent measures it only over enough requests (`agent._engine.MIN_PREFILL_REQUESTS`), so a node that prefills
    little measures it seldom, and keeps it in between."""

    def __post_init__(self) -> None:
        if math.isnan(self.quality):
            self.quality = quality(self.health)
        if self.stall_ms is None:
            self.stall_ms = stall_ms(self.vector.metrics)
        if self.measured_rate is None:
            self.measured_rate = self.vector.metrics.prefill_tokens_per_s or None

    def smooth(self) -> None:
        """Move the averages towards the current vector's quality and stall over one of its periods."""
        keep = math.exp(-self.vector.period_s / QUALITY_SMOOTHING_S)
        self.quality = keep * self.quality + (1 - keep) * quality(self.health)
        stall = stall_ms(self.vector.metrics)
        if stall is not None:
            self.stall_ms = stall if self.stall_ms is None else keep * self.stall_ms + (1 - keep) * stall
        self.measured_rate = self.vector.metrics.prefill_tokens_per_s or self.measured_rate


class Registry:
    """Live nodes keyed by node id; `now` values are monotonic seconds supplied by the caller."""

    def __init__(self, stale_periods: float = 3.0, wall_clock: Callable[[], float] = time.time) -> None:
        self.stale_periods = stale_periods
        self.wall_clock = wall_clock
        """Unix seconds the vectors' sample times are checked against (a simulation passes its own)."""
        self.nodes: dict[str, NodeState] = {}
        self.replayed = 0

    def update(self, vector: NodeVector, now: float) -> bool:
        """Take a vector (True); an older or repeated sample of a known node is counted and ignored (False).

        Raises FutureSampleError for a sample time more than MAX_CLOCK_SKEW_S ahead of `wall_clock`."""
        if vector.sample_time_unix_s > self.wall_clock() + MAX_CLOCK_SKEW_S:
            raise FutureSampleError(
                f"node {vector.node_id}: sample time {vector.sample_time_unix_s:.0f} is more than "
                f"{MAX_CLOCK_SKEW_S:g} s ahead of this brain's clock"
            )
        state = self.nodes.get(vector.node_id)
        h = health(vector.metrics)
        if state is None:
            self.nodes[vector.node_id] = NodeState(vector, now, h)
            _log.info("node %s joined (endpoint %s)", vector.node_id, vector.endpoint)
            return True
        if vector.sample_time_unix_s <= state.vector.sample_time_unix_s and vector.seq <= state.vector.seq:
            self.replayed += 1
            return False
        previous_alarms = state.health.alarms
        state.vector, state.last_seen, state.health = vector, now, h
        state.smooth()
        if h.alarms != previous_alarms:
            _log.info("node %s alarms: %s", vector.node_id, ", ".join(h.alarms) or "none")
        return True

    def expire(self, now: float) -> list[str]:
        """Drop and return nodes silent for more than `stale_periods` of their own period."""
        gone = [
            node_id
            for node_id, state in self.nodes.items()
            if now - state.last_seen > self.stale_periods * state.vector.period_s
        ]
        for node_id in gone:
            state = self.nodes.pop(node_id)
            _log.info(
                "node %s stale: no vector for %.1f s (%g periods), removed",
                node_id,
                now - state.last_seen,
                self.stale_periods,
            )
        return gone
