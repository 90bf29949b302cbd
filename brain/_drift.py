"""P99 drift: change points in each group's 5-second P99 and the changes that moved with them.

A group is a slice and an experiment arm (or "all"). Observations `(group, p99_ms, at_s)` fall into 5 s windows
aligned on `at_s`; a window's P99 is the request-weighted mean of the P99s observed in it, and its node
dimensions the plain mean of the nodes' values. `check(now_s)` closes the windows that ended at least
`LATE_S` before `now_s`; observations that are not finite, for a closed window, or more than `AHEAD_WINDOWS`
(12, a minute) past the last check are counted in `dropped` and ignored.

Detection: the trailing baseline is the group's last `BASELINE_WINDOWS` (24, two minutes) closed windows;
detection starts once it holds `MIN_BASELINE` (12). A window's Z-score is (P99 − baseline mean) / baseline
std, the std floored at 2% of the mean and 1 ms so a flat baseline does not turn a millisecond into a
change. A change point needs `CONFIRM_WINDOWS` (2) windows in a row past ±3.5 in the same direction, so a
lone spike is absorbed into the baseline; after an event the baseline restarts from the confirming windows,
so one step fires one event.

Attribution ranks candidates by their own Z-scores, keeping those at 2 or more, at most 8:
- node dimensions: (mean over the confirming windows − baseline mean) / baseline std (floored at 2% of the
  mean and 1e-3), absolute value;
- configuration and version changes noted with `note_change`: a Poisson Z-score of how many times each
  (kind, name) happened from `LEAD_S` (10 s, the agents' latency window) before the change point to its end,
  against its rate over the baseline (with half a change as prior, so a first-ever change scores about 3).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import msgspec

from prismlb.wire import NodeMetrics

_log = logging.getLogger("prism.brain")

WINDOW_S = 5.0
LATE_S = 2.0
AHEAD_WINDOWS = 12
BASELINE_WINDOWS = 24
MIN_BASELINE = 12
CONFIRM_WINDOWS = 2
Z_THRESHOLD = 3.5
LEAD_S = 10.0
CAUSE_MIN_SCORE = 2.0
MAX_CAUSES = 8
MAX_CHANGES = 4096
_SKIPPED_DIMENSIONS = frozenset({"connect_calls_total", "mem_total_bytes", "gpu_mem_total_bytes", "gpu_count"})

ChangeKind = Literal["config", "version"]


class Group(NamedTuple):
    slice: str
    arm: str = "all"


class Cause(NamedTuple):
    kind: str  # "dimension", "config" or "version"
    name: str
    score: float


@dataclass(frozen=True)
class DriftEvent:
    """A change point at `at_s`; `z` is the confirming windows' mean P99 against the baseline, causes ranked."""

    group: Group
    at_s: float
    z: float
    p99_before_ms: float
    p99_after_ms: float
    causes: tuple[Cause, ...]


def node_dimensions(metrics: NodeMetrics) -> dict[str, float]:
    """A node's present metrics that can move with latency (no cumulative counters or capacities)."""
    return {
        name: float(value)
        for name, value in msgspec.structs.asdict(metrics).items()
        if value is not None and name not in _SKIPPED_DIMENSIONS
    }


@dataclass
class _Window:
    start_s: float
    weight: float = 0.0
    p99_sum: float = 0.0
    dims: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]

    @property
    def p99_ms(self) -> float:
        return self.p99_sum / self.weight

    def dimension(self, name: str) -> float | None:
        total = self.dims.get(name)
        return total[0] / total[1] if total else None


@dataclass
class _GroupState:
    open: dict[int, _Window] = field(default_factory=dict)
    baseline: deque[_Window] = field(default_factory=lambda: deque(maxlen=BASELINE_WINDOWS))
    pending: list[tuple[_Window, float]] = field(default_factory=list)


def _zscore(value: float, reference: Iterable[float], floor: float) -> float:
    values = list(reference)
    mean = statistics.fmean(values)
    std = statistics.pstdev(values, mean) if len(values) > 1 else 0.0
    return (value - mean) / max(std, 0.02 * abs(mean), floor)


def _poisson_z(observed: int, baseline_count: int, baseline_s: float, span_s: float) -> float:
    expected = (baseline_count + 0.5) / max(baseline_s, WINDOW_S) * span_s
    return (observed - expected) / math.sqrt(expected)


class DriftDetector:
    """Feeds: `observe` per group P99, `note_change` per configuration or version change; `check` each cycle."""

    def __init__(self, keep_events: int = 100) -> None:
        self.events: deque[DriftEvent] = deque(maxlen=keep_events)
        self.dropped = 0
        self._closed_before: int | None = None  # windows with a lower index were closed by the last check
        self._groups: dict[Group, _GroupState] = {}
        self._changes: deque[tuple[float, ChangeKind, str]] = deque(maxlen=MAX_CHANGES)
        self._listeners: list[Callable[[DriftEvent], None]] = []

    def subscribe(self, listener: Callable[[DriftEvent], None]) -> None:
        """Call `listener` with every new event (from `check`'s thread; exceptions are logged)."""
        self._listeners.append(listener)

    def observe(
        self,
        group: Group,
        p99_ms: float,
        at_s: float,
        requests: float = 1.0,
        dimensions: Mapping[str, float] | None = None,
    ) -> None:
        """One P99 seen for `group` at `at_s` (weighted by `requests`), with the reporting node's dimensions."""
        if not (math.isfinite(p99_ms) and math.isfinite(at_s) and math.isfinite(requests) and requests > 0):
            self.dropped += 1
            return
        index = math.floor(at_s / WINDOW_S)
        if self._closed_before is not None and not (
            self._closed_before <= index <= self._closed_before + AHEAD_WINDOWS
        ):
            self.dropped += 1
            return
        state = self._groups.setdefault(group, _GroupState())
        window = state.open.setdefault(index, _Window(index * WINDOW_S))
        window.weight += requests
        window.p99_sum += p99_ms * requests
        for name, value in (dimensions or {}).items():
            if math.isfinite(value):
                total = window.dims.setdefault(name, [0.0, 0.0])
                total[0] += value
                total[1] += 1

    def note_change(self, kind: ChangeKind, name: str, at_s: float) -> None:
        """A configuration change (experiment revision, table) or a version change (a node's model_version)."""
        self._changes.append((at_s, kind, name))

    def check(self, now_s: float) -> list[DriftEvent]:
        """Close every window that ended `LATE_S` before `now_s`; return (and emit) the new events."""
        closable = math.floor((now_s - LATE_S) / WINDOW_S)
        if self._closed_before is not None:
            closable = max(closable, self._closed_before)
        self._closed_before = closable
        events = []
        for group, state in self._groups.items():
            for index in sorted(i for i in state.open if i < closable):
                event = self._close(group, state, state.open.pop(index))
                if event is not None:
                    events.append(event)
        horizon = now_s - (BASELINE_WINDOWS + CONFIRM_WINDOWS + 2) * WINDOW_S - LEAD_S
        while self._changes and self._changes[0][0] < horizon:
            self._changes.popleft()
        for event in events:
            self._emit(event)
        return events

    def _close(self, group: Group, state: _GroupState, window: _Window) -> DriftEvent | None:
        if len(state.baseline) < MIN_BASELINE:
            state.baseline.append(window)
            return None
        z = _zscore(window.p99_ms, (w.p99_ms for w in state.baseline), 1.0)
        if abs(z) <= Z_THRESHOLD or (state.pending and (z > 0) != (state.pending[0][1] > 0)):
            state.baseline.extend(w for w, _ in state.pending)
            state.pending.clear()
            if abs(z) <= Z_THRESHOLD:
                state.baseline.append(window)
                return None
        state.pending.append((window, z))
        if len(state.pending) < CONFIRM_WINDOWS:
            return None
        after = [w for w, _ in state.pending]
        before = list(state.baseline)
        p99_before = statistics.fmean(w.p99_ms for w in before)
        p99_after = statistics.fmean(w.p99_ms for w in after)
        event = DriftEvent(
            group=group,
            at_s=after[0].start_s,
            z=_zscore(p99_after, (w.p99_ms for w in before), 1.0),
            p99_before_ms=p99_before,
            p99_after_ms=p99_after,
            causes=self._attribute(before, after),
        )
        state.baseline = deque(after, maxlen=BASELINE_WINDOWS)
        state.pending.clear()
        return event

    def _attribute(self, before: list[_Window], after: list[_Window]) -> tuple[Cause, ...]:
        causes = []
        for name in sorted({n for w in after for n in w.dims}):
            base = [v for w in before if (v := w.dimension(name)) is not None]
            now = [v for w in after if (v := w.dimension(name)) is not None]
            if len(base) >= MIN_BASELINE // 2 and now:
                causes.append(Cause("dimension", name, abs(_zscore(statistics.fmean(now), base, 1e-3))))
        span_start = after[0].start_s - LEAD_S
        span_end = after[-1].start_s + WINDOW_S
        baseline_start = before[0].start_s
        counts: dict[tuple[ChangeKind, str], list[int]] = {}
        for at_s, kind, name in self._changes:
            if baseline_start <= at_s < span_end:
                counts.setdefault((kind, name), [0, 0])[int(at_s >= span_start)] += 1
        for (kind, name), (in_baseline, in_span) in sorted(counts.items()):
            if in_span:
                score = _poisson_z(in_span, in_baseline, span_start - baseline_start, span_end - span_start)
                causes.append(Cause(kind, name, score))
        ranked = sorted((c for c in causes if c.score >= CAUSE_MIN_SCORE), key=lambda c: -c.score)
        return tuple(ranked[:MAX_CAUSES])

    def _emit(self, event: DriftEvent) -> None:
        self.events.append(event)
        _log.info(
            "P99 drift in %s/%s at %.0f: %.0f ms -> %.0f ms (z %.1f); causes: %s",
            event.group.slice,
            event.group.arm,
            event.at_s,
            event.p99_before_ms,
            event.p99_after_ms,
            event.z,
            ", ".join(f"{c.kind} {c.name} ({c.score:.1f})" for c in event.causes) or "none ranked",
        )
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                _log.exception("drift listener %r failed", listener)
