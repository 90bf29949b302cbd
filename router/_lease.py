"""A request placed on an endpoint, counted in flight until it ends, and its outcome reported."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Self

from ._health import EndpointState, Outcome, classify
from ._snapshot import Endpoint, InFlight


class Lease:
    """One request on one endpoint: `with router.request(...) as lease:` (or `async with`).

    Entering counts the request in flight (for the bounded-load step); leaving reports how it ended. An
    exception leaving the block is classified (`ConnectionRefusedError`: CONNECT, `TimeoutError`: TIMEOUT,
    other `OSError`: ERROR, anything else: not the endpoint's doing), a normal exit is a success, and
    `fail()` names the outcome explicitly. Call `first_token()` when the first token (or the head of a
    streamed response) arrives: one that took `slow_s` or more counts as a timeout for the circuit breaker, and
    `retransmitted()` with the connection's retransmitted segments before leaving, where the caller can read them.
    `headers` are the ones to add to the request (the session token and its context signature);
    `moved_from` names the node the session was on when it had to move (failover or model-version switch).
    """

    __slots__ = (
        "_clock",
        "_counter",
        "_first",
        "_held",
        "_lock",
        "_outcome",
        "_placed",
        "_silent",
        "_slow_s",
        "_started",
        "_state",
        "_tokens",
        "_trial",
        "_units",
        "_until_first",
        "_wake",
        "endpoint",
        "headers",
        "label",
        "moved_from",
    )

    def __init__(
        self,
        endpoint: Endpoint,
        headers: Mapping[str, str],
        moved_from: str | None,
        state: EndpointState,
        counter: InFlight,
        lock: threading.Lock,
        slow_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        units: int = 1,
        tokens: int = 0,
        until_first_token: bool = False,
        silent: bool = False,
        wake: Callable[[], None] | None = None,
        placed: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.headers = headers
        self.moved_from = moved_from
        self.label = state.label
        self._state = state
        self._counter = counter
        self._lock = lock
        self._slow_s = slow_s
        self._clock = clock
        self._started: float | None = None
        self._first: float | None = None
        self._outcome: Outcome | None = None
        self._trial = False
        self._units = units  # what the request adds to its endpoint's and group's load ...
        self._until_first = until_first_token  # ... until its first token, else until it ends
        self._tokens = tokens  # the prompt tokens the endpoint is expected to compute (its first-token speed's)
        self._held = 0
        self._silent = silent  # its caller reports no first token: its load is held to the end, unseen by turns
        self._wake = wake  # the router's waiting room, told when this lease's load falls
        self._placed = placed  # ... and when the request whose turn it was is placed

    @property
    def node_id(self) -> str:
        return self.endpoint.node_id

    @property
    def address(self) -> str:
        return self.endpoint.address

    def begin(self) -> None:
        """Count the request in flight (what entering the `with` block does)."""
        if self._started is not None:
            raise RuntimeError("the lease is already in flight")
        now = self._clock()
        with self._lock:
            self._trial = self._state.start(now, self._units)
            self._counter.value += self._units
            if self._silent:
                self._state.silent += self._units
        self._held = self._units
        self._started = now
        if self._placed is not None:
            self._placed()

    def first_token(self) -> None:
        """Mark the arrival of the first token, counted in the endpoint's first-token speed; later calls, and one
        outside `begin`..`end`, are ignored."""
        if self._first is not None or self._started is None:
            return
        self._first = self._clock()
        dropped = self._until_first and self._held > 0
        with self._lock:
            self._state.first_token_tokens += self._tokens
            self._state.first_token_s += self._first - self._started
            if dropped:
                self._drop_load()
        if dropped and self._wake is not None:
            self._wake()

    def retransmitted(self, segments: int) -> None:
        """Count the segments this request's connection retransmitted on its way (the caller's kernel's `TCP_INFO`
        count, which the httpx transports read): a lost request or handshake is sent again by the caller, never by
        the node, so only the caller sees it. The endpoint's expected time to first token grows by the stall they
        forecast (`Settings.client_stall`). Call before `end`, with 0 too (a request that lost nothing counts);
        ignored outside `begin`..`end`."""
        if self._started is None:
            return
        now = self._clock()
        with self._lock:
            self._state.count_retransmits(segments, now)

    def fail(self, outcome: Outcome = Outcome.ERROR) -> None:
        """Report this outcome when the lease ends, whatever else happens."""
        self._outcome = outcome

    def end(self, exc: BaseException | None = None) -> Outcome | None:
        """Count the request out and report its outcome (what leaving the `with` block does); None if not begun
        or already ended."""
        started = self._started
        if started is None:
            return None
        self._started = None
        outcome = self._outcome or (Outcome.OK if exc is None else classify(exc))
        if outcome is Outcome.OK and self._first is not None and self._first - started >= self._slow_s:
            outcome = Outcome.SLOW
        now = self._clock()
        with self._lock:
            self._state.end(outcome, self._trial, now)
            self._drop_load()
        if self._wake is not None:
            self._wake()
        return outcome

    def _drop_load(self) -> None:
        """Take the load this lease still holds off its endpoint and group (under the router's lock)."""
        self._state.load -= self._held
        self._counter.value -= self._held
        if self._silent:
            self._state.silent -= self._held
        self._held = 0

    def __enter__(self) -> Self:
        self.begin()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end(exc)

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end(exc)

    def __repr__(self) -> str:
        return f"Lease({self.endpoint.node_id} {self.endpoint.address})"
