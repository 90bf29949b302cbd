"""The demo's requests: the first requests of a trace (the Mooncake conversation trace unless another of the
replay's workloads is named), shrunk `TOKEN_SCALE` times.

A 512-token prefix block of the trace becomes 32 tokens of text, the same text for the same block id, so the
trace's prefix reuse reaches the engines' prefix caches; a trace without prefix information (Azure) gets blocks
of its own per request, so its prompts share nothing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prismlb.router import prefix_key
from prismlb.sim import BLOCK_TOKENS, PROFILES, resolve_workload
from prismlb.sim._engine import CHARS_PER_TOKEN
from prismlb.sim._model import KV_BLOCK_TOKENS

TRACE = "mooncake"
"""The demo's trace, by its name among the replay's workloads (`prismlb.sim.WORKLOADS`)."""
TOKEN_SCALE = 16
"""Each replayed request is its trace request shrunk this many times, prompt and output."""
BLOCK_CHARS = BLOCK_TOKENS // TOKEN_SCALE * CHARS_PER_TOKEN
KEY_PREFIX_TOKENS = 4 * BLOCK_TOKENS // TOKEN_SCALE
"""Prefix keys cover the first four trace blocks: every Mooncake request shares the first one (a system
prompt), and a conversation's later turns keep its first blocks."""
_WORDS = (
    "the model cache token prefix route node weight batch decode prefill latency tail span trace agent brain "
    "kernel table ring slice key block memory queue stream answer question context system user assistant "
    "vision audio video text retrieval vector index shard replica cluster request response"
).split()


@dataclass(frozen=True, slots=True)
class DemoRequest:
    index: int
    at_s: float
    """Arrival in trace seconds from the first request."""
    text: str
    max_tokens: int
    key: str
    """The affinity key: `prefix_key(text=...)` over the first KEY_PREFIX_TOKENS tokens, as a string."""
    blocks: tuple[int, ...] = ()
    """The trace's prefix block ids (Mooncake's `hash_ids`)."""


def _block_text(block_id: int, cache: dict[int, str]) -> str:
    """BLOCK_CHARS characters of words, the same for the same trace block id."""
    text = cache.get(block_id)
    if text is None:
        rng = random.Random(block_id)
        words: list[str] = []
        size = 0
        while size < BLOCK_CHARS:
            word = rng.choice(_WORDS)
            words.append(word)
            size += len(word) + 1
        text = cache[block_id] = " ".join(words)[: BLOCK_CHARS - 1] + " "
    return text


def load_requests(count: int, trace: str | Path = TRACE) -> list[DemoRequest]:
    """The first `count` requests of `trace`, shrunk TOKEN_SCALE times: any workload the replay names
    (`prismlb.sim.resolve_workload` at seed 1: a shared trace, a workload family `NAME[:seed]`, a trace file)
    whose requests are text alone, since the emulated engines take text. Raises ValueError for an unknown name or
    a workload with media, FileNotFoundError where the traces are not (PRISM_TRACES names their folder)."""
    workload = resolve_workload(trace, seed=1, limit=count)
    media = sum(1 for r in workload.requests if r.media)
    if media:
        raise ValueError(f"{workload.name} has {media} requests with media; the live engines take text alone")
    cache: dict[int, str] = {}
    requests: list[DemoRequest] = []
    for r in workload.requests:
        tokens = max(1, math.ceil(r.input_tokens / TOKEN_SCALE))
        text = "".join(_block_text(b, cache) for b in r.blocks)[: tokens * CHARS_PER_TOKEN]
        key = prefix_key(text=text, prefix_tokens=KEY_PREFIX_TOKENS)
        max_tokens = max(2, round(r.output_tokens / TOKEN_SCALE))
        requests.append(DemoRequest(len(requests), r.arrival_s, text, max_tokens, f"{key:016x}", r.blocks))
    if not requests:
        raise ValueError(f"{workload.name} has no requests")
    return requests


def prefix_cache_bound(requests: Sequence[DemoRequest]) -> float:
    """The prompt-token hit rate of one infinite prefix cache that saw every request in order: each request's
    leading run of trace blocks seen before, in whole engine blocks (the most any placement reaches)."""
    seen: set[int] = set()
    hits = total = 0
    block_tokens = BLOCK_TOKENS // TOKEN_SCALE
    for r in requests:
        tokens = len(r.text) // CHARS_PER_TOKEN
        run = 0
        while run < len(r.blocks) and r.blocks[run] in seen:
            run += 1
        hits += min(tokens // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS, run * block_tokens)
        total += tokens
        seen.update(r.blocks)
    return hits / total if total else 0.0


def prefill_work_s(requests: Sequence[DemoRequest], gpus: Sequence[str]) -> float:
    """Seconds of prefill the requests need on the cluster (no cache reuse), in model time."""
    capacity = sum(PROFILES[g].prefill_tokens_per_s for g in gpus)  # type: ignore[index]
    return sum(len(r.text) / CHARS_PER_TOKEN for r in requests) / capacity
