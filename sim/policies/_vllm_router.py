"""The vLLM router's `kv_aware` policy (PyPI `vllm-router`): the longest cached prefix from the engines' KV events
wins, least load when nothing is cached.

Source: vllm-project/router (the Rust router forked from sgl-router): `src/policies/kv_aware.rs` at
dda6063bf6912c8113f840a8efe961163b6e19d9 (`KvAwarePolicy::select_with_scoring`, `KvAwareConfig::default()`:
block_size 16, enable_speculative true, speculative_ttl 2 s), `src/kv_index/scorer.rs` (`PrefixScorer::score`)
and `src/kv_index/index.rs` (`KVBlockIndex`: `on_block_stored`, `on_block_removed`, `speculative_insert`) at
2ec0ff0c55df8a5c9955b3c675760c08fac9e2ec, `src/policies/mod.rs` (`get_healthy_worker_indices`: healthy and
circuit breaker closed or half-open).

This is that source's policy, not the released wheel's: `vllm-router` 0.1.17, which `bench/live_routers.py`
runs, logs every decision as a `prefix_cost` choice (new prefill tokens after a credited cached prefix) and
spreads load where this model piles it (docs/benchmarks.md, "Live against the replay").

Per attempt, among the available workers (one alone is returned at once):
- each worker's score is the number of the request's leading blocks it holds without a gap (a worker missing
  block `i` scores at most `i`), from the index the KV events keep: `BlockStored` adds the worker to a block,
  `BlockRemoved` takes it off;
- the highest score wins, the last of the tied workers in worker order (Rust's `max_by_key`);
- if that score is 0 (no worker holds the first block), or the prompt has no full block, the least loaded
  worker wins (requests the router has in flight on it), the first of the tied (`min_by_key`);
- speculative indexing: the request's blocks from the best score on are entered for the chosen worker with a
  2 s time to live, so that requests with the same prefix arriving before the real events follow it; a real
  `BlockStored` makes such an entry permanent, an expired one no longer counts.

Simplifications and mappings:
- Block keys are the replay's block ids (512 tokens each) rather than hashes of 16-token blocks: a prefix
  score in 512-token blocks orders workers as one in 16-token blocks does, up to the partial last block.
- Health checks and circuit breakers are sgl-router's (`_sglang.py`), which the router inherits with their
  launcher defaults: probes every 60 s, 3 failures mark a worker unhealthy, 2 successes healthy again; 10
  failed attempts open a breaker for 60 s.
- The simulator's `exclude` removes workers from the candidates; with none left the first node not excluded is
  returned.
"""

from __future__ import annotations

from .._cluster import KV_EVENT_DELAY_S
from .._types import ClusterView, Policy, SimRequest
from ._fallback import first_not_excluded
from ._sglang import HEALTH_CHECK_INTERVAL_S, WorkerOutcomes

SPECULATIVE_TTL_S = 2.0


class BlockIndex:
    """`KVBlockIndex`: per block, the workers holding it and, for speculative entries, when they expire."""

    def __init__(self) -> None:
        self.holders: dict[int, dict[str, float]] = {}
        """block -> worker -> expiry (inf for entries from real events)."""

    def stored(self, worker: str, blocks: tuple[int, ...]) -> None:
        for block in blocks:
            self.holders.setdefault(block, {})[worker] = float("inf")

    def removed(self, worker: str, blocks: tuple[int, ...]) -> None:
        for block in blocks:
            holders = self.holders.get(block)
            if holders is not None:
                holders.pop(worker, None)
                if not holders:
                    del self.holders[block]

    def speculate(self, worker: str, blocks: tuple[int, ...], until: float) -> None:
        """Enter `blocks` for `worker` until `until`, except where it holds them from a real event."""
        for block in blocks:
            holders = self.holders.setdefault(block, {})
            if holders.get(worker) != float("inf"):
                holders[worker] = until

    def scores(self, blocks: tuple[int, ...], now: float) -> dict[str, int]:
        """`PrefixScorer::score`: per worker, the request's leading blocks it holds without a gap."""
        scores: dict[str, int] = {}
        alive: set[str] | None = None
        for i, block in enumerate(blocks):
            holding = {w for w, until in self.holders.get(block, {}).items() if until >= now}
            alive = holding if alive is None else alive & holding
            if not alive:
                break
            for worker in alive:
                scores[worker] = i + 1
        return scores

    def expire(self, now: float) -> None:
        """Drop speculative entries past their time to live (they already no longer count)."""
        for block in list(self.holders):
            holders = self.holders[block]
            for worker in [w for w, until in holders.items() if until < now]:
                del holders[worker]
            if not holders:
                del self.holders[block]


class VllmKvAware(WorkerOutcomes, Policy):
    """vllm-router `kv_aware` with `KvAwareConfig`'s defaults and sgl-router's health checks and breakers."""

    name = "vllm-kv-aware"
    tick_s = KV_EVENT_DELAY_S

    def __init__(self, speculative: bool = True, speculative_ttl_s: float = SPECULATIVE_TTL_S) -> None:
        super().__init__()
        self.speculative = speculative
        self.speculative_ttl_s = speculative_ttl_s
        self.index = BlockIndex()
        self._next_probe = 0.0

    def start(self, view: ClusterView, now: float) -> None:
        self.start_workers(view)
        self._next_probe = now
        self._ingest(view)

    def _ingest(self, view: ClusterView) -> None:
        for event in view.kv_events():
            self.index.removed(event.node, event.removed)
            self.index.stored(event.node, event.stored)

    def tick(self, view: ClusterView, now: float) -> None:
        self._ingest(view)
        if now >= self._next_probe:
            for name in self.names:
                self.workers[name].probe(view.stats(name) is not None)
            self.index.expire(now)
            self._next_probe += HEALTH_CHECK_INTERVAL_S

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        healthy = [n for n in self.names if self.workers[n].available(now) and n not in exclude]
        if not healthy:
            return first_not_excluded(self.names, exclude)
        if len(healthy) == 1:
            return healthy[0]
        if not request.blocks:
            return self._least_loaded(healthy)
        scores = self.index.scores(request.blocks, now)
        best = max(reversed(healthy), key=lambda n: scores.get(n, 0))
        best_score = scores.get(best, 0)
        chosen = best if best_score else self._least_loaded(healthy)
        if self.speculative and best_score < len(request.blocks):
            self.index.speculate(chosen, request.blocks[best_score:], now + self.speculative_ttl_s)
        return chosen

    def _least_loaded(self, candidates: list[str]) -> str:
        return min(candidates, key=lambda n: self.workers[n].load)
