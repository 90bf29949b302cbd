"""The SLO guardian: the design's degrade → scale-up → recover state machine, checked every 5 s.

Each check takes the cluster's P99, error ratio and QPS (an absent measure never triggers anything):
- violated: P99 > 800 ms or error ratio > 0.5%;
- overloaded: load factor (QPS / baseline QPS) > 2.1;
- compliant: neither.

| from | on | to | effect |
|---|---|---|---|
| any | violated | DEGRADE | shed every class in `shed_classes`; compliant streak 0 |
| any | overloaded, not violated | SCALE_UP | shed classes stay as they are; streak 0 |
| NORMAL | compliant | NORMAL | |
| SCALE_UP | compliant | NORMAL, or DEGRADE while classes are shed | streak 1 |
| DEGRADE | compliant | DEGRADE; from the 3rd in a row as RECOVER | streak + 1 |
| RECOVER | compliant | RECOVER while classes stay shed, NORMAL when none | un-shed one class |

Recovery un-sheds one class per compliant period from the 3rd compliant period in a row on, in the order of
`shed_classes` (with `["batch", "best_effort"]`, batch comes back first); with nothing configured to shed,
DEGRADE goes back to NORMAL at the 3rd compliant period.

The scale-out hook is asked whenever the guardian sees overload (also while degrading: a violation under
overload needs capacity too): on the first overloaded check and again every `rescale_after_s` while it lasts.
It runs on its own thread (`HookRunner`), so a slow or failing hook never delays a check.

Baseline QPS: `baseline_qps` when configured; otherwise learned as an EWMA (weight `baseline_alpha` = 0.02 per
period, about four minutes at 5 s) of the QPS of compliant NORMAL periods, seeded by the first QPS seen and
floored at 1 QPS. A surge over 2.1× never enters the baseline, because it makes the period non-compliant.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge

from prismlb.wire import ConfigError

from ._scale_hook import HookRunner, ScaleEvent, ScaleHook

_log = logging.getLogger("prism.brain")

CHECK_PERIOD_S = 5.0


class GuardianState(StrEnum):
    NORMAL = "normal"
    DEGRADE = "degrade"
    SCALE_UP = "scale_up"
    RECOVER = "recover"


@dataclass(frozen=True)
class GuardianConfig:
    shed_classes: tuple[str, ...] = ("batch", "best_effort")
    p99_slo_ms: float = 800.0
    error_slo_ratio: float = 0.005
    load_factor_limit: float = 2.1
    compliant_periods: int = 3
    baseline_qps: float | None = None  # None: learned
    baseline_alpha: float = 0.02
    min_baseline_qps: float = 1.0
    scale_hook: ScaleHook | None = None
    rescale_after_s: float = 60.0

    def __post_init__(self) -> None:
        if len(set(self.shed_classes)) != len(self.shed_classes) or not all(self.shed_classes):
            raise ConfigError(f"shed classes must be distinct names, got {list(self.shed_classes)}")
        if min(self.p99_slo_ms, self.error_slo_ratio, self.load_factor_limit, self.min_baseline_qps) <= 0:
            raise ConfigError("guardian thresholds and the minimum baseline QPS must be positive")
        if self.compliant_periods < 1 or not 0 < self.baseline_alpha <= 1 or self.rescale_after_s < 0:
            raise ConfigError("compliant periods must be >= 1, baseline alpha in (0, 1], rescale interval >= 0")
        if self.baseline_qps is not None and self.baseline_qps <= 0:
            raise ConfigError(f"baseline QPS must be positive, got {self.baseline_qps}")


@dataclass(frozen=True)
class Transition:
    """A change of state, or a recovery step within RECOVER (source == target), as kept and logged."""

    at_s: float
    source: GuardianState
    target: GuardianState
    reason: str
    shed_classes: tuple[str, ...]  # after the transition


class Guardian:
    """Call `check` every `CHECK_PERIOD_S`; `flags()` goes into the routing table."""

    def __init__(self, config: GuardianConfig, registry: CollectorRegistry, keep_transitions: int = 100) -> None:
        self.config = config
        self.state = GuardianState.NORMAL
        self.compliant_streak = 0
        self.baseline_qps = config.baseline_qps
        self.load_factor: float | None = None
        self.transitions: deque[Transition] = deque(maxlen=keep_transitions)
        self._shed = 0  # how many classes, counted from the end of `shed_classes`, are shed
        self._last_hook_at: float | None = None  # while overloaded: when capacity was last asked for
        self._transitions = Counter(
            "prism_brain_guardian_transitions", "SLO guardian state changes", ["from", "to"], registry=registry
        )
        self._state = Gauge(
            "prism_brain_guardian_state", "1 for the SLO guardian's current state", ["state"], registry=registry
        )
        self._hook_results = Counter(
            "prism_brain_guardian_scale_hook_calls", "Scale-out hook calls by result", ["result"], registry=registry
        )
        Gauge("prism_brain_guardian_shed_classes", "Traffic classes shed now", registry=registry).set_function(
            lambda: self._shed
        )
        Gauge(
            "prism_brain_guardian_load_factor", "QPS / baseline QPS at the last check", registry=registry
        ).set_function(lambda: self.load_factor or 0.0)
        for state in GuardianState:
            self._state.labels(state.value).set(1.0 if state is self.state else 0.0)
        for result in ("ok", "failed", "skipped"):
            self._hook_results.labels(result)
        self._hook = HookRunner(config.scale_hook, self._hook_results) if config.scale_hook else None

    @property
    def shed_classes(self) -> tuple[str, ...]:
        classes = self.config.shed_classes
        return classes[len(classes) - self._shed :]

    def flags(self) -> tuple[str, list[str]]:
        """(state, classes shed) for the routing table's `guardian` and `shed_classes`."""
        return self.state.value, list(self.shed_classes)

    def check(self, now_s: float, p99_ms: float | None, error_ratio: float | None, qps: float | None) -> GuardianState:
        """One period: classify the measures, move the state machine, ask for capacity under overload."""
        cfg = self.config
        breaches = []
        if p99_ms is not None and p99_ms > cfg.p99_slo_ms:
            breaches.append(f"P99 {p99_ms:.0f} ms > {cfg.p99_slo_ms:g} ms")
        if error_ratio is not None and error_ratio > cfg.error_slo_ratio:
            breaches.append(f"error rate {error_ratio:.2%} > {cfg.error_slo_ratio:.2%}")
        self.load_factor = qps / self.baseline_qps if qps is not None and self.baseline_qps else None
        overloaded = self.load_factor is not None and self.load_factor > cfg.load_factor_limit
        load = f"load factor {self.load_factor:.2f}" if self.load_factor is not None else "no load factor"
        source, shed_before = self.state, self._shed
        if breaches:
            self.compliant_streak = 0
            self._shed = len(cfg.shed_classes)
            target, reason = GuardianState.DEGRADE, "; ".join(breaches)
        elif overloaded:
            self.compliant_streak = 0
            target, reason = GuardianState.SCALE_UP, f"{load} > {cfg.load_factor_limit:g}"
        else:
            target, reason = self._compliant(load)
        self._record(now_s, source, target, shed_before, reason)
        if overloaded and qps is not None and self.baseline_qps is not None:
            self._ask_capacity(now_s, qps, self.baseline_qps, f"{load} > {cfg.load_factor_limit:g}")
        else:
            self._last_hook_at = None
        if qps is not None and cfg.baseline_qps is None and self.state is GuardianState.NORMAL:
            self._learn(qps)
        return self.state

    def close(self) -> None:
        """Stop the hook thread (a hook already running is not waited for beyond a second)."""
        if self._hook is not None:
            self._hook.close()

    def _compliant(self, load: str) -> tuple[GuardianState, str]:
        """A compliant period: the streak grows; from the configured streak on, one shed class comes back."""
        self.compliant_streak += 1
        if self.state is GuardianState.SCALE_UP:
            target = GuardianState.DEGRADE if self._shed else GuardianState.NORMAL
            return target, f"{load} back under {self.config.load_factor_limit:g}"
        reason = f"compliant ({load}), {self.compliant_streak} in a row"
        if self.state is GuardianState.NORMAL or self.compliant_streak < self.config.compliant_periods:
            return self.state, reason
        if self._shed:
            reason += f", restored {self.shed_classes[0]}"
            self._shed -= 1
        return (GuardianState.RECOVER if self._shed else GuardianState.NORMAL), reason

    def _record(
        self, now_s: float, source: GuardianState, target: GuardianState, shed_before: int, reason: str
    ) -> None:
        """Log, keep and export a change of state or of the shed classes."""
        if target is source and self._shed == shed_before:
            return
        shed = self.shed_classes
        self.transitions.append(Transition(now_s, source, target, reason, shed))
        shedding = f"shedding {', '.join(shed)}" if shed else "shedding nothing"
        if target is source:
            _log.info("guardian %s: %s; %s", target.value, reason, shedding)
            return
        self.state = target
        self._transitions.labels(source.value, target.value).inc()
        self._state.labels(source.value).set(0.0)
        self._state.labels(target.value).set(1.0)
        _log.info("guardian %s -> %s: %s; %s", source.value, target.value, reason, shedding)

    def _ask_capacity(self, now_s: float, qps: float, baseline_qps: float, reason: str) -> None:
        if self._last_hook_at is not None and now_s - self._last_hook_at < self.config.rescale_after_s:
            return
        self._last_hook_at = now_s
        if self._hook is None:
            _log.info("guardian: scale-out wanted (%s) but no hook is configured", reason)
            return
        self._hook.submit(ScaleEvent(now_s, self.state.value, reason, qps / baseline_qps, qps, baseline_qps))

    def _learn(self, qps: float) -> None:
        floor = self.config.min_baseline_qps
        if self.baseline_qps is None:
            self.baseline_qps = max(floor, qps)
        else:
            alpha = self.config.baseline_alpha
            self.baseline_qps = max(floor, (1 - alpha) * self.baseline_qps + alpha * qps)
