"""An adaptive batching window for an inference server, bounded by the server's own P99 latency.

The window is how long the server gathers requests before admitting them as one batch. A larger window makes
larger batches; when the server's latency P99 goes over its target the window shrinks, and when batches start
to overrun a breaker turns batching off until the server has recovered. Defaults (`BatchWindowSettings`):

- P99 target 200 ms over the latencies of the last second; the window starts at its maximum, 200 ms;
- every 100 ms: P99 over the target shrinks the window by 10%, never below 50 ms; P99 at or under the target
  grows it by 10%, never above the maximum (the recovery rule); no latencies in the last second hold it;
- a batch that runs 300 ms or more is an overrun; three in a row open the breaker (window 0: each request is
  admitted as it arrives); 5 s without an overrun make it half-open (a trial at the 50 ms floor); the first
  batch then decides: under 300 ms closes the breaker (the window grows back from the floor), an overrun
  opens it again.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

from prismlb.semantics import quantile
from prismlb.wire import ConfigError, RejectCounter

_log = logging.getLogger("prism.otel")

P99 = 0.99
TRANSITIONS_KEPT = 256
"""Recent breaker transitions kept for inspection; the counts cover all of them."""
_STEP_SLACK = 1e-9
"""Steps due are counted with this slack so that a clock landing on a step boundary (0.1 + 0.2) takes it."""


def _finite(value: object) -> bool:
    """A real number (numpy's included), not a bool, neither infinite nor NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class BreakerState(enum.StrEnum):
    """Where the batch breaker stands: batching normally, off, or on trial."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerTransition:
    """One change of the breaker's state: when (the window's clock), from where to where, and why."""

    at_s: float
    source: BreakerState
    target: BreakerState
    reason: str


@dataclass(frozen=True, slots=True)
class BatchWindowSettings:
    """The window's rules; every field is checked when the settings are made (ConfigError)."""

    p99_target_s: float = 0.2
    min_window_s: float = 0.05
    max_window_s: float = 0.2
    """The starting window too. The default is the target: a request that waits longer than that in the window
    has missed the target before the engine sees it."""
    step_s: float = 0.1
    """How often the window moves."""
    shrink: float = 0.1
    """Share of the window taken off per step while P99 is over the target."""
    grow: float = 0.1
    """Share of the window added per step while P99 is at or under the target."""
    overrun_s: float = 0.3
    """A batch that runs this long or longer is an overrun."""
    overruns_to_open: int = 3
    """Overruns in a row that open the breaker."""
    open_idle_s: float = 5.0
    """Time without an overrun after which an open breaker goes half-open."""
    p99_span_s: float = 1.0
    """Latencies of this last span make the P99; ten steps, so the window stops shrinking within a second of
    latency recovering."""
    max_samples: int = 10_000
    """Latencies kept at most (the oldest dropped first), bounding memory at any request rate."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not _finite(value):
                raise ConfigError(f"batch window setting {f.name} must be a finite number, got {value!r}")
        for name in ("p99_target_s", "min_window_s", "step_s", "overrun_s", "open_idle_s", "p99_span_s", "grow"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"batch window setting {name} must be positive, got {getattr(self, name)!r}")
        if self.max_window_s < self.min_window_s:
            raise ConfigError(
                f"batch window setting max_window_s ({self.max_window_s}) is under min_window_s ({self.min_window_s})"
            )
        if not 0 < self.shrink < 1:
            raise ConfigError(f"batch window setting shrink must be within (0, 1), got {self.shrink!r}")
        for name in ("overruns_to_open", "max_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"batch window setting {name} must be a whole number ≥ 1, got {value!r}")


class AdaptiveBatchWindow:
    """The batching window an inference server should use now, from the latencies and batches it reports.

    The server calls `observe` with each request's latency, `record_batch` with each batch's run time, and
    `window_s` when a batch starts gathering. Each call may give the time `now`; without, it reads `clock`
    (monotonic seconds by default; a simulation passes its own). Steps due since the last call are taken then,
    all with the P99 of that moment, so the window moves as often as the server asks, never on a thread of its
    own. Thread-safe: one lock guards the state. A latency or duration that is not a finite number ≥ 0, or a
    time that is not finite, is rejected: counted by kind in `rejects`, the first of each kind logged, the call
    otherwise ignored (False), so bad input never stops the server.
    """

    def __init__(
        self, settings: BatchWindowSettings | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings if settings is not None else BatchWindowSettings()
        self._clock = clock
        self.rejects = RejectCounter("batch window", _log)
        self._lock = threading.Lock()
        self._latencies: deque[tuple[float, float]] = deque(maxlen=self.settings.max_samples)
        self._window = self.settings.max_window_s
        self._state = BreakerState.CLOSED
        self._now: float | None = None
        self._step_at = 0.0
        self._overruns_in_a_row = 0
        self._last_overrun_s = 0.0
        self._transitions: deque[BreakerTransition] = deque(maxlen=TRANSITIONS_KEPT)
        self._counts: dict[tuple[BreakerState, BreakerState], int] = {}
        self.batches = 0
        self.overruns = 0

    # --- what the server reports --------------------------------------------------------------------------

    def observe(self, latency_s: float, now: float | None = None) -> bool:
        """One request's latency, the one the target bounds (its wait before prefill, or its time to first
        token); False if rejected."""
        with self._lock:
            at = self._advance(now)
            if at is None or not self._valid("latency", latency_s):
                return False
            self._latencies.append((at, float(latency_s)))
            return True

    def record_batch(self, duration_s: float, now: float | None = None) -> bool:
        """One batch's run time, from its hand-over to the engine to its last request's first token; drives the
        breaker. False if rejected."""
        with self._lock:
            at = self._advance(now)
            if at is None or not self._valid("duration", duration_s):
                return False
            self.batches += 1
            overran = duration_s >= self.settings.overrun_s
            if overran:
                self.overruns += 1
                self._last_overrun_s = at
            if self._state is BreakerState.CLOSED:
                self._overruns_in_a_row = self._overruns_in_a_row + 1 if overran else 0
                if self._overruns_in_a_row >= self.settings.overruns_to_open:
                    self._move(BreakerState.OPEN, at, f"{self._overruns_in_a_row} batches in a row overran")
            elif self._state is BreakerState.HALF_OPEN:
                if overran:
                    self._move(BreakerState.OPEN, at, f"the trial batch overran ({duration_s * 1e3:.0f} ms)")
                else:
                    self._move(BreakerState.CLOSED, at, f"the trial batch passed ({duration_s * 1e3:.0f} ms)")
            return True

    # --- what the server asks -----------------------------------------------------------------------------

    def window_s(self, now: float | None = None) -> float:
        """Seconds to gather the next batch: the adaptive window (closed), the floor (half-open) or 0 (open:
        admit each request as it arrives)."""
        with self._lock:
            self._advance(now)
            if self._state is BreakerState.OPEN:
                return 0.0
            return self.settings.min_window_s if self._state is BreakerState.HALF_OPEN else self._window

    @property
    def state(self) -> BreakerState:
        """The breaker's state at the clock's present time."""
        with self._lock:
            self._advance(None)
            return self._state

    def p99_s(self, now: float | None = None) -> float:
        """P99 of the latencies observed in the last `p99_span_s`; NaN when there are none."""
        with self._lock:
            at = self._advance(now)
            return math.nan if at is None else self._p99(at)

    @property
    def transitions(self) -> tuple[BreakerTransition, ...]:
        """The last `TRANSITIONS_KEPT` breaker transitions, oldest first."""
        with self._lock:
            return tuple(self._transitions)

    def transition_counts(self) -> dict[str, int]:
        """Every breaker transition since the start, by kind (`closed->open`, `open->half_open`, ...)."""
        with self._lock:
            return {f"{source}->{target}": n for (source, target), n in self._counts.items()}

    # --- internals (under the lock) -----------------------------------------------------------------------

    def _valid(self, kind: str, value: float) -> bool:
        if _finite(value) and value >= 0:
            return True
        self.rejects.count(kind, f"a {kind} must be a finite number of seconds ≥ 0, got {value!r}")
        return False

    def _advance(self, now: float | None) -> float | None:
        """Bring the breaker and the window up to `now` (the clock's time when None); the time, or None when
        `now` is not a finite number (rejected, nothing moves). A time before the last one moves nothing."""
        at = self._clock() if now is None else now
        if not _finite(at):
            self.rejects.count("time", f"a time must be a finite number of seconds, got {at!r}")
            return None
        if self._now is None:
            self._now = self._step_at = at
        if at <= self._now:
            return at
        self._now = at
        s = self.settings
        if self._state is BreakerState.OPEN and at - self._last_overrun_s >= s.open_idle_s:
            self._move(
                BreakerState.HALF_OPEN, self._last_overrun_s + s.open_idle_s, f"{s.open_idle_s:g} s without an overrun"
            )
        steps = int((at - self._step_at) / s.step_s + _STEP_SLACK)
        if steps <= 0:
            return at
        self._step_at += steps * s.step_s
        if self._state is not BreakerState.CLOSED:
            return at
        p99 = self._p99(at)
        if p99 > s.p99_target_s:
            self._window = math.exp(
                max(math.log(s.min_window_s), math.log(self._window) + steps * math.log1p(-s.shrink))
            )
        elif p99 <= s.p99_target_s:
            self._window = math.exp(min(math.log(s.max_window_s), math.log(self._window) + steps * math.log1p(s.grow)))
        return at

    def _p99(self, at: float) -> float:
        horizon = at - self.settings.p99_span_s
        while self._latencies and self._latencies[0][0] <= horizon:
            self._latencies.popleft()
        return quantile([v for t, v in self._latencies if horizon < t <= at], P99)

    def _move(self, target: BreakerState, at: float, reason: str) -> None:
        source = self._state
        self._state = target
        self._overruns_in_a_row = 0
        if target is not BreakerState.HALF_OPEN:
            self._window = self.settings.min_window_s
        self._transitions.append(BreakerTransition(at, source, target, reason))
        self._counts[(source, target)] = self._counts.get((source, target), 0) + 1
        _log.info("batch breaker %s -> %s at %.3f s: %s", source, target, at, reason)
