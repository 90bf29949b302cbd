"""The admin API's view of a running brain: read-only snapshots and mutations run on the loop thread."""

from __future__ import annotations

import dataclasses
import time
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import msgspec

from ._admin import AdminError
from ._weights import published_admit

if TYPE_CHECKING:
    from ._brain import Brain


class Backend:
    """Implements the admin API (see `_admin.py`) over one `Brain`."""

    def __init__(self, brain: Brain) -> None:
        self._brain = brain

    def status(self) -> dict[str, Any]:
        brain = self._brain
        table = brain.current
        weights: dict[str, dict[str, float]] = {}
        if table is not None:
            for slice_table in table.slices:
                for node in slice_table.nodes:
                    per_node = weights.setdefault(node.node_id, {})
                    per_node[slice_table.name] = max(per_node.get(slice_table.name, 0.0), node.weight)
        guardian, shed = brain.control.guardian.flags()
        now = time.monotonic()
        nodes = []
        for node_id, state in sorted(list(brain.registry.nodes.items())):
            # the node's worst slice, predicted beside observed (any latency entry), as one number for `prism top`
            predicted = brain.predictions.get(node_id, {}).values()
            observed = [entry.ttft_p99_ms for entry in state.vector.latency.values() if entry.ttft_p99_ms is not None]
            nodes.append(
                {
                    "node_id": node_id,
                    "zone": state.vector.zone,
                    "endpoint": state.vector.endpoint,
                    "health": state.health.score,
                    "alarms": list(state.health.alarms),
                    "drained": node_id in brain.drained,
                    "weights": weights.get(node_id, {}),
                    "predicted_p99_ms": max(predicted, default=None),
                    "observed_p99_ms": max(observed, default=None),
                    "stall_ms": state.published_stall_ms,
                    "admit_ms": published_admit(state.vector),
                    "age_s": now - state.last_seen,
                }
            )
        return {
            "epoch": brain.tables.epoch,
            "version": brain.tables.version,
            "guardian": guardian,
            "shed_classes": shed,
            "predictor": brain.predictor.best(),
            "nodes": nodes,
            "zones": {
                "decided_by": brain.zones.scheduler.source,
                "observed": [dataclasses.asdict(o) for o in brain.zones.observations],
                "split": msgspec.to_builtins(table.zones) if table is not None else [],
            },
        }

    def table(self) -> dict[str, Any] | None:
        current = self._brain.current
        return msgspec.to_builtins(current) if current is not None else None

    def events(self) -> list[dict[str, Any]]:
        control = self._brain.control
        drift = [{"kind": "drift", **msgspec.to_builtins(dataclasses.asdict(e))} for e in list(control.drift.events)]
        guardian = [{"kind": "guardian", **dataclasses.asdict(t)} for t in list(control.guardian.transitions)]
        return sorted(drift + guardian, key=lambda e: e["at_s"])

    def experiments(self) -> list[dict[str, Any]]:
        return [msgspec.to_builtins(e) for e in self._brain.experiments.snapshot()]

    def drain(self, node_id: str, drained: bool) -> dict[str, Any]:
        brain = self._brain
        if drained and node_id not in brain.registry.nodes:
            raise AdminError(HTTPStatus.NOT_FOUND, f"no live node {node_id!r}")
        (brain.drained.add if drained else brain.drained.discard)(node_id)
        return {"node_id": node_id, "drained": drained}

    def set_experiment(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        slice_name, arms = body.get("slice"), body.get("arms")
        if not isinstance(slice_name, str) or not isinstance(arms, dict) or not arms:
            raise AdminError(HTTPStatus.BAD_REQUEST, 'expected {"slice": NAME, "arms": {VERSION: FRACTION, ...}}')
        experiment = self._brain.experiments.set(name, slice_name, {str(k): float(v) for k, v in arms.items()})
        return {"experiment": msgspec.to_builtins(experiment), "revision": self._brain.experiments.revision}

    def remove_experiment(self, name: str) -> dict[str, Any]:
        if not self._brain.experiments.remove(name):
            raise AdminError(HTTPStatus.NOT_FOUND, f"no experiment {name!r}")
        return {"removed": name, "revision": self._brain.experiments.revision}
