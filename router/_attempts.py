"""The attempts of one request: whether it may go again to another endpoint after one failed.

One place decides it for `Router.call`, `Router.acall` and both httpx transports, sync and async alike, as
httpx maps exceptions once for its sync and async transports: the callers do the I/O, this does none. The first
attempt also waits here for the request's turn (`Router.turn`, `Settings.hold_tokens`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prismlb.wire import NoRouteError

from ._errors import ShedError
from ._health import Outcome, classify
from ._request import Key, Request

if TYPE_CHECKING:
    from ._lease import Lease
    from ._router import Router
    from ._turns import Ticket


class Attempts:
    """Up to `tries` leases for one request, each on an endpoint the request has not tried yet.

    A request goes again only where no endpoint can have acted on it: its connection was refused (CONNECT), or
    the endpoint answered that it did not take it (`refused`: an HTTP 503 or 429). Anything else (a timeout, a
    reset, a 500) may have run the request already, and running it twice is the caller's call, not the router's.
    """

    __slots__ = ("_request", "_router", "_silent", "_tries", "tried")

    def __init__(
        self, router: Router, request: Request | Key, tries: int | None = None, *, first_tokens: bool = False
    ) -> None:
        """`first_tokens`: the caller reports the first token (`Lease.first_token`: a streamed response), so the
        request waits for its turn (`Router.turn`); one that does not (a response read whole) sends at once, and its
        load, held to the end, is left out of the turns (`Lease` `silent`)."""
        self._router = router
        self._request = request if isinstance(request, Request) else Request(key=request)
        self._tries = router.settings.connect_tries if tries is None else tries
        self._silent = not first_tokens
        self.tried: list[str] = []
        """Labels of the endpoints tried so far (`Lease.label`), which later attempts exclude."""

    def first(self) -> Lease:
        """The first attempt's lease (not begun), after waiting up to `hold_max_s` for the request's turn. Raises
        what `Router.request` raises: NoRouteError, ShedError."""
        ticket = self._ticket()
        if ticket is not None and not ticket.wait(self._router.settings.hold_max_s):
            self._router.leave(ticket, expired=True)
        return self._placed(ticket)

    async def afirst(self) -> Lease:
        """`first` for a coroutine: the wait does not block the event loop."""
        router = self._router
        ticket = self._ticket()
        if ticket is not None:
            try:
                granted = await ticket.wait_async(router.settings.hold_max_s)
            except BaseException:  # cancelled while waiting: the turn goes to the next
                router.leave(ticket)
                raise
            if not granted:
                router.leave(ticket, expired=True)
        return self._placed(ticket)

    def _ticket(self) -> Ticket | None:
        return self._router.turn(self._request) if self._router.holds and not self._silent else None

    def _placed(self, ticket: Ticket | None) -> Lease:
        try:
            return self._router.request(self._request, turn=ticket, silent=self._silent)
        except BaseException:
            if ticket is not None:
                self._router.leave(ticket)
            raise

    def retry(self, lease: Lease, outcome: Outcome, *, refused: bool = False) -> Lease | None:
        """The next attempt's lease (not begun) after `lease` ended with `outcome`, or None: give up and hand the
        caller this attempt's result. None when the endpoint may have acted on the request, when `tries`
        attempts were made, or when no endpoint is left to try (every one tried, or the request's class shed
        meanwhile). `lease` may still be in flight: the next endpoint is chosen before the caller lets go of
        this attempt's result, so that a caller left without one still has it to hand back."""
        if not (outcome is Outcome.CONNECT or refused) or len(self.tried) + 1 >= self._tries:
            return None
        self.tried.append(lease.label)
        try:
            return self._router.request(self._request, exclude=self.tried, silent=self._silent)
        except (NoRouteError, ShedError):
            return None

    def raised(self, lease: Lease, exc: BaseException) -> Lease | None:
        """The next attempt's lease after the caller's work in `lease` raised `exc` (`Router.call`, `Router.acall`),
        the lease then marked with the outcome `exc` stands for; or None, the lease unmarked: the caller raises
        `exc`, and leaving the lease reports it."""
        outcome = classify(exc)
        following = self.retry(lease, outcome)
        if following is not None:
            lease.fail(outcome)
        return following
