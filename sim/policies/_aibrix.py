"""AIBrix's `prefix-cache` routing: its own index of the prompt prefixes it has routed, the best match among
pods that are not overloaded, least running requests when the pods' loads drift apart.

Source: vllm-project/aibrix at e3e10f9e4aebe9aac5e7d992fb87d2648e01628b: `pkg/plugins/gateway/algorithms/
prefix_cache.go` (`routeOriginal`, `getTargetPodListOnLoadImbalance`, `getTargetPodFromMatchedPods`,
`PostRouteUpdate`), `least_request.go` (`selectTargetPodWithLeastRequestCount`, `getRequestCounts`), `util.go`
(`mean`, `standardDeviation`), `pkg/utils/prefixcacheindexer/hash.go` (`PrefixHashTable`: `getPrefixHashes`,
`seqSearchPrefix`, `matchPods`, `AddPrefix`), `pkg/utils/lrustore/lru_store.go`,
`pkg/utils/tokenizer/local_characters.go`, `pkg/cache/cache_trace.go` (the gateway's running-request count),
`pkg/utils/pod.go` (`FilterReadyPod`), and `samples/quickstart/model.yaml` (the vLLM pods' readiness probe). The
defaults are the code's: tokenizer `character`, AIBRIX_PREFIX_CACHE_BLOCK_SIZE 4, BLOCK_NUMBER 200000, eviction
every 1 s of entries not written for 20 min, POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT 8, STANDARD_DEVIATION_FACTOR
1, KV event sync off (the router never reads the engines' caches). The algorithm's README lists 128, 16 and 2 for
the block size, imbalance count and factor; the code, which runs, sets 4, 8 and 1.

Per request, over the ready pods and their running requests (requests the gateway has routed there and not
finished):
- the prompt's text, as bytes (the character tokenizer), is cut into blocks of 4 bytes, each hashed with its
  parent's hash (a chain); the last incomplete block is not hashed;
- load imbalance: when `max - min > 8`, only the pods with the fewest running requests stay candidates;
- matching walks the request's hashes through the index while some candidate holds the hash; a candidate
  missing a hash is out for the rest of the walk, and each one still in is matched at `(i + 1) * 100 // n`
  percent (integer) of the `n` hashes;
- the matched pods are sorted by percentage, highest first, then by running requests, fewest first (ties in
  random order), and the first whose running requests are at most `mean + 1 * stddev` over all ready pods (the
  sample standard deviation) wins;
- with no match, or no matched pod within that bound, the ready pod with the fewest running requests wins
  (random among ties);
- the winner is then recorded under every hash of the prompt (`AddPrefix`).
The index is one LRU over hashes, each with the pods it was routed to. Writing a hash makes it the most recent;
reading it does not. Beyond 200000 hashes the least recently written one is dropped, and every 1 s those
written more than 20 min ago are dropped too. A pod joins a hash's set and never leaves it: matching is limited
to the candidates. Pods leave the ready list when Kubernetes marks them NotReady: the quickstart's readiness
probe runs every 5 s and 5 failures in a row make the pod NotReady (one success makes it Ready again).

Simplifications and mappings:
- The index's hashes are the replay's block ids (chained like AIBrix's hashes). At 4 characters per token (the
  estimate `_sglang` uses), a 4-byte block is one token, so one replay block of `block_tokens` tokens stands for
  `block_tokens` of AIBrix's blocks, all held by the same pods. The match percentage is therefore the matched
  tokens (matched replay blocks times `block_tokens`, at most the prompt) over the prompt's text tokens. Where a
  prompt diverges inside a replay block, AIBrix would also match that block's identical leading bytes; the replay
  knows only whole blocks, so it counts none of them.
- The index's 200000 hashes of 4 bytes hold 800000 characters, or `200000 * 4 // (4 * block_tokens)` replay
  blocks (390 at 512-token blocks). Entries are dropped a whole replay block at a time, where AIBrix drops its
  4-byte blocks one by one.
- The running-request count is `WorkerOutcomes`' load (the count sgl-router keeps the same way). Its
  circuit-breaker bookkeeping is never read, because AIBrix has no circuit breaker.
- Readiness probes are `view.stats(name)` (vLLM's /health fails whenever /metrics does), all pods on one 5 s
  schedule from time 0. Kubernetes passes the Ready condition on to the gateway at once.
- The simulator's `exclude` removes pods from the ready list. With no ready pod left (AIBrix answers with an
  error), the first node not excluded is returned. Go's random tie-breaks use a seeded RNG.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

from .._types import ClusterView, Policy, SimRequest
from .._workload import BLOCK_TOKENS
from ._fallback import first_not_excluded
from ._readiness import Readiness
from ._sglang import CHARS_PER_TOKEN, WorkerOutcomes

PREFIX_CACHE_BLOCK_SIZE = 4
"""Bytes of the character tokenizer's output (the prompt's UTF-8 text) per hashed block."""
PREFIX_CACHE_BLOCK_NUMBER = 200_000
"""Hashes the index holds, over all pods together."""
EVICTION_INTERVAL_S = 1.0
EVICTION_DURATION_S = 20 * 60.0
POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT = 8
STANDARD_DEVIATION_FACTOR = 1
READINESS_PERIOD_S = 5.0
READINESS_FAILURE_THRESHOLD = 5


class PrefixHashTable:
    """AIBrix's prefix index: an LRU of block hashes ordered by their last write, each with its pods."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, tuple[float, set[str]]] = OrderedDict()
        """block -> (time of its last write, pods it was routed to), least recently written first."""

    def add(self, blocks: tuple[int, ...], pod: str, now: float) -> None:
        """`AddPrefix`: write each block in order with `pod` added to its pods, dropping the least recently written
        beyond capacity (so a prompt's first blocks go before its last ones)."""
        for block in blocks:
            entry = self.entries.pop(block, None)
            pods = entry[1] if entry is not None else set()
            pods.add(pod)
            self.entries[block] = (now, pods)
            if len(self.entries) > self.capacity:
                self.entries.popitem(last=False)

    def match(self, blocks: tuple[int, ...], candidates: list[str]) -> dict[str, int]:
        """`seqSearchPrefix`: per candidate still in the walk, the leading blocks it holds. The walk stops at a
        block nobody holds or that no remaining candidate holds. Reading does not refresh an entry."""
        remaining = set(candidates)
        matched: dict[str, int] = {}
        for i, block in enumerate(blocks):
            entry = self.entries.get(block)
            if entry is None:
                break
            remaining &= entry[1]
            if not remaining:
                break
            for pod in remaining:
                matched[pod] = i + 1
        return matched

    def expire(self, now: float, ttl_s: float) -> None:
        """Drop the entries last written more than `ttl_s` ago (the oldest come first in write order)."""
        while self.entries:
            written, _ = next(iter(self.entries.values()))
            if now - written <= ttl_s:
                return
            self.entries.popitem(last=False)


class AIBrixPrefixCache(WorkerOutcomes, Policy):
    """AIBrix gateway `prefix-cache` routing with its code's defaults and Kubernetes readiness."""

    name = "aibrix-prefix"
    tick_s = EVICTION_INTERVAL_S

    def __init__(
        self,
        block_tokens: int = BLOCK_TOKENS,
        seed: int = 0,
        imbalance_abs_count: int = POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT,
        standard_deviation_factor: float = STANDARD_DEVIATION_FACTOR,
    ) -> None:
        super().__init__()
        self.block_tokens = block_tokens
        self.imbalance_abs_count = imbalance_abs_count
        self.standard_deviation_factor = standard_deviation_factor
        self.index = PrefixHashTable(
            PREFIX_CACHE_BLOCK_NUMBER * PREFIX_CACHE_BLOCK_SIZE // (CHARS_PER_TOKEN * block_tokens)
        )
        self._rng = random.Random(seed)
        self.readiness = Readiness(READINESS_PERIOD_S, READINESS_FAILURE_THRESHOLD)
        self.ready: set[str] = set()

    def start(self, view: ClusterView, now: float) -> None:
        self.start_workers(view)
        self.ready = self.readiness.start(self.names, now)

    def tick(self, view: ClusterView, now: float) -> None:
        self.index.expire(now, EVICTION_DURATION_S)
        self.readiness.tick(view, now)

    @staticmethod
    def hashes(request: SimRequest) -> int:
        """How many 4-byte blocks AIBrix hashes of the request's text (its media parts are not text)."""
        return (request.input_tokens - request.media_tokens) * CHARS_PER_TOKEN // PREFIX_CACHE_BLOCK_SIZE

    def match_percent(self, request: SimRequest, blocks: int) -> int:
        """The percentage AIBrix gives a pod holding the request's first `blocks` replay blocks: the 4-byte
        blocks they stand for, at most the text's, over the text's."""
        hashes = self.hashes(request)
        matched = min(blocks * self.block_tokens * CHARS_PER_TOKEN // PREFIX_CACHE_BLOCK_SIZE, hashes)
        return matched * 100 // hashes

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        ready = [n for n in self.names if n in self.ready and n not in exclude]
        if not ready:
            return first_not_excluded(self.names, exclude)
        load = {n: self.workers[n].load for n in ready}
        fewest = min(load.values())
        candidates = ready
        if max(load.values()) - fewest > self.imbalance_abs_count:
            candidates = [n for n in ready if load[n] == fewest]
        hashed = self.hashes(request) > 0
        matched = self.index.match(request.blocks, candidates) if hashed else {}
        chosen = self._best_match(request, matched, load) if matched else None
        if chosen is None:
            chosen = self._rng.choice([n for n in ready if load[n] == fewest])
        if hashed:
            self.index.add(request.blocks, chosen, now)
        return chosen

    def _best_match(self, request: SimRequest, matched: dict[str, int], load: dict[str, int]) -> str | None:
        """`getTargetPodFromMatchedPods`: the highest percentage, then fewest running requests, whose running
        requests are at most mean + factor * stddev over every ready pod; None when no matched pod is."""
        counts = list(load.values())
        mean = sum(counts) / len(counts)
        stddev = math.sqrt(sum((c - mean) ** 2 for c in counts) / (len(counts) - 1)) if len(counts) > 1 else 0.0
        bound = mean + self.standard_deviation_factor * stddev
        percent = {pod: self.match_percent(request, blocks) for pod, blocks in matched.items()}
        pods = sorted(matched)
        self._rng.shuffle(pods)
        pods.sort(key=lambda pod: (-percent[pod], load[pod]))
        return next((pod for pod in pods if load[pod] <= bound), None)
