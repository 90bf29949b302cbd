"""The brain's view of live nodes: latest vector per node, staleness, published weight with hysteresis."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prismlb.wire import Health, NodeVector, health

_log = logging.getLogger("prism.brain")

WEIGHT_STEP = 0.05
WEIGHT_FLOOR = 0.05
HYSTERESIS = 0.075


def _quantise(score: float) -> float:
    return max(WEIGHT_FLOOR, min(1.0, round(score / WEIGHT_STEP) * WEIGHT_STEP))


@dataclass
class NodeState:
    vector: NodeVector
    last_seen: float
    health: Health
    weight: float


class Registry:
    """Live nodes keyed by node id; `now` values are monotonic seconds supplied by the caller."""

    def __init__(self, stale_periods: float = 3.0) -> None:
        self.stale_periods = stale_periods
        self.nodes: dict[str, NodeState] = {}
        self.replayed = 0

    def update(self, vector: NodeVector, now: float) -> None:
        """Take a vector; an older or repeated sample of a known node is counted and ignored."""
        state = self.nodes.get(vector.node_id)
        h = health(vector.metrics)
        if state is None:
            self.nodes[vector.node_id] = NodeState(vector, now, h, _quantise(h.score))
            _log.info("node %s joined (endpoint %s)", vector.node_id, vector.endpoint)
            return
        if vector.sample_time_unix_s <= state.vector.sample_time_unix_s and vector.seq <= state.vector.seq:
            self.replayed += 1
            return
        previous_alarms = state.health.alarms
        state.vector, state.last_seen, state.health = vector, now, h
        if abs(h.score - state.weight) > HYSTERESIS:
            state.weight = _quantise(h.score)
        if h.alarms != previous_alarms:
            _log.info("node %s alarms: %s", vector.node_id, ", ".join(h.alarms) or "none")

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
