"""NVIDIA Dynamo's KV router (`--router-mode kv`): a global prefix index fed by the engines' KV events, and the
worker with the lowest prefill-plus-decode cost wins.

Source: ai-dynamo/dynamo `lib/llm/src/kv_router/` at db19bd2a659d4cb04998fb4101cd0dbfbbeba9d4:
`scheduler.rs` (`DefaultWorkerSelector::select_worker`, `softmax_sample`), `sequence.rs`
(`ActiveSequences`: `potential_blocks_and_tokens`, `new_tokens`, `mark_prefill_completed`), `indexer.rs` (the
radix tree's `find_matches`: overlap and tree size per worker), with `KvRouterConfig::default()`:
overlap_score_weight 1.0, router_temperature 0.0, use_kv_events true, router_track_active_blocks true,
router_track_output_blocks false. The released frontend that `bench/live_routers.py` runs (ai-dynamo 1.6.1) dumps
the same defaults under their new names: overlap_score_credit 1.0 with no decay, router_temperature 0.0, no
router queue threshold, active blocks and prefill tokens tracked, output blocks not.

Per request, with `overlap(w)` the request's leading blocks the index places on worker `w`, the router's own
books of the requests it has in flight on each worker give
- `prefill_blocks(w) = (active_prefill_tokens(w) + input_tokens - overlap(w) * block_size) / block_size`, where
  `active_prefill_tokens` sums the same uncached-token count of the worker's requests still in prefill (until
  their first token);
- `decode_blocks(w) = active_blocks(w) + new_blocks(w)`: the distinct prompt blocks of the worker's requests in
  flight, plus the request's blocks not among them;
and the logit `overlap_score_weight * prefill_blocks + decode_blocks`. At temperature 0 the lowest logit wins;
ties go to the smallest tree (fewest indexed blocks), then at random. Above 0 the worker is drawn with
probability proportional to `exp(-(logit / (max - min)) / temperature)` (uniform when all logits are equal).

The index follows the KV events (`ClusterView.kv_events`): a stored block joins its worker, a removed one
leaves it. Matching walks the request's blocks while some worker holds the block, adding 1 to each holder.

Simplifications and mappings:
- Block size is the replay's block (512 tokens) rather than the engine's 16: both terms of the logit are in
  blocks, so the choice is the same up to partial blocks, and the softmax divides by the logits' range. The held
  blocks' tokens are capped at the prompt's text (`new_tokens`): with 16-token blocks a media part starts blocks of
  its own, so no overlap reaches past the text into the media.
- The router's queue (`router_queue_threshold`, requests held at the router while every worker is busy) is
  not modelled: the seam has no way to hold a request, and the engines queue it instead.
- Dead workers: Dynamo's push router reports an instance down when a request to it finds no responder; the
  worker then leaves the candidates and the index until service discovery lists it again, modelled as its
  `/metrics` answering at a tick.
- The simulator's `exclude` removes workers from the candidates; with none left the first node not excluded is
  returned. Random draws and tie-breaks use a seeded RNG.
"""

from __future__ import annotations

import math
import random

from .._cluster import KV_EVENT_DELAY_S
from .._model import cached_tokens
from .._types import ClusterView, Outcome, Policy, SimRequest
from .._workload import BLOCK_TOKENS
from ._fallback import first_not_excluded
from ._matches import leading_matches

OVERLAP_SCORE_WEIGHT = 1.0
ROUTER_TEMPERATURE = 0.0


class KvIndex:
    """The router's global view of cached blocks: each block's workers, and each worker's block count."""

    def __init__(self) -> None:
        self.workers: dict[int, set[str]] = {}
        self.size: dict[str, int] = {}

    def stored(self, worker: str, blocks: tuple[int, ...]) -> None:
        for block in blocks:
            holders = self.workers.setdefault(block, set())
            if worker not in holders:
                holders.add(worker)
                self.size[worker] = self.size.get(worker, 0) + 1

    def removed(self, worker: str, blocks: tuple[int, ...]) -> None:
        for block in blocks:
            holders = self.workers.get(block)
            if holders is not None and worker in holders:
                holders.discard(worker)
                self.size[worker] -= 1
                if not holders:
                    del self.workers[block]

    def remove_worker(self, worker: str) -> None:
        """Forget every block of a worker that went away."""
        for block in [b for b, holders in self.workers.items() if worker in holders]:
            self.removed(worker, (block,))
        self.size.pop(worker, None)

    def overlap(self, blocks: tuple[int, ...]) -> dict[str, int]:
        """Per worker, the blocks it holds among the leading run of blocks some worker holds."""
        return leading_matches(self.workers, blocks)


class _Active:
    """`ActiveSequences` of one worker: the router's requests in flight there."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        """Distinct prompt blocks of the requests in flight, with how many requests hold each."""
        self.prefill_tokens: dict[int, int] = {}
        """Uncached prompt tokens of the requests not past their first token, by request id."""
        self.requests: dict[int, tuple[int, ...]] = {}

    def add(self, request: SimRequest, prefill_tokens: int) -> None:
        self.requests[request.id] = request.blocks
        self.prefill_tokens[request.id] = prefill_tokens
        for block in request.blocks:
            self.blocks[block] = self.blocks.get(block, 0) + 1

    def free(self, request_id: int) -> None:
        self.prefill_tokens.pop(request_id, None)
        for block in self.requests.pop(request_id, ()):
            left = self.blocks[block] - 1
            if left:
                self.blocks[block] = left
            else:
                del self.blocks[block]

    def new_blocks(self, blocks: tuple[int, ...]) -> int:
        return sum(1 for b in blocks if b not in self.blocks)


class DynamoKvRouter(Policy):
    """Dynamo's KV router with `KvRouterConfig`'s defaults (or the given weight and temperature)."""

    tick_s = KV_EVENT_DELAY_S

    def __init__(
        self,
        block_tokens: int = BLOCK_TOKENS,
        overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
        temperature: float = ROUTER_TEMPERATURE,
        seed: int = 0,
        name: str = "dynamo-kv",
    ) -> None:
        self.name = name
        self.block_tokens = block_tokens
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self._rng = random.Random(seed)
        self.names: list[str] = []
        self.up: set[str] = set()
        self.index = KvIndex()
        self.active: dict[str, _Active] = {}

    def start(self, view: ClusterView, now: float) -> None:
        self.names = [n.name for n in view.nodes]
        self.up = set(self.names)
        self.active = {n: _Active() for n in self.names}
        self._ingest(view)

    def tick(self, view: ClusterView, now: float) -> None:
        self._ingest(view)
        for name in self.names:
            if name not in self.up and view.stats(name) is not None:
                self.up.add(name)

    def _ingest(self, view: ClusterView) -> None:
        for event in view.kv_events():
            if event.node in self.up:
                self.index.removed(event.node, event.removed)
                self.index.stored(event.node, event.stored)

    def new_tokens(self, request: SimRequest, overlap: int) -> int:
        """The request's prompt tokens a worker holding its first `overlap` blocks must still compute: Dynamo counts
        its blocks of the engine's size (16 tokens), which a media part's tokens start anew, so the held blocks
        cover at most the prompt's text (the replay's last text block may be partial)."""
        return request.input_tokens - cached_tokens(
            request.input_tokens, request.media_tokens, overlap, self.block_tokens
        )

    def logits(self, request: SimRequest, candidates: list[str]) -> dict[str, float]:
        """Each candidate's cost: `overlap_score_weight * prefill_blocks + decode_blocks` (lower is better)."""
        overlap = self.index.overlap(request.blocks)
        out: dict[str, float] = {}
        for name in candidates:
            active = self.active[name]
            new_tokens = self.new_tokens(request, overlap.get(name, 0))
            prefill_blocks = (sum(active.prefill_tokens.values()) + new_tokens) / self.block_tokens
            decode_blocks = len(active.blocks) + active.new_blocks(request.blocks)
            out[name] = self.overlap_score_weight * prefill_blocks + decode_blocks
        return out

    def sample(self, logits: dict[str, float]) -> list[str]:
        """`softmax_sample`: the lowest logits at temperature 0 (several when tied), else one drawn worker."""
        low, high = min(logits.values()), max(logits.values())
        if self.temperature == 0.0:
            return [n for n, v in logits.items() if v == low]
        names = list(logits)
        if low == high:
            weights = [1.0] * len(names)
        else:
            scale = -1.0 / ((high - low) * self.temperature)
            weights = [math.exp((logits[n] - low) * scale) for n in names]
        draw, total, cumulative = self._rng.random(), sum(weights), 0.0
        for name, weight in zip(names, weights, strict=True):
            cumulative += weight / total
            if draw <= cumulative:
                return [name]
        return [names[-1]]

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        candidates = [n for n in self.names if n in self.up and n not in exclude]
        if not candidates:
            return first_not_excluded(self.names, exclude)
        best = self.sample(self.logits(request, candidates))
        if len(best) == 1:
            return best[0]
        sizes = [self.index.size.get(n, 0) for n in best]
        if len(set(sizes)) == 1:
            return self._rng.choice(best)
        return best[sizes.index(min(sizes))]

    def dispatched(self, node: str, request: SimRequest, now: float) -> None:
        overlap = self.index.overlap(request.blocks).get(node, 0)
        self.active[node].add(request, self.new_tokens(request, overlap))

    def first_token(self, node: str, request: SimRequest, now: float) -> None:
        self.active[node].prefill_tokens.pop(request.id, None)

    def finished(self, node: str, request: SimRequest, now: float, outcome: Outcome) -> None:
        self.active[node].free(request.id)
        if outcome is Outcome.CONNECT_ERROR and node in self.up:
            self.up.discard(node)
            self.index.remove_worker(node)
