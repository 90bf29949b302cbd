"""The router's waiting room: requests held back while their slice has no room, let go earliest deadline first.

An engine serves its queue in arrival order: a request sent to a queue waits behind everything sent there before it,
however much sooner it must start. A router that sends only while some node of the slice has less than half an
engine step's prefill queued (`Settings.hold_tokens`) keeps the engines' queues short and the order its own: the
requests it holds go in order of deadline, their arrival plus their TTFT SLO (`semantics.ttft_slo_s`), so a short
prompt due in 800 ms is not stuck behind a long one that may take seconds. A request whose deadline is nearer
than `Settings.late_margin` times its own prefill is late: it goes after every request still in time, in the order it
became late, since a turn given to a request that will most likely miss its SLO makes the ones behind it miss theirs
too (earliest deadline first fails that way under overload). Nothing waits while there is room, so an unloaded
cluster sees no difference; nothing waits longer than `Settings.hold_max_s`, late or not.

The room is the router's rule (`Router._grant`); this module is its bookkeeping: the tickets, one deadline-ordered
heap per slice, and the ways a caller waits for its turn (a thread, a coroutine, or a simulation that asks which
tickets were granted).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

from ._request import Request

COMPACT_AT = 1024
"""A room's deadline heap is rebuilt without its gone tickets once it holds more than this many entries and more than
twice the tickets waiting in every room."""


class Ticket:
    """One request's place in the waiting room. `granted` turns True when it may go (or when it has waited
    `hold_max_s`); the caller then places it with `Router.request(..., turn=ticket)`, whose lease beginning lets
    the next request of the slice be considered."""

    __slots__ = (
        "_event",
        "_future",
        "_lock",
        "deadline",
        "granted",
        "joined",
        "late_at",
        "left",
        "request",
        "slice_key",
    )

    def __init__(self, request: Request, slice_key: str, joined: float, deadline: float, late_at: float) -> None:
        self.request = request
        self.slice_key = slice_key
        self.joined = joined
        self.deadline = deadline
        self.late_at = late_at
        """When it becomes late: its deadline less `Settings.late_margin` times its prefill alone on the slice's
        fastest entry."""
        self.granted = False
        self.left = False  # gone from the room without a grant (its caller stopped waiting)
        self._event = threading.Event()
        self._future: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self._lock = threading.Lock()  # a coroutine's future is set and read under it, so no grant slips between

    def _grant(self) -> None:
        with self._lock:
            self.granted = True
            waiter = self._future
        self._event.set()
        if waiter is not None:
            loop, future = waiter
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # its event loop is closed: nobody waits there any more
                pass

    def wait(self, timeout_s: float) -> bool:
        """Block this thread until the turn comes; False when `timeout_s` passed first."""
        return self._event.wait(timeout_s)

    async def wait_async(self, timeout_s: float) -> bool:
        """`wait` for a coroutine, without blocking its event loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.granted:
                return True
            future: asyncio.Future[None] = loop.create_future()
            self._future = (loop, future)
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return self.granted
        return True

    def __repr__(self) -> str:
        state = "granted" if self.granted else "left" if self.left else "waiting"
        return f"Ticket({self.slice_key} deadline={self.deadline:.3f} {state})"


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class Room:
    """The tickets waiting in one slice: by deadline (the order turns go in), those found late (after them) and by
    arrival (the order they expire in), and the one granted ticket not yet placed."""

    by_deadline: list[tuple[float, int, Ticket]] = field(default_factory=list)
    late: deque[Ticket] = field(default_factory=deque)
    by_arrival: deque[Ticket] = field(default_factory=deque)
    granted: Ticket | None = None
    granted_at: float = 0.0
    waiting: int = 0
    """Tickets of this slice waiting now (neither granted nor gone)."""

    def head(self, now: float) -> Ticket | None:
        """The earliest-deadline ticket still waiting that is not late at `now`, else the first found late (those gone
        are dropped on the way); None when none waits. Only the deadline order's first is checked for lateness: it is
        the only one a turn could go to."""
        heap = self.by_deadline
        while heap:
            ticket = heap[0][2]
            if ticket.granted or ticket.left:
                heapq.heappop(heap)
            elif ticket.late_at < now:
                self.late.append(heapq.heappop(heap)[2])
            else:
                return ticket
        late = self.late
        while late and (late[0].granted or late[0].left):
            late.popleft()
        return late[0] if late else None

    def expired(self, before: float) -> list[Ticket]:
        """The tickets still waiting that joined at or before `before`, oldest first, taken out of arrival order."""
        out = []
        while self.by_arrival and (
            self.by_arrival[0].granted or self.by_arrival[0].left or self.by_arrival[0].joined <= before
        ):
            ticket = self.by_arrival.popleft()
            if not (ticket.granted or ticket.left):
                out.append(ticket)
        return out


class Turns:
    """Every slice's room and what it has given. Used under the router's lock."""

    def __init__(self) -> None:
        self.rooms: dict[str, Room] = {}
        self._order = itertools.count()
        self.counts = {"granted": 0, "expired": 0, "left": 0, "passed": 0}
        """Turns given for room (at once or after a wait); requests let go because they had waited `hold_max_s`;
        requests whose callers stopped waiting (cancelled) before either; and requests that took no turn, their
        prompt cached but for a few tokens (`Settings.hold_cached_tokens`)."""
        self.deferred = 0
        """Times a room's head found room and left it to a peer router whose head was due sooner
        (`Settings.share_turns`)."""

    @property
    def waiting(self) -> int:
        """Tickets waiting now, in every room."""
        return sum(room.waiting for room in self.rooms.values())

    def join(self, ticket: Ticket) -> None:
        room = self.rooms.setdefault(ticket.slice_key, Room())
        if len(room.by_deadline) > COMPACT_AT and len(room.by_deadline) > 2 * self.waiting:
            # Tickets gone from the middle of the heap (let go by their wait, or left) wait there to be popped; under
            # a lasting backlog they would pile up behind the live ones, so the heap is rebuilt without them.
            room.by_deadline = [item for item in room.by_deadline if not (item[2].granted or item[2].left)]
            heapq.heapify(room.by_deadline)
        heapq.heappush(room.by_deadline, (ticket.deadline, next(self._order), ticket))
        room.by_arrival.append(ticket)
        room.waiting += 1

    def passed(self, ticket: Ticket) -> None:
        """Let `ticket` go without joining its room: its request takes no turn."""
        self.counts["passed"] += 1
        ticket._grant()

    def grant(self, ticket: Ticket, now: float, *, expired: bool = False) -> None:
        """Let `ticket` go: as its slice's one granted ticket (until it is placed), or past its wait (`expired`)."""
        room = self.rooms[ticket.slice_key]
        room.waiting -= 1
        if expired:
            self.counts["expired"] += 1
        else:
            self.counts["granted"] += 1
            room.granted, room.granted_at = ticket, now
        ticket._grant()

    def leave(self, ticket: Ticket, *, expired: bool = False) -> None:
        """The caller stopped waiting (`expired`: after `hold_max_s`, else cancelled): drop the ticket, or its grant."""
        self.placed(ticket)
        if not ticket.granted and not ticket.left:
            ticket.left = True
            self.rooms[ticket.slice_key].waiting -= 1
            self.counts["expired" if expired else "left"] += 1

    def placed(self, ticket: Ticket) -> None:
        """The granted ticket's request was placed (or its grant given back): the slice may consider its next."""
        room = self.rooms.get(ticket.slice_key)
        if room is not None and room.granted is ticket:
            room.granted = None
