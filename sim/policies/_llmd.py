"""llm-d's inference scheduler (the Gateway API Inference Extension endpoint picker) in its default profile.

Sources: kubernetes-sigs/gateway-api-inference-extension (v1.x, 2025): the chart's `default-plugins.yaml`
(`config/charts/inferencepool/templates/epp-config.yaml`: queue-scorer weight 2, kv-cache-utilization-scorer
weight 2, prefix-cache-scorer weight 3, max-score picker); under `pkg/epp/scheduling/framework/plugins/`,
`scorer/queue.go`, `scorer/kvcache_utilization.go`, `multi/prefix/plugin.go` and `indexer.go`
(DefaultLRUCapacityPerServer 31250, DefaultMaxPrefixBlocks 256 of 64 characters, PodActiveCheckInterval 2 min)
and `picker/max_score_picker.go`; `pkg/epp/server/runserver.go` (DefaultRefreshMetricsInterval 50 ms).
llm-d/llm-d `guides/inference-scheduling`: llm-d-inference-scheduler v0.5.0 running that profile, vLLM pods with
readinessProbe periodSeconds 5, failureThreshold 3.

Each candidate pod scores `wp * prefix + wq * queue + wk * kv` and the highest wins, ties broken at random. Two
weightings are replayed: `llm-d` with prefix 2, queue 2, KV utilisation 3 (the weights the evaluation was
specified with for "llm-d-style scoring") and `llm-d-chart` with the chart's default-plugins.yaml weights 3, 2, 2.
- prefix: blocks matched / blocks of the request, from the scheduler's own index: walking the request's chained
  block hashes, each hash held by some pod adds 1 to every pod holding it, stopping at the first hash nobody
  holds. After each pick the request's hashes join the picked pod's LRU (capacity per pod); an evicted hash
  leaves that pod. Every 2 min pods no longer in the pool are dropped from the index.
- queue: `(max - waiting) / (max - min)` over the candidates' `vllm:num_requests_waiting`, 1 when all equal.
- kv: `1 - vllm:kv_cache_usage_perc`.
Metrics are scraped every 50 ms (the tick); a failed scrape keeps the pod's last metrics, as the EPP does. Pods
leave the candidate set only when Kubernetes marks them NotReady: readiness probes every 5 s, 3 failures in a row
(one success makes them Ready again).

Simplifications and mappings:
- The index hashes are the request's block ids (chained like the EPP's hashes; the model name adds nothing for a
  single model). The EPP hashes 64 characters (about 16 tokens) per block and matches at most 256 blocks: about
  4096 tokens, so `4096 // block_tokens` blocks here (8 at 512-token blocks). Its LRU holds 31250 hashes per pod
  (500K tokens): `500000 // block_tokens` entries here (976 at 512). AutoTune would size it from the pod's
  `num_gpu_blocks`, which the replay's `/metrics` does not export.
- Readiness probes are `view.stats(name)` (vLLM's /v1/models fails whenever /metrics does), all pods on one
  5 s schedule from time 0; Kubernetes' propagation of the Ready condition to the EPP is instant.
- The simulator's `exclude` removes pods from the candidates; with no candidate (the EPP answers 503) the first
  node not excluded is returned. The tie-break RNG is seeded.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from .._types import ClusterView, EngineStats, Policy, SimRequest
from .._workload import BLOCK_TOKENS
from ._fallback import first_not_excluded
from ._matches import leading_matches
from ._readiness import Readiness

ISSUE_WEIGHTS = (2.0, 2.0, 3.0)
"""(prefix, queue, KV utilisation) as the evaluation was specified with them."""
CHART_WEIGHTS = (3.0, 2.0, 2.0)
"""(prefix, queue, KV utilisation) in the inferencepool chart's default-plugins.yaml."""
REFRESH_METRICS_INTERVAL_S = 0.05
READINESS_PERIOD_S = 5.0
READINESS_FAILURE_THRESHOLD = 3
POD_CLEANUP_INTERVAL_S = 120.0
MAX_PREFIX_TOKENS = 256 * 16
LRU_CAPACITY_TOKENS = 31250 * 16
_NO_METRICS = EngineStats(running=0, waiting=0, kv_usage=0.0, prefix_queries_tokens=0, prefix_hits_tokens=0)


class PrefixIndex:
    """The prefix-cache scorer's indexer: an LRU of block hashes per pod and the pods holding each hash."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: dict[str, OrderedDict[int, None]] = {}
        self.pods: dict[int, set[str]] = {}

    def add(self, hashes: tuple[int, ...], pod: str) -> None:
        """Record that `pod` was sent `hashes`, evicting its least recently added ones beyond capacity."""
        lru = self.lru.setdefault(pod, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
            self.pods.setdefault(h, set()).add(pod)
            if len(lru) > self.capacity:
                old, _ = lru.popitem(last=False)
                self._forget(old, pod)

    def match(self, hashes: tuple[int, ...]) -> dict[str, int]:
        """Per pod, the hashes it holds among the leading run of hashes some pod holds."""
        return leading_matches(self.pods, hashes)

    def remove_pod(self, pod: str) -> None:
        """Forget everything indexed for `pod`."""
        for h in self.lru.pop(pod, {}):
            self._forget(h, pod)

    def _forget(self, h: int, pod: str) -> None:
        """Take `pod` off hash `h`'s holders."""
        pods = self.pods[h]
        pods.discard(pod)
        if not pods:
            del self.pods[h]


class LLMDScorer(Policy):
    """llm-d's scheduling profile: prefix-cache, queue and KV-utilisation scorers with the given weights."""

    tick_s = REFRESH_METRICS_INTERVAL_S

    def __init__(
        self,
        block_tokens: int = BLOCK_TOKENS,
        seed: int = 0,
        weights: tuple[float, float, float] = ISSUE_WEIGHTS,
        name: str = "llm-d",
    ) -> None:
        self.name = name
        self.weights = weights
        self.max_blocks = MAX_PREFIX_TOKENS // block_tokens
        self.index = PrefixIndex(LRU_CAPACITY_TOKENS // block_tokens)
        self._rng = random.Random(seed)
        self.names: list[str] = []
        self.metrics: dict[str, EngineStats] = {}
        self.readiness = Readiness(READINESS_PERIOD_S, READINESS_FAILURE_THRESHOLD)
        self.ready: set[str] = set()
        self._next_cleanup = 0.0

    def start(self, view: ClusterView, now: float) -> None:
        self.names = [n.name for n in view.nodes]
        self.metrics = dict.fromkeys(self.names, _NO_METRICS)
        self.ready = self.readiness.start(self.names, now)
        self._next_cleanup = now + POD_CLEANUP_INTERVAL_S

    def tick(self, view: ClusterView, now: float) -> None:
        for name in self.names:
            stats = view.stats(name)
            if stats is not None:
                self.metrics[name] = stats
        self.readiness.tick(view, now)
        if now >= self._next_cleanup:
            for pod in [p for p in self.index.lru if p not in self.ready]:
                self.index.remove_pod(pod)
            self._next_cleanup += POD_CLEANUP_INTERVAL_S

    def scores(self, request: SimRequest, candidates: list[str]) -> dict[str, float]:
        """Weighted sum of the three scorers for each candidate."""
        hashes = request.blocks[: self.max_blocks]
        matched = self.index.match(hashes)
        waiting = [self.metrics[n].waiting for n in candidates]
        high, low = max(waiting), min(waiting)
        out: dict[str, float] = {}
        w_prefix, w_queue, w_kv = self.weights
        for name in candidates:
            prefix = matched.get(name, 0) / len(hashes) if hashes else 0.0
            stats = self.metrics[name]
            queue = 1.0 if high == low else (high - stats.waiting) / (high - low)
            out[name] = w_prefix * prefix + w_queue * queue + w_kv * (1.0 - stats.kv_usage)
        return out

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        candidates = [n for n in self.names if n in self.ready and n not in exclude]
        if not candidates:
            return first_not_excluded(self.names, exclude)
        scores = self.scores(request, candidates)
        self._rng.shuffle(candidates)
        chosen = max(candidates, key=scores.__getitem__)
        self.index.add(request.blocks[: self.max_blocks], chosen)
        return chosen
