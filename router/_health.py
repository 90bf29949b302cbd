"""Per-endpoint state kept by the caller: requests in flight, passive health (nginx) and a circuit breaker.

Passive health follows nginx's `max_fails` / `fail_timeout`: `max_fails` failed attempts (connect failures,
errors, timeouts) within `fail_timeout` make the endpoint unavailable for `fail_timeout`; a success clears
the count (and ends the down time, should a request reach the endpoint while every endpoint was down).
The circuit breaker follows the design: a timeout, or a first token that took `slow_s` or
more, counts as a timeout; `open_after` (3) in a row open the circuit, and after `open_s` (5 s) without
requests it turns half-open and admits `half_open_trials` trial requests: a success closes it, any failure
opens it again. As in Envoy's outlier detection (`max_ejection_percent`), at most `max_open_share` of the
router's endpoints (and at least one) have open circuits at once: when every endpoint is slow, the cluster is
overloaded rather than one endpoint broken, and opening every circuit would only take capacity away.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import IntEnum, StrEnum

from prismlb.semantics import STALL_SMOOTHING_S, network_stall_ms

from ._settings import Settings

_log = logging.getLogger("prism.router")


class Outcome(StrEnum):
    """How a request ended, as far as the endpoint's health is concerned."""

    OK = "ok"
    SLOW = "slow"  # succeeded, but its first token came `slow_s` or later: a timeout for the breaker
    TIMEOUT = "timeout"
    CONNECT = "connect"  # the connection could not be made: safe to retry on the next probe
    ERROR = "error"
    NONE = "none"  # ended by the caller for reasons of its own: neither success nor failure


_FAILURES = frozenset({Outcome.TIMEOUT, Outcome.CONNECT, Outcome.ERROR})
_TIMEOUTS = frozenset({Outcome.SLOW, Outcome.TIMEOUT})


class Circuit(IntEnum):
    NORMAL = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass(frozen=True, slots=True)
class EndpointStatus:
    """What the router knows about one endpoint now."""

    inflight: int
    available: bool
    circuit: Circuit
    outcomes: Mapping[Outcome, int]
    load: int = 0
    """What bounded load and the expected-TTFT choice weigh: requests in flight, or with `load="prefill"` the
    prompt tokens sent there that have no first token yet, less what the node was expected to find cached."""
    first_token_speed: float | None = None
    """The prompt tokens this router expected the endpoint to compute for its requests that reported a first token,
    over the seconds from their start to it, summed since the router started: the endpoint's prefill speed as its
    callers see it (a busy engine's queue included), in tokens per second; None before a first token."""
    retransmitted: int = 0
    """Segments this router's connections to the endpoint retransmitted for its requests, since the router started
    (`Lease.retransmitted`): the loss on the way there."""
    stall_s: float = 0.0
    """The network stall those retransmits forecast for a request there now (`EndpointState.stall_s`)."""


def classify(exc: BaseException) -> Outcome:
    """The outcome an exception raised while talking to an endpoint stands for (NONE: not the endpoint's doing)."""
    if isinstance(exc, ConnectionRefusedError):
        return Outcome.CONNECT
    if isinstance(exc, TimeoutError):
        return Outcome.TIMEOUT
    if isinstance(exc, OSError):
        return Outcome.ERROR
    return Outcome.NONE


class EndpointState:
    """One table entry's local state, shared by every table that lists the entry.

    Written only under the router's accounting lock; `route()` reads it without locks (`gated` is False
    whenever the entry is fully available, so the common case reads one attribute).
    """

    __slots__ = (
        "down_until",
        "fails",
        "fails_since",
        "first_token_s",
        "first_token_tokens",
        "gated",
        "inflight",
        "label",
        "load",
        "opened_at",
        "outcomes",
        "peers",
        "retransmit_at",
        "retransmit_requests",
        "retransmits",
        "retransmitted",
        "settings",
        "silent",
        "state",
        "timeouts",
        "trials",
    )

    def __init__(
        self, label: str, settings: Settings, peers: Callable[[], Collection[EndpointState]] | None = None
    ) -> None:
        self.label = label
        self.settings = settings
        self.peers = peers  # every endpoint state of the router, for the cap on open circuits (None: alone)
        self.inflight = 0
        self.load = 0  # what bounded load compares: requests in flight, or their prefill work (Settings.load)
        self.silent = 0  # the part of `load` whose callers report no first token (held to the end, unseen by turns)
        self.gated = False  # unavailable now, or recently: admits() decides
        self.fails = 0
        self.fails_since = 0.0
        self.down_until = 0.0
        self.state = Circuit.NORMAL  # NORMAL or OPEN; HALF_OPEN is OPEN after open_s without requests
        self.timeouts = 0
        self.opened_at = 0.0
        self.trials = 0
        self.outcomes: dict[Outcome, int] = {}
        self.first_token_tokens = 0  # the prompt tokens of the requests that reported a first token ...
        self.first_token_s = 0.0  # ... and the seconds they waited for it (`EndpointStatus.first_token_speed`)
        self.retransmits = 0.0  # segments this router's connections retransmitted for requests here, decayed ...
        self.retransmit_requests = 0.0  # ... and the requests they were counted for, decayed alike (`stall_s`) ...
        self.retransmit_at = 0.0  # ... as of this time
        self.retransmitted = 0  # the segments, not decayed (`EndpointStatus.retransmitted`)

    def circuit(self, now: float) -> Circuit:
        if self.state is Circuit.OPEN and now - self.opened_at >= self.settings.open_s:
            return Circuit.HALF_OPEN
        return self.state

    def admits(self, now: float) -> bool:
        """Whether a new request may go here: not marked down, and the circuit closed or half-open with room."""
        if now < self.down_until:
            return False
        circuit = self.circuit(now)
        return circuit is Circuit.NORMAL or (
            circuit is Circuit.HALF_OPEN and self.trials < self.settings.half_open_trials
        )

    @property
    def first_token_speed(self) -> float | None:
        """`EndpointStatus.first_token_speed`, now."""
        return self.first_token_tokens / self.first_token_s if self.first_token_s > 0 else None

    def _kept(self, now: float) -> float:
        """The share of the retransmit averages' weight still standing at `now` (exponential decay)."""
        return math.exp(-max(0.0, now - self.retransmit_at) / STALL_SMOOTHING_S)

    def count_retransmits(self, segments: int, now: float) -> None:
        """Count one request's retransmitted segments (`Lease.retransmitted`) in the averages `stall_s` reads."""
        keep = self._kept(now)
        self.retransmits = self.retransmits * keep + segments
        self.retransmit_requests = self.retransmit_requests * keep + 1
        self.retransmit_at = now
        self.retransmitted += segments

    def stall_s(self, now: float) -> float:
        """The network stall a request here can expect from what this router's own connections retransmitted
        (`Settings.client_stall`): segments per request, both averaged over `STALL_SMOOTHING_S`, priced by
        `semantics.network_stall_ms`, with one request that lost nothing counted beside them, so that the stall of
        an endpoint that gets no requests decays to nothing and it is tried again. 0 while nothing was lost."""
        if not self.retransmits or not self.settings.client_stall:
            return 0.0
        keep = self._kept(now)
        return network_stall_ms(self.retransmits * keep, self.retransmit_requests * keep + 1) / 1000

    def status(self, now: float) -> EndpointStatus:
        return EndpointStatus(
            self.inflight,
            self.admits(now),
            self.circuit(now),
            dict(self.outcomes),
            self.load,
            self.first_token_speed,
            self.retransmitted,
            self.stall_s(now),
        )

    def start(self, now: float, units: int) -> bool:
        """Count a request in flight, adding `units` to the load; True when it is a half-open circuit's trial."""
        self.inflight += 1
        self.load += units
        circuit = self.circuit(now)
        if circuit is Circuit.HALF_OPEN:
            self.trials += 1
            return True
        if circuit is Circuit.OPEN:
            self.opened_at = now  # routed here anyway (every endpoint was down): restart the quiet period
        return False

    def end(self, outcome: Outcome, trial: bool, now: float) -> None:
        """Count the request out and apply its outcome to passive health and the breaker."""
        self.inflight -= 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome is Outcome.NONE:
            if trial:
                self.trials -= 1
            return
        self._passive(outcome, now)
        self._breaker(outcome, trial, now)
        self.gated = now < self.down_until or self.state is Circuit.OPEN

    def _passive(self, outcome: Outcome, now: float) -> None:
        limit = self.settings.max_fails
        if outcome not in _FAILURES:
            self.fails = 0
            if self.down_until > now:  # routed here while down (every endpoint was) and it worked
                self.down_until = 0.0
                _log.info("endpoint %s available again: a request to it succeeded", self.label)
            return
        if limit == 0:
            return
        if now - self.fails_since > self.settings.fail_timeout_s:
            self.fails, self.fails_since = 0, now
        self.fails += 1
        if self.fails >= limit:
            self.fails = 0
            self.down_until = now + self.settings.fail_timeout_s
            _log.warning(
                "endpoint %s unavailable for %g s after %d failed attempt(s), the last %s",
                self.label,
                self.settings.fail_timeout_s,
                limit,
                outcome,
            )

    def _breaker(self, outcome: Outcome, trial: bool, now: float) -> None:
        if trial:
            self.trials -= 1
            if outcome is Outcome.OK:
                self.state, self.timeouts = Circuit.NORMAL, 0
                _log.info("endpoint %s circuit closed: the trial request succeeded", self.label)
            else:
                self.opened_at = now
                _log.warning("endpoint %s circuit open again: the trial request ended %s", self.label, outcome)
            return
        if self.state is not Circuit.NORMAL:
            return
        if outcome is Outcome.OK:
            self.timeouts = 0
        elif outcome in _TIMEOUTS:
            self.timeouts += 1
            if self.timeouts >= self.settings.open_after:
                if not self._may_open():
                    self.timeouts = 0
                    _log.debug("endpoint %s circuit kept closed: the share of open circuits is at its cap", self.label)
                    return
                self.state, self.opened_at, self.timeouts = Circuit.OPEN, now, 0
                _log.warning(
                    "endpoint %s circuit open after %d timeouts in a row (first token >= %g s or timed out)",
                    self.label,
                    self.settings.open_after,
                    self.settings.slow_s,
                )

    def _may_open(self) -> bool:
        """Whether one more open circuit stays within `max_open_share` of the router's endpoints (one at least)."""
        if self.peers is None:
            return True
        peers = self.peers()
        opened = sum(1 for state in peers if state.state is Circuit.OPEN)
        return opened < max(1, int(self.settings.max_open_share * len(peers)))
