"""Prism under replay: the real `Brain` fed with the agents' node vectors, and real `Router`s on its tables.

Nothing of the policy lives here: the brain's `tick` (predict, control, table build) runs every `cycle_s` of simulated
time after ingesting the vectors the simulated agents sent; each new table goes to every gateway's router
(`Router.apply`, as its subscriber would deliver it); the engines' KV events reach every router's prefix index
(`Router.index`) `KV_EVENT_DELAY_S` after the engine published them, as the agents' relay through the brain delivers
them; the routers' queued prefill work reaches every router through the brain's `LoadRelay` as often; requests
carry their prompt's block ids as the library's helpers hash them (`caller_blocks`); requests take `Router.request`
leases, which count them in flight and the segments their callers sent again on the way (the routers' own network
stall), and report first tokens and failures to the router's health and circuit breakers. The predictor trains
`train_steps` optimiser steps every `train_interval_s` (a step count, not a CPU budget, so runs are deterministic).
All of it runs on the simulation's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING

import torch

from prismlb.brain import BrainConfig, LoadRelay
from prismlb.router import PREFIX_TOKENS, Lease, Outcome, Request, Router, Settings, Ticket
from prismlb.wire import LOAD_REFRESH_S

from ._cluster import KV_EVENT_DELAY_S
from ._types import ClusterView, Policy, SimRequest
from ._types import Outcome as SimOutcome

if TYPE_CHECKING:
    from prismlb.brain import Brain


MEDIA_BLOCK_IDS = 1 << 62
"""Where the ids of `caller_blocks`' media-keyed blocks start: above every workload's own block ids."""
MEDIA_BLOCKS_PER_REQUEST = 1 << 16
"""Media-keyed block ids per request (`caller_blocks`): room for prompts of 32 million tokens at 512-token blocks."""


def caller_blocks(request: SimRequest, block_tokens: int) -> tuple[int, ...]:
    """The request's block ids as the library's helpers hash its prompt (`block_hashes` over its token ids): a
    text-only prompt's are the replay's own; a prompt with media keeps those of its whole text blocks before the
    media, and every block from there on (the text the media part starts in, the media's own) is keyed by the
    media's content, as vLLM keys a block holding a multimodal item, so it is new to every cache (the replay's
    media parts are never reused). The replay's last text block may be partial, and its engine credits a held one
    up to the text it holds; a router told that block, as a whole 512-token block of a prompt whose tokens are
    mostly media, would expect those media tokens cached too."""
    if not request.media_tokens:
        return request.blocks
    whole = (request.input_tokens - request.media_tokens) // block_tokens
    rest = -(-(request.input_tokens - whole * block_tokens) // block_tokens)
    base = MEDIA_BLOCK_IDS + request.id * MEDIA_BLOCKS_PER_REQUEST
    return request.blocks[:whole] + tuple(range(base, base + rest))


TEXT_BLOCK_IDS = 1 << 63
"""Where the ids of `text_ids` start: above every id the replay's engines publish (`caller_blocks`' included)."""


def text_ids(blocks: tuple[int, ...]) -> tuple[int, ...]:
    """A prompt's blocks as a caller without the model's tokenizer names them (`text_block_hashes`): chained as the
    engine's are (equal prefixes, equal ids), in an id space no KV event names."""
    return tuple(TEXT_BLOCK_IDS | block for block in blocks)


def affinity_key(request: SimRequest, block_tokens: int) -> int:
    """The chained id of the last prefix block within the router's `PREFIX_TOKENS`, as `prefix_key` computes
    it from token ids (over `caller_blocks`); a request without blocks gets its own id (no affinity)."""
    blocks = caller_blocks(request, block_tokens)
    if not blocks:
        return request.id
    depth = max(1, PREFIX_TOKENS // block_tokens)
    return blocks[min(depth, len(blocks)) - 1]


class PrismPolicy(Policy):
    """The brain and `gateways` routers, on simulated time; the routers take the library's `Settings()` unless
    `settings` says otherwise (`bench/knobs.py` sweeps them).

    `brain` builds the brain (default: the library's `Brain`), `sessions=False` sends every request without its
    session, and `text_blocks=True` describes every prompt as a caller without the model's tokenizer would (its
    blocks `text_ids`, which no KV event names): the seams the ablations (`_ablations`) switch parts of Prism off
    with. `train_steps=0` skips training, for a brain whose predictor has nothing to train."""

    name = "prism"

    def __init__(
        self,
        *,
        block_tokens: int,
        gateways: int = 1,
        settings: Settings | None = None,
        train_interval_s: float = 30.0,
        train_steps: int = 4,
        brain: Callable[[BrainConfig], Brain] | None = None,
        sessions: bool = True,
        text_blocks: bool = False,
    ) -> None:
        from prismlb.brain import Brain

        self.config = BrainConfig(admin_port=0, stale_periods=3.0)
        self.tick_s = KV_EVENT_DELAY_S
        self._next_cycle = 0.0
        torch.manual_seed(0)
        self.brain = (brain or Brain)(self.config)
        self.now = 0.0
        self.routers = [Router(settings=settings, clock=self._clock) for _ in range(gateways)]
        self.loads = LoadRelay("replay")
        self._next_refresh = 0.0
        self.block_tokens = block_tokens
        self.train_interval_s = train_interval_s
        self.train_steps = train_steps
        self.sessions = sessions
        self.text_blocks = text_blocks
        self._next_train = train_interval_s
        self._leases: dict[int, Lease] = {}
        self._tickets: dict[int, Ticket] = {}  # request id -> its turn, until it is placed
        self._held: dict[int, SimRequest] = {}  # requests waiting for their turn, by id (in arrival order)
        self._given = 0  # turns the routers had given at the last `released`

    def _clock(self) -> float:
        return self.now

    def tick(self, view: ClusterView, now: float) -> None:
        self.now = now
        for event in view.kv_events():
            for router in self.routers:
                router.apply_kv(event.node, False, event.stored, event.removed)
        self._share_load(now)
        if now < self._next_cycle:
            return
        self._next_cycle = now + self.config.cycle_s
        self.brain.ingest(list(view.vectors()), now)
        if self.train_steps and now >= self._next_train:
            self._next_train = now + self.train_interval_s
            self.brain.predictor.train_step(float("inf"), max_steps=self.train_steps)
        table = self.brain.tick(now, now)
        if table is not None:
            for router in self.routers:
                router.apply(table)

    def _share_load(self, now: float) -> None:
        """The routers' queued prefill and placements through the brain's `LoadRelay`, as their subscribers exchange
        them: each router's report (when changed, and every `LOAD_REFRESH_S`), then the relay's sums to every
        router."""
        if not self.routers[0].shares_load:
            return
        force = now >= self._next_refresh
        if force:
            self._next_refresh = now + LOAD_REFRESH_S
        for router in self.routers:
            report = router.load_report(force)
            if report is not None:
                self.loads.accept(report, now)
        sums = self.loads.due(now)
        if sums is not None:
            for router in self.routers:
                router.apply_cluster_load(sums.loads, sums.placed, sums.routers, sums.heads)

    def start(self, view: ClusterView, now: float) -> None:
        self.tick(view, now)

    def _request(self, request: SimRequest) -> Request:
        """The request as the library's helpers describe it to the router."""
        blocks = caller_blocks(request, self.block_tokens)
        return Request(
            key=affinity_key(request, self.block_tokens),
            modality=request.signature,
            session=request.session if self.sessions else None,
            cost=max(1, request.input_tokens),
            blocks=text_ids(blocks) if self.text_blocks else blocks,
            block_size=self.block_tokens,
            engine_blocks=not self.text_blocks,
        )

    def admit(self, request: SimRequest, now: float) -> bool:
        """The request joins its router's waiting room (`Router.turn`), as `Router.call` and the transports have it
        wait: it goes at once when granted at once, else when `released` finds its ticket granted."""
        self.now = now
        router = self.routers[request.id % len(self.routers)]
        if not router.holds:
            return True
        ticket = router.turn(self._request(request))
        self._tickets[request.id] = ticket
        if ticket.granted:
            return True
        self._held[request.id] = request
        return False

    def released(self, now: float) -> list[SimRequest]:
        self.now = now
        given = sum(r.turns.counts["granted"] + r.turns.counts["expired"] for r in self.routers)
        if given == self._given:  # no turn given since the last look: nothing to scan
            return []
        self._given = given
        out = [r for r in self._held.values() if self._tickets[r.id].granted]
        for r in out:
            del self._held[r.id]
        return out

    @property
    def holding(self) -> int:
        return len(self._held)

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        self.now = now
        router = self.routers[request.id % len(self.routers)]
        ticket = self._tickets.pop(request.id, None)
        lease = router.request(ticket.request if ticket else self._request(request), exclude=exclude, turn=ticket)
        self._leases[request.id] = lease
        return lease.node_id

    def dispatched(self, node: str, request: SimRequest, now: float) -> None:
        self.now = now
        self._leases[request.id].begin()

    def first_token(self, node: str, request: SimRequest, now: float) -> None:
        self.now = now
        lease = self._leases.get(request.id)
        if lease is not None:
            lease.first_token()

    def retransmitted(self, node: str, request: SimRequest, segments: int, now: float) -> None:
        """Counted on the attempt's lease, as the httpx transports count what `TCP_INFO` says."""
        self.now = now
        lease = self._leases.get(request.id)
        if lease is not None:
            lease.retransmitted(segments)

    def finished(self, node: str, request: SimRequest, now: float, outcome: SimOutcome) -> None:
        self.now = now
        lease = self._leases.pop(request.id, None)
        if lease is None:
            return
        if outcome is SimOutcome.CONNECT_ERROR:
            lease.fail(Outcome.CONNECT)
        lease.end()

    def close(self) -> None:
        """Close the routers, then the brain, each whatever the others do."""
        with ExitStack() as stack:
            stack.callback(self.brain.close)
            for router in reversed(self.routers):
                stack.callback(router.close)
