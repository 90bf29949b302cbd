"""A full-information reference for the replay: what placement could reach if a router knew everything.

Not a router and not a baseline: `FullInformation` reads the simulated engines themselves (`_View.truth`), which no
router can. For each request it computes every live node's time to first token from the engine's true state: the
prompt in prefill and its end, every queued prompt's tokens its cache will lack (the queued prompts before it
cached by then), the request's own uncached tokens and media encoding, all at the GPU's true speed (a throttled
GPU's included), stretched as the engine stretches prefill beside its decode batch, plus the retransmission stall
its true segment loss costs. Foreign work (requests no policy placed) is in the engine's queue, so in the figure.

It then takes the least such time, or, with an affinity above 1, the node holding the longest prefix of the prompt
while its time is within `Settings.affinity` times the least: Prism's own rule with perfect inputs in place of the
router's (the prefix index's delayed events, the routers' shared queue counts, the agents' measured speeds).

Its goodput against Prism's says how much of Prism's gap to an ideal is information and how much is the rule:
placement is one decision per request, in order, without knowing what comes next, so no router with these
inputs does better by seeing more. It is not an upper bound on every policy: a rule that looks ahead (holding
capacity back for a burst to come) is outside it, and `Lookahead` measures what that could add, with a perfect
forecast. Its estimate leaves out what an engine's admission adds (a full batch or cache holding the queue's head
back) and requests still in their retransmission stall.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from prismlb.router import Settings
from prismlb.semantics import Slice

from ._cluster import RTO_S, _Node, _View, engine_job, segments
from ._model import DECODE_INTERFERENCE, EngineModel, GpuClass, Job, cached_tokens
from ._slo import pool_classes, slo_s
from ._types import ClusterView, Policy, SimRequest
from .policies._fallback import first_not_excluded


@dataclass(slots=True)
class _Queue:
    """What the oracle has read of one engine's waiting queue: its jobs in order, each with the prompt tokens it
    is expected to compute, and the blocks they will have cached once admitted."""

    jobs: deque[tuple[Job, int]] = field(default_factory=deque)
    blocks: Counter[int] = field(default_factory=Counter)
    """Block id → queued jobs holding it (0: none, until the queue empties)."""
    tokens: int = 0
    encoder_s: float = 0.0

    def sync(self, model: EngineModel, block_tokens: int) -> None:
        """Follow the engine's FCFS queue: jobs admitted since leave from the head, new ones join at the tail."""
        waiting = model.waiting
        while self.jobs and (not waiting or self.jobs[0][0] is not waiting[0]):
            job, tokens = self.jobs.popleft()
            self.tokens -= tokens
            self.encoder_s -= job.encoder_s
            self.blocks.subtract(job.blocks)
        if not self.jobs:
            self.encoder_s = 0.0
            self.blocks.clear()  # the counts left are zeros: dropped while nothing is queued
        for job in itertools.islice(waiting, len(self.jobs), None):
            held = _held(job.blocks, model, self)
            tokens = job.prompt_tokens - cached_tokens(job.prompt_tokens, job.media_tokens, held, block_tokens)
            self.jobs.append((job, tokens))
            self.tokens += tokens
            self.encoder_s += job.encoder_s
            self.blocks.update(job.blocks)


def _held(blocks: Sequence[int], model: EngineModel, queue: _Queue) -> int:
    """How many of the leading blocks will be cached on the engine once its queue is admitted."""
    held = 0
    for block in blocks:
        if not queue.blocks[block] and not model.cached(block):
            break
        held += 1
    return held


def _expected(
    request: SimRequest, model: EngineModel, queue: _Queue, loss: float, now: float, block_tokens: int
) -> tuple[float, int]:
    """The request's true time to first token on the engine `model` (`queue`: what has been read of its queue) if
    sent now to a node losing `loss` of its segments, and its leading blocks cached there."""
    queue.sync(model, block_tokens)
    profile = model.profile
    rate = profile.prefill_tokens_per_s
    held = _held(request.blocks, model, queue)
    cached = cached_tokens(request.input_tokens, request.media_tokens, held, block_tokens)
    own_s = profile.media_s(request.media) + (request.input_tokens - cached) / rate
    queued_s = queue.encoder_s + queue.tokens / rate
    stretch = 1 + DECODE_INTERFERENCE * model.decoding / profile.max_batch
    prefilling_s = model.prefill_end_s - now if model.prefilling is not None else 0.0
    return max(0.0, prefilling_s) + (queued_s + own_s) * stretch + _stall_s(request, loss), held


def _stall_s(request: SimRequest, loss: float) -> float:
    """The retransmission stall a request's segments cost on average on a node losing `loss` of them."""
    return loss * segments(request) * RTO_S


Times = dict[str, tuple[float, int]]
"""Node name → (the request's true time to first token there, its leading blocks cached there)."""


def quickest(times: Times) -> str:
    """The node with the least time (the first of equals)."""
    return min(times, key=lambda name: times[name][0])


def deepest(times: Times) -> str:
    """The node holding the longest prefix, the quickest of equals."""
    return max(times, key=lambda name: (times[name][1], -times[name][0]))


class FullInformation(Policy):
    """The least true time to first token, or the longest prefix's holder within `affinity` of it (1: always the
    least); the module says what it reads and what it leaves out."""

    name = "oracle"

    def __init__(self, *, block_tokens: int, affinity: float = Settings().cache_affinity) -> None:
        self.block_tokens = block_tokens
        self.settings = Settings(cache_affinity=affinity)
        self._view: _View | None = None
        self._queues: dict[str, _Queue] = {}
        self.classes: dict[Slice, frozenset[GpuClass]] = {}
        """The GPU classes of each slice's pool, for a request's SLO (`_slo.slo_s`)."""

    def start(self, view: ClusterView, now: float) -> None:
        if not isinstance(view, _View):
            raise TypeError("the full-information reference reads the replay's own engines: it runs in a Simulation")
        self._view = view
        self._queues = {node.name: _Queue() for node in view.nodes}
        self.classes = pool_classes([node.spec for info in view.nodes if (node := view.truth(info.name)) is not None])

    def expected(self, request: SimRequest, node: _Node, now: float) -> tuple[float, int]:
        """The request's time to first token on `node` if sent now, and how many of its leading blocks it would
        find cached there."""
        return _expected(request, node.model, self._queues[node.spec.name], node.loss, now, self.block_tokens)

    def times(self, request: SimRequest, now: float, exclude: frozenset[str]) -> Times:
        """Each live node's (time to first token, leading blocks cached) for the request (`expected`), but those in
        `exclude`."""
        assert self._view is not None, "start() first"
        out: Times = {}
        for info in self._view.nodes:
            node = self._view.truth(info.name)
            if node is not None and info.name not in exclude:
                out[info.name] = self.expected(request, node, now)
        return out

    def pick(self, request: SimRequest, times: Times) -> str:
        """The rule: the holder of the longest prefix while within the affinity of the least time, else the least
        (`times` is not empty)."""
        best, deep = quickest(times), deepest(times)
        held = times[deep][1]
        if held and times[deep][0] <= self.settings.affinity(held, len(request.blocks)) * times[best][0]:
            return deep
        return best

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        times = self.times(request, now, exclude)
        if times:
            return self.pick(request, times)
        assert self._view is not None
        return first_not_excluded([n.name for n in self._view.nodes], exclude)


class Lookahead(FullInformation):
    """The oracle, looking ahead: for each of its first `candidates` options (the rule's choice, the deepest holder,
    then the quickest nodes), it plays the replay's next `horizon` requests (which it knows: `_View.requests`) on
    copies of the engines, each placed by the oracle's rule, and takes the option under which the fewest of them
    and the request miss their SLO (`_slo.slo_s`), the least total time to first token of equals, the rule's choice
    of equals. A what-if by rollout, as a planner would do it with a perfect forecast: what looking ahead could add
    to a placement made one request at a time. Counting misses lets a rollout give up on requests already lost
    (the attainment a goodput search reads rises, and the tail with it); with `lateness` it weighs the seconds past
    each SLO instead. Rollouts leave out the node's foreign arrivals still to come."""

    name = "oracle-lookahead"
    HORIZON = 128
    """Requests each rollout plays after the one placed: on tenants-1 at 330% (2,000 requests) horizons of 8, 64 and
    128 (four options) attain 78.7%, 86.3% and 87.6% against the oracle's 84.4%: a short one misleads."""
    CANDIDATES = 8
    """Options each placement plays out (every node of the replay's clusters): at 330% on tenants-1, eight options
    with a horizon of 64 attain 91.1% against four options' 86.3%."""

    def __init__(
        self,
        *,
        block_tokens: int,
        affinity: float = Settings().cache_affinity,
        horizon: int = HORIZON,
        candidates: int = CANDIDATES,
        lateness: bool = False,
    ) -> None:
        super().__init__(block_tokens=block_tokens, affinity=affinity)
        self.horizon, self.candidates, self.lateness = horizon, candidates, lateness
        self._requests: Sequence[SimRequest] = ()
        self._index: dict[int, int] = {}

    def start(self, view: ClusterView, now: float) -> None:
        super().start(view, now)
        assert self._view is not None
        self._requests = self._view.requests
        self._index = {request.id: i for i, request in enumerate(self._requests)}

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        times = self.times(request, now, exclude)
        if not times:
            return super().choose(request, now, exclude)
        ranked = [self.pick(request, times), deepest(times), *sorted(times, key=lambda name: times[name][0])]
        options = list(dict.fromkeys(ranked))[: self.candidates]
        if len(options) == 1:
            return options[0]
        start = self._index[request.id] + 1
        future = self._requests[start : start + self.horizon]
        scores = {name: self.play(request, name, future, now, list(times)) for name in options}
        return min(options, key=scores.__getitem__)

    def play(
        self, request: SimRequest, first: str, future: Sequence[SimRequest], now: float, names: Sequence[str]
    ) -> tuple[float, float]:
        """(SLO misses, or with `lateness` the seconds past their SLOs, and the total time to first token) of
        `request` sent to `first` now and of `future` after it, each placed by the oracle's rule on `names`, on
        copies of their engines."""
        assert self._view is not None
        nodes = {name: node for name in names if (node := self._view.truth(name)) is not None}
        loss = {name: node.loss for name, node in nodes.items()}
        models = {name: node.model.copy() for name, node in nodes.items()}
        queues = {name: _Queue() for name in models}
        placed: list[tuple[SimRequest, Job, float]] = []
        waiting: dict[str, list[Job]] = {name: [] for name in models}
        for model in models.values():
            model.advance(now)
        target = first
        for arrival in (request, *future):
            t = max(now, arrival.arrival_s)
            if arrival is not request:
                for model in models.values():
                    model.advance(t)
                times = {
                    name: _expected(arrival, model, queues[name], loss[name], t, self.block_tokens)
                    for name, model in models.items()
                }
                target = self.pick(arrival, times)
            job = engine_job(arrival, models[target], t)
            models[target].submit(job, t)
            placed.append((arrival, job, _stall_s(arrival, loss[target])))
            waiting[target].append(job)
        for name, model in models.items():  # until its last placed job's first token, not to the batch's end
            while any(job.first_token_s is None for job in waiting[name]):
                model.advance(model.next_event_s())
        missed, total = 0.0, 0.0
        for arrival, job, stall in placed:
            assert job.first_token_s is not None
            ttft = job.first_token_s - arrival.arrival_s + stall
            over_s = ttft - slo_s(arrival, self.classes)
            missed += max(0.0, over_s) if self.lateness else over_s > 0
            total += ttft
        return missed, total
