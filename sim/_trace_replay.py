"""Node vectors derived from a real request trace: a trace-driven queueing approximation, not an engine emulator.

The predictor's trace test and bench (`bench/predictor.py`) train and score it on node vectors replayed from
the public request traces (Azure LLM inference, Mooncake conversation): thousands of windows per node in
seconds, where the cluster replay (`_cluster.py`) runs real engine models. Each request goes to
one of N nodes, chosen uniformly at random with a fixed seed; each node is the following model, evaluated
request by request in arrival order:

- Prefill is one FIFO server: a request starts prefill when the previous one has finished and the KV cache
  has room for its input + output tokens (admission waits for the earliest decodes to finish, and a request
  larger than the cache waits for an empty one). Prefill takes `uncached input tokens / prefill rate`,
  slowed by `1 + decode_slowdown × running / max_running` while other requests decode (chunked prefill
  shares the GPU with the decode batch).
- The prefill rate is set so that the trace's input tokens would keep the average node's prefill server busy
  `utilisation` of the time without cache hits; each node's rate is scaled by its own speed factor, drawn
  uniformly from `speed_spread` (heterogeneous GPUs).
- Decode takes `output tokens × tpot_s × (1 + running / max_running)`, running counted at first token.
- The prefix cache (Mooncake only, which lists 512-token block hashes) is an LRU of `cache_blocks` blocks
  per node; leading blocks already cached are not prefilled again. Traces without block hashes report no
  KV miss ratio (absent, as an agent without KV events would).

Per window of `window_s` seconds each node reports a `NodeVector`, made by the agent's own `to_vector`: requests
waiting for prefill, running (admitted, not finished) and KV usage (their tokens over the cache size) at the end
of the window; arrivals per second; GPU utilisation (share of the window with any request admitted); CPU
utilisation (a base of 5% plus tokenisation of the window's arriving input tokens at `tokenize_tokens_per_s`);
prefix-cache miss ratio of the blocks admitted in the window; and the TTFT P50/P95/P99 of requests whose first
token came in the window under the latency key "engine" (as the agent's engine source reports finished requests).
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prismlb.agent._node import NodeState, to_vector
from prismlb.semantics import ENGINE_LATENCY_KEY, quantile
from prismlb.wire import ModalityLatency, NodeMetrics, NodeVector

from ._tracefile import load_trace
from ._traces import traces_dir
from ._workload import BLOCK_TOKENS, MOONCAKE_TRACE

TRACES = traces_dir()
AZURE_CONV = TRACES / "azure" / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = TRACES / "azure" / "AzureLLMInferenceTrace_code.csv"
MOONCAKE_CONVERSATION = TRACES / MOONCAKE_TRACE


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """The queueing model's parameters; see the module docstring."""

    nodes: int = 8
    window_s: float = 5.0
    """Each node's vector period: one `NodeVector` per node per window."""
    utilisation: float = 0.5
    """Share of the time the average node's prefill server would be busy with the trace's input tokens, cache
    hits left out: sets the prefill rate."""
    speed_spread: tuple[float, float] = (0.75, 1.25)
    """Bounds of the uniform draw of each node's speed factor on that rate."""
    kv_capacity_tokens: int = 262_144
    """A node's KV cache: admitted requests' input + output tokens at most."""
    max_running: int = 32
    """Requests in the decode batch at which each output token takes twice `tpot_s`."""
    decode_slowdown: float = 0.5
    """Share of that slowdown prefill takes (chunked prefill shares the GPU with the batch)."""
    tpot_s: float = 0.02
    """Seconds per output token with nothing else decoding."""
    cache_blocks: int = 2_048
    """A node's LRU prefix cache, in blocks of the trace's block size."""
    tokenize_tokens_per_s: float = 50_000.0
    """Host CPU tokenising speed: the time a window's arriving input tokens take at it adds to the CPU base."""
    seed: int = 0
    """Seeds each request's node and each node's speed factor."""


@dataclass(frozen=True, slots=True)
class _Served:
    arrival_s: float
    start_s: float
    first_token_s: float
    finish_s: float
    kv_tokens: int
    input_tokens: int
    blocks: int
    cached_blocks: int


def read_azure(path: Path = AZURE_CONV, limit: int | None = None) -> list[TraceRequest]:
    """Azure LLM inference trace (`TIMESTAMP, ContextTokens, GeneratedTokens`), arrivals from 0 s, read by the
    cluster replay's loader; without blocks, since the trace has no prefix information."""
    return [TraceRequest(r.arrival_s, r.input_tokens, r.output_tokens) for r in load_trace(path, limit=limit).requests]


def read_mooncake(path: Path = MOONCAKE_CONVERSATION, limit: int | None = None, seed: int = 0) -> list[TraceRequest]:
    """Mooncake trace JSON lines (`timestamp` ms, `input_length`, `output_length`, `hash_ids`), read by the cluster
    replay's loader: each arrival drawn (`seed`) within the 3 s its timestamp rounds to (`spread_over_resolution`)."""
    return [
        TraceRequest(r.arrival_s, r.input_tokens, r.output_tokens, r.blocks)
        for r in load_trace(path, limit=limit, seed=seed).requests
    ]


def _cached_prefix(cache: OrderedDict[int, None], blocks: tuple[int, ...], capacity: int) -> int:
    """Leading blocks already cached; all of the request's blocks become the most recently used."""
    hits = 0
    for block in blocks:
        if block not in cache:
            break
        hits += 1
    for block in blocks:
        cache[block] = None
        cache.move_to_end(block)
    while len(cache) > capacity:
        cache.popitem(last=False)
    return hits


def _serve(requests: Sequence[TraceRequest], prefill_tokens_per_s: float, config: ReplayConfig) -> list[_Served]:
    """One node: FIFO prefill under KV-cache admission, decode batch, LRU prefix cache."""
    served: list[_Served] = []
    decoding: list[tuple[float, int]] = []  # (finish time, KV tokens) of admitted requests
    kv_used = 0
    prefill_free_s = 0.0
    cache: OrderedDict[int, None] = OrderedDict()
    for r in requests:
        start = max(r.arrival_s, prefill_free_s)
        kv_tokens = min(config.kv_capacity_tokens, r.input_tokens + r.output_tokens)
        while decoding and (decoding[0][0] <= start or kv_used + kv_tokens > config.kv_capacity_tokens):
            finish, tokens = heapq.heappop(decoding)
            start = max(start, finish)
            kv_used -= tokens
        cached = _cached_prefix(cache, r.blocks, config.cache_blocks)
        uncached = max(1, r.input_tokens - cached * BLOCK_TOKENS)
        slowdown = 1.0 + len(decoding) / config.max_running
        first_token = start + uncached / prefill_tokens_per_s * (1.0 + config.decode_slowdown * (slowdown - 1.0))
        finish = first_token + r.output_tokens * config.tpot_s * slowdown
        heapq.heappush(decoding, (finish, kv_tokens))
        kv_used += kv_tokens
        prefill_free_s = first_token
        served.append(
            _Served(r.arrival_s, start, first_token, finish, kv_tokens, r.input_tokens, len(r.blocks), cached)
        )
    return served


def _busy_intervals(served: Sequence[_Served]) -> list[tuple[float, float]]:
    """Merged [admission, finish] intervals: when the node's GPU had any request."""
    merged: list[tuple[float, float]] = []
    for s in sorted(served, key=lambda s: s.start_s):
        if merged and s.start_s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], s.finish_s))
        else:
            merged.append((s.start_s, s.finish_s))
    return merged


def _node_vectors(node_id: str, served: Sequence[_Served], windows: int, config: ReplayConfig) -> list[NodeVector]:
    """One vector per window from the node's served requests."""
    w = config.window_s
    arrivals = [s.arrival_s for s in served]
    starts = sorted(s.start_s for s in served)
    by_finish = sorted(served, key=lambda s: s.finish_s)
    finishes = [s.finish_s for s in by_finish]
    by_start = sorted(served, key=lambda s: s.start_s)
    kv_started = [0, *_cumulative(s.kv_tokens for s in by_start)]
    kv_finished = [0, *_cumulative(s.kv_tokens for s in by_finish)]
    by_first = sorted(served, key=lambda s: s.first_token_s)
    first_tokens = [s.first_token_s for s in by_first]
    busy = _busy_intervals(served)
    vectors = []
    for k in range(windows):
        lo, hi = k * w, (k + 1) * w
        arrived_total = bisect.bisect_right(arrivals, hi)
        started_total = bisect.bisect_right(starts, hi)
        finished_total = bisect.bisect_right(finishes, hi)
        arrived = served[bisect.bisect_right(arrivals, lo) : arrived_total]
        admitted = by_start[bisect.bisect_right(starts, lo) : started_total]
        ttft = sorted(
            1000.0 * (s.first_token_s - s.arrival_s)
            for s in by_first[bisect.bisect_right(first_tokens, lo) : bisect.bisect_right(first_tokens, hi)]
        )
        busy_s = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in busy if a < hi and b > lo)
        blocks = sum(s.blocks for s in admitted)
        latency = {}
        if ttft:
            latency[ENGINE_LATENCY_KEY] = ModalityLatency(
                requests=len(ttft),
                ttft_p50_ms=quantile(ttft, 0.50),
                ttft_p95_ms=quantile(ttft, 0.95),
                ttft_p99_ms=quantile(ttft, 0.99),
            )
        metrics = NodeMetrics(
            cpu_util_ratio=min(1.0, 0.05 + sum(s.input_tokens for s in arrived) / (w * config.tokenize_tokens_per_s)),
            gpu_util_ratio=min(1.0, busy_s / w),
            kv_cache_usage_ratio=min(
                1.0, (kv_started[started_total] - kv_finished[finished_total]) / config.kv_capacity_tokens
            ),
            kv_cache_miss_ratio=1.0 - sum(s.cached_blocks for s in admitted) / blocks if blocks else None,
            requests_running=started_total - finished_total,
            requests_waiting=arrived_total - started_total,
            requests_per_s=len(arrived) / w,
        )
        vectors.append(
            to_vector(
                NodeState(metrics=metrics, gpus=[], kv=None, latency=latency),
                node_id=node_id,
                host=node_id,
                endpoint=f"http://{node_id}:8000",
                labels={},
                seq=k,
                sample_time_unix_s=hi,
                period_s=w,
                started_unix_s=None,
            )
        )
    return vectors


def _cumulative(values: Iterable[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def replay(requests: Sequence[TraceRequest], config: ReplayConfig = ReplayConfig()) -> list[list[NodeVector]]:
    """Node vectors per window (outer list, in time order), one per node (inner list, node order)."""
    rng = random.Random(config.seed)
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    mean_rate = sum(r.input_tokens for r in requests) / (span_s * config.nodes * config.utilisation)
    per_node: list[list[TraceRequest]] = [[] for _ in range(config.nodes)]
    for r in requests:
        per_node[rng.randrange(config.nodes)].append(r)
    speeds = [rng.uniform(*config.speed_spread) for _ in range(config.nodes)]
    windows = int(requests[-1].arrival_s // config.window_s)
    columns = [
        _node_vectors(f"node-{i}", _serve(node_requests, mean_rate * speed, config), windows, config)
        for i, (node_requests, speed) in enumerate(zip(per_node, speeds, strict=True))
    ]
    return [list(window) for window in zip(*columns, strict=True)]
