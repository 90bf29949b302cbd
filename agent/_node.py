"""The node vector's contents: each source read at its own period, its latest reading kept until
it goes stale, and the vector made of whatever is present. The agent measures; the brain judges health and
alarms from these measurements, so one authority decides what a reading means.

A source is the seam between the agent and what it reads: `prism agent` plugs psutil, NVML, eBPF, the engine's
`/metrics` and its request spans; the cluster replay (`prismlb.sim`) plugs readers of its simulated engines into
the same sampler, so its brain sees what an agent would send."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from prismlb.wire import GpuState, KvSummary, ModalityLatency, NodeMetrics, NodeVector

_log = logging.getLogger("prism.agent")

_METRIC_FIELDS = frozenset(f.name for f in msgspec.structs.fields(NodeMetrics))
_EARLY_S = 0.01  # a tick this close before a source's due time runs it


@dataclass
class Reading:
    """One source's output: NodeMetrics fields (None = not measured) and, for some sources, vector parts."""

    metrics: dict[str, float | int | None] = field(default_factory=dict)
    gpus: list[GpuState] | None = None
    kv: KvSummary | None = None
    latency: dict[str, ModalityLatency] | None = None


@dataclass
class Source:
    """A named reader run every `period_s`; its reading expires after `stale_periods` periods without a new one."""

    name: str
    period_s: float
    read: Callable[[], Reading]
    stale_periods: float = 3.0


@dataclass
class NodeState:
    """Everything the agent knows about its node right now."""

    metrics: NodeMetrics
    gpus: list[GpuState]
    kv: KvSummary | None
    latency: dict[str, ModalityLatency]


class NodeSampler:
    """Runs due sources on each `tick(now)` and merges their latest readings; a failing source logs once
    per kind of failure and its dimensions stay absent until it reads again."""

    def __init__(self, sources: Sequence[Source]) -> None:
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names repeat: {names}")
        self.sources = list(sources)
        self._due: dict[str, float] = {s.name: float("-inf") for s in sources}
        self._latest: dict[str, tuple[float, Reading]] = {}
        self._failures: dict[str, set[str]] = {s.name: set() for s in sources}
        self.failures_total: dict[str, int] = {s.name: 0 for s in sources}

    def tick(self, now: float) -> NodeState:
        for source in self.sources:
            due = self._due[source.name]
            if now >= due - _EARLY_S:
                # Keep each source on its own grid, so jitter in the caller's ticks never skips a period.
                following = due + source.period_s
                self._due[source.name] = following if following > now else now + source.period_s
                self._run(source, now)
        return self._state(now)

    def _run(self, source: Source, now: float) -> None:
        try:
            reading = source.read()
            if not _METRIC_FIELDS.issuperset(reading.metrics):
                raise ValueError(f"unknown metrics {sorted(set(reading.metrics) - _METRIC_FIELDS)}")
        except Exception as exc:  # a collector bug or a device error must not stop the agent
            self.failures_total[source.name] += 1
            kind = type(exc).__name__
            if kind not in self._failures[source.name]:
                self._failures[source.name].add(kind)
                _log.warning("source %s failed (%s: %s); its dimensions stay absent", source.name, kind, exc)
            return
        self._latest[source.name] = (now, reading)

    def _fresh(self, now: float) -> list[Reading]:
        fresh = []
        for source in self.sources:
            entry = self._latest.get(source.name)
            if entry is not None and now - entry[0] <= source.stale_periods * source.period_s:
                fresh.append(entry[1])
        return fresh

    def _state(self, now: float) -> NodeState:
        values: dict[str, Any] = {}
        gpus: list[GpuState] = []
        kv: KvSummary | None = None
        latency: dict[str, ModalityLatency] = {}
        for reading in self._fresh(now):
            values.update({k: v for k, v in reading.metrics.items() if v is not None})
            gpus = reading.gpus if reading.gpus is not None else gpus
            kv = reading.kv if reading.kv is not None else kv
            latency.update(reading.latency or {})
        return NodeState(metrics=NodeMetrics(**values), gpus=gpus, kv=kv, latency=latency)


def to_vector(
    state: NodeState,
    *,
    node_id: str,
    host: str,
    endpoint: str,
    zone: str = "",
    labels: Mapping[str, str],
    seq: int,
    sample_time_unix_s: float,
    period_s: float,
    started_unix_s: float | None,
) -> NodeVector:
    """The node vector of `state` for the node named by `node_id`, `host`, `endpoint`, `zone` and `labels`: what
    the agent sends every `period_s`, numbered `seq` since it started at `started_unix_s`."""
    return NodeVector(
        node_id=node_id,
        host=host,
        endpoint=endpoint,
        zone=zone,
        labels=dict(labels),
        seq=seq,
        sample_time_unix_s=sample_time_unix_s,
        period_s=period_s,
        metrics=state.metrics,
        started_unix_s=started_unix_s,
        latency=state.latency,
        gpus=state.gpus,
        kv=state.kv,
    )
