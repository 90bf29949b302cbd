"""Kubernetes readiness probing as the gateways' baselines see their pods: a probe every `period_s`; a pod
leaves the ready set after `failure_threshold` failed probes in a row and comes back on one success."""

from __future__ import annotations

from collections.abc import Sequence

from .._types import ClusterView


class Readiness:
    """The ready set of a baseline's pods, kept up to date by `tick` (a probe answers when the node's stats do)."""

    def __init__(self, period_s: float, failure_threshold: int) -> None:
        self.period_s = period_s
        self.failure_threshold = failure_threshold
        self.ready: set[str] = set()
        self._fails: dict[str, int] = {}
        self._next_probe = 0.0

    def start(self, names: Sequence[str], now: float) -> set[str]:
        """Every pod ready, the first probe now; returns the ready set, which `tick` changes in place."""
        self.ready = set(names)
        self._fails = dict.fromkeys(names, 0)
        self._next_probe = now
        return self.ready

    def tick(self, view: ClusterView, now: float) -> None:
        """Probe every pod when a probe is due."""
        if now < self._next_probe:
            return
        for name in self._fails:
            if view.stats(name) is not None:
                self._fails[name] = 0
                self.ready.add(name)
            else:
                self._fails[name] += 1
                if self._fails[name] >= self.failure_threshold:
                    self.ready.discard(name)
        self._next_probe += self.period_s
