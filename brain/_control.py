"""The brain's control step every 5 s: per-group P99 to the drift detector, cluster P99 and load to the
SLO guardian."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from prismlb.semantics import Slice
from prismlb.wire import Experiment

from ._drift import DriftDetector, DriftEvent, Group, node_dimensions
from ._guardian import Guardian
from ._registry import NodeState

_log = logging.getLogger("prism.brain")


_SLICES = frozenset(s.value for s in Slice)


class Control:
    """Feeds drift and the guardian from the live nodes; `step` runs every control period."""

    def __init__(self, drift: DriftDetector, guardian: Guardian) -> None:
        self.drift = drift
        self.guardian = guardian
        drift.subscribe(self._log_drift)

    def step(self, now_s: float, nodes: Mapping[str, NodeState], experiments: list[Experiment]) -> None:
        arms_by_slice = {e.slice: {arm.model_version for arm in e.arms} for e in experiments}
        weighted = requests = errors = 0.0
        qps = 0.0
        seen_qps = False
        for state in nodes.values():
            vector = state.vector
            if vector.metrics.requests_per_s is not None:
                qps += vector.metrics.requests_per_s
                seen_qps = True
            dimensions = node_dimensions(vector.metrics)
            version = vector.labels.get("model_version", "")
            for key, latency in vector.latency.items():
                p99 = latency.ttft_p99_ms if latency.ttft_p99_ms is not None else latency.e2e_p99_ms
                if p99 is None or key not in _SLICES or latency.requests <= 0:
                    continue  # the engine-wide "engine" entry has no slice
                arm = version if version in arms_by_slice.get(key, ()) else "all"
                self.drift.observe(Group(key, arm), p99, now_s, float(latency.requests), dimensions)
                weighted += p99 * latency.requests
                requests += latency.requests
                errors += min(latency.errors, latency.requests)
        self.drift.check(now_s)
        p99_ms = weighted / requests if requests else None
        self.guardian.check(now_s, p99_ms, errors / requests if requests else None, qps if seen_qps else None)

    def close(self) -> None:
        """Release what the control step runs in the background: the guardian's scale-out hook thread."""
        self.guardian.close()

    @staticmethod
    def _log_drift(event: DriftEvent) -> None:
        causes = ", ".join(f"{c.kind} {c.name} ({c.score:.1f})" for c in event.causes[:3]) or "no attributed cause"
        _log.warning(
            "P99 drift in %s/%s: %.0f ms -> %.0f ms (z %.1f); moved with: %s",
            event.group.slice,
            event.group.arm,
            event.p99_before_ms,
            event.p99_after_ms,
            event.z,
            causes,
        )
