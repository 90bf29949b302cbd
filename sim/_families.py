"""Seeded workload families: the shapes production traffic has and the shared traces lack.

The shared traces give one conversation trace with prefix blocks (Mooncake), two without (Azure) and one
multimodal mix (ServeGen); none has tenants with their own system prompts, sessions with ids, agent loops,
retrieval chunks, audio or video of its own, nor a controlled arrival process. Each preset here builds one
such shape from a seed, so a policy can be measured on it; the same name and seed give the same requests.
Distributions, parameters and their sources are in docs/sim-workloads.md ("Workload families").

Prompts are built as sequences of content pieces (system prompt, user message, answer, chunk, tool result);
`_Chain` cuts them into 512-token blocks and gives each block an id from its parent's id and its content,
as an engine's prefix cache hashes them, so prompts share block ids exactly as far as they share a prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Protocol

import numpy as np

from ._types import SimRequest, Workload
from ._workload import (
    AUDIO_CLIP_MS,
    BLOCK_TOKENS,
    IMAGE_TOKENS_MAX,
    VIDEO_FRAMES,
    _ordered,
    audio_tokens,
    infinite_cache_hit_rate,
)

DEFAULT_REQUESTS = 4000
"""Requests per preset: enough for per-slice P99s, small enough for a full `prism eval` pass."""
CONTEXT_MAX_TOKENS = 32_768
"""A conversation ends when its next prompt would exceed a 32K context window."""
AGENT_CONTEXT_MAX_TOKENS = 131_072
"""Agent loops run on long-context models (128K): a task ends when its next prompt would exceed it."""

_Piece = tuple[Hashable, int]
"""A piece of prompt text: (content id, tokens). Equal content ids are identical text."""
_Output = tuple[float, float, int]
"""A reply length's lognormal: median, sigma, most tokens."""
CHAT_OUTPUT: _Output = (130, 1.0, 4096)
"""The tenants' chat replies."""


class _Chain:
    """Chained prefix-block ids: (parent id, block content) → an id, fresh for each pair never seen before."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[tuple[Hashable, int, int], ...]], int] = {}

    def blocks(self, pieces: Sequence[_Piece]) -> tuple[int, ...]:
        """The block ids of a prompt made of `pieces`; the last block holds what is left (may be partial)."""
        ids: list[int] = []
        content: list[tuple[Hashable, int, int]] = []
        room = BLOCK_TOKENS
        for key, tokens in pieces:
            offset = 0
            while offset < tokens:
                take = min(room, tokens - offset)
                content.append((key, offset, take))
                offset += take
                room -= take
                if room == 0:
                    ids.append(self._id(ids[-1] if ids else -1, content))
                    content, room = [], BLOCK_TOKENS
        if content:
            ids.append(self._id(ids[-1] if ids else -1, content))
        return tuple(ids)

    def _id(self, parent: int, content: list[tuple[Hashable, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(content)), len(self._ids))


def _lognormal(rng: np.random.Generator, median: float, sigma: float, high: int) -> int:
    """A token count: log-normal with `median` and shape `sigma`, at least 1 and at most `high`."""
    return int(min(high, max(1, round(median * math.exp(sigma * rng.standard_normal())))))


def _zipf(n: int, s: float) -> np.ndarray:
    """Cumulative probabilities of ranks 0..n-1 with weight 1 / (rank + 1)^s."""
    weights = 1.0 / np.arange(1, n + 1) ** s
    cumulative = np.cumsum(weights)
    return cumulative / cumulative[-1]


def _rank(rng: np.random.Generator, cumulative: np.ndarray) -> int:
    """One draw of a distribution given by its cumulative probabilities."""
    return min(int(np.searchsorted(cumulative, rng.random(), side="right")), len(cumulative) - 1)


def _request(
    chain: _Chain,
    arrival_s: float,
    pieces: Sequence[_Piece],
    output: int,
    *,
    signature: str = "text",
    media: Mapping[str, int] | None = None,
    media_tokens: int = 0,
    session: str | None = None,
) -> SimRequest:
    """A request whose text is `pieces` (blocks cover the text only) plus `media_tokens` of media; its skeleton
    is each piece's kind (a content id's first part) and log2 length bucket, then each media part's modality."""
    text = sum(tokens for _, tokens in pieces)
    blocks = chain.blocks(pieces)
    media = dict(media or {})
    skeleton = (
        *(f"{key[0] if isinstance(key, tuple) else key}:{tokens.bit_length() - 1}" for key, tokens in pieces),
        *(modality for modality, parts in media.items() for _ in range(parts)),
    )
    return SimRequest(
        0, arrival_s, text + media_tokens, output, blocks, signature, media, media_tokens, session, skeleton
    )


def _workload(name: str, seed: int, requests: list[SimRequest], how: str) -> Workload:
    source = f"sim/_families.py {name}, seed {seed}: {how} (docs/sim-workloads.md, Workload families)"
    return Workload(f"{name}-{seed}", _ordered(requests), BLOCK_TOKENS, source)


def _start(seed: int, requests: int) -> tuple[np.random.Generator, _Chain]:
    """A family's generator at `seed` and a fresh block chain for its prompts, once `requests` is positive."""
    if requests <= 0:
        raise ValueError(f"requests must be positive, not {requests}")
    return np.random.default_rng(seed), _Chain()


# Arrivals


def _poisson(rng: np.random.Generator, n: int, rate: float) -> list[float]:
    """`n` arrival times of a Poisson process at `rate` per second."""
    return np.cumsum(rng.exponential(1 / rate, n)).tolist()


def _steady(rng: np.random.Generator, n: int) -> list[float]:
    """The chat families' steady arrivals: Poisson at 10 per second (before scaling to a load)."""
    return _poisson(rng, n, 10.0)


MMPP_RATES = (1.0, 8.0)
"""Arrival rates (req/s, before scaling) in the quiet and the burst state."""
MMPP_SOJOURN_S = (120.0, 20.0)
"""Mean time (s, before scaling) in the quiet and the burst state, exponentially distributed."""


def _mmpp(rng: np.random.Generator, n: int) -> list[float]:
    """`n` arrivals of a two-state Markov-modulated Poisson process starting in the quiet state."""
    times: list[float] = []
    start, state = 0.0, 0
    while len(times) < n:
        end = start + rng.exponential(MMPP_SOJOURN_S[state])
        t = start + rng.exponential(1 / MMPP_RATES[state])
        while t < end and len(times) < n:
            times.append(t)
            t += rng.exponential(1 / MMPP_RATES[state])
        start, state = end, 1 - state
    return times


RAMP_FACTOR = 4.0
"""The ramp's rate at the end of the run over its rate at the start."""


def _ramp(rng: np.random.Generator, n: int) -> list[float]:
    """`n` arrivals of a Poisson process whose rate rises linearly from 1 to `RAMP_FACTOR` req/s over the run.

    Unit-rate arrivals `u` are mapped through the inverse of the cumulative rate Λ(t) = t + b t² / 2, with `b`
    such that the rate reaches `RAMP_FACTOR` when Λ = n (the expected time of the last arrival)."""
    duration = n / ((1 + RAMP_FACTOR) / 2)
    b = (RAMP_FACTOR - 1) / duration
    unit = np.cumsum(rng.exponential(1.0, n))
    return ((np.sqrt(1 + 2 * b * unit) - 1) / b).tolist()


CONVERSATION_WARMUP_S = 300.0
"""Conversations start this long before the window kept, so it opens on a steady mix of old and new ones."""


def _conversations(
    rng: np.random.Generator, n: int, rate: float, conversation: Callable[[int, float], list[SimRequest]]
) -> list[SimRequest]:
    """The earliest `n` requests at or after 0 s of conversations starting as a Poisson process at `rate`/s.

    Starts run from `-CONVERSATION_WARMUP_S`: a window cut from steady traffic, where the first requests
    include later turns of conversations already under way (their earlier turns fall before the window).
    `conversation(k, start)` gives the k-th conversation's requests; conversations keep starting until the
    next start comes after the n-th earliest arrival, so no later conversation could add an earlier request."""
    requests: list[SimRequest] = []
    start, k = -CONVERSATION_WARMUP_S, 0
    while True:
        start += rng.exponential(1 / rate)
        if len(requests) >= n and start > np.partition([r.arrival_s for r in requests], n - 1)[n - 1]:
            break
        requests += (r for r in conversation(k, start) if r.arrival_s >= 0)
        k += 1
    return sorted(requests, key=lambda r: r.arrival_s)[:n]


# Chat content: tenants, bursty, ramp

TENANTS = 200
TENANT_ZIPF = 1.0
"""Zipf exponent of tenant popularity: the 10 busiest of 200 tenants send half the requests."""
SYSTEM_BLOCKS_MAX = 32


class _Tenants:
    """Tenants with system prompts of 1 to 32 whole blocks (log-uniform), chosen by Zipf popularity."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.popularity = _zipf(TENANTS, TENANT_ZIPF)
        self.system_blocks = np.floor(np.exp(rng.uniform(0, math.log(SYSTEM_BLOCKS_MAX + 1), TENANTS))).astype(int)

    def request(self, rng: np.random.Generator, chain: _Chain, i: int, arrival_s: float, output: _Output) -> SimRequest:
        """Request `i`: its tenant's system prompt, then a user turn of its own; its reply's length lognormal
        (`output`: median, sigma, most tokens)."""
        tenant = _rank(rng, self.popularity)
        system: _Piece = (("system", tenant), int(self.system_blocks[tenant]) * BLOCK_TOKENS)
        user: _Piece = (("user", i), _lognormal(rng, 250, 1.2, 16_384))
        return _request(chain, arrival_s, (system, user), _lognormal(rng, *output))


def _chat(
    name: str,
    seed: int,
    requests: int,
    arrivals: Callable[[np.random.Generator, int], list[float]],
    how: str,
    output: _Output = CHAT_OUTPUT,
) -> Workload:
    """The tenants' chat mix at `arrivals`, replies of `output`'s lengths."""
    rng, chain = _start(seed, requests)
    tenants = _Tenants(rng)
    out = [tenants.request(rng, chain, i, t, output) for i, t in enumerate(arrivals(rng, requests))]
    return _workload(name, seed, out, how)


def tenants(seed: int, requests: int = DEFAULT_REQUESTS) -> Workload:
    """Single-turn requests of 200 tenants (Zipf), each tenant's system prompt 1 to 32 blocks; Poisson arrivals."""
    return _chat("tenants", seed, requests, _steady, "Zipf tenants, Poisson arrivals")


def bursty(seed: int, requests: int = DEFAULT_REQUESTS) -> Workload:
    """The tenants' chat mix with two-state MMPP arrivals: quiet spells and bursts at eight times the rate."""
    return _chat("bursty", seed, requests, _mmpp, "tenants' chat mix, MMPP arrivals")


REASONING_OUTPUT: _Output = (1500, 0.8, 32_768)
"""A reasoning model's replies: its thinking comes before the answer, ten times a chat reply's length
(`CHAT_OUTPUT`) at the median, and a long tail up to a 32K budget."""


def reasoning(seed: int, requests: int = DEFAULT_REQUESTS) -> Workload:
    """The tenants' chat mix (Poisson) answered by a reasoning model (`REASONING_OUTPUT`): the engines' KV cache
    and decode batch, not their prefill, are what runs out first."""
    return _chat("reasoning", seed, requests, _steady, "tenants' chat mix, reasoning-length replies", REASONING_OUTPUT)


def ramp(seed: int, requests: int = DEFAULT_REQUESTS) -> Workload:
    """The tenants' chat mix with a Poisson rate rising linearly to four times its start over the run."""
    return _chat("ramp", seed, requests, _ramp, "tenants' chat mix, linearly ramping arrivals")


# Multi-turn sessions and agent loops

SESSION_TURNS_MEAN = 3.5
"""Mean turns per session (geometric): ShareGPT's 3.5 turns per conversation."""


REPLY_S_PER_TOKEN = 0.03
"""Seconds the engine takes per reply token, before the next turn's pause starts."""


def _turns(
    chain: _Chain,
    start: float,
    opening: list[_Piece],
    turns: int,
    session: str,
    *,
    reply: Callable[[], int],
    then: Callable[[int, int], list[_Piece]],
    context_max: int,
    pause: Callable[[], float],
) -> list[SimRequest]:
    """One conversation's requests, the first at `start` on `opening`: each turn's prompt is the previous one and
    what follows it (`then(turn, reply tokens)`: the reply and the next input), until `turns` turns were sent
    or the context passes `context_max` tokens. The next turn comes after the reply's generation and a
    `pause()`. The random draws come in the order reply, then's input, pause, turn after turn."""
    pieces = opening
    out: list[SimRequest] = []
    t = start
    for turn in range(turns):
        tokens = reply()
        out.append(_request(chain, t, pieces, tokens, session=session))
        pieces = [*pieces, *then(turn, tokens)]
        if sum(size for _, size in pieces) > context_max:
            break
        t += tokens * REPLY_S_PER_TOKEN + pause()
    return out


def sessions(seed: int, requests: int = DEFAULT_REQUESTS) -> Workload:
    """Multi-turn chat: each turn's prompt is the previous prompt, its answer and a new user message."""
    rng, chain = _start(seed, requests)
    system: _Piece = ("system", 1000)

    def conversation(k: int, start: float) -> list[SimRequest]:
        turns = int(rng.geometric(1 / SESSION_TURNS_MEAN))
        opening: list[_Piece] = [system, (("user", k, 0), _lognormal(rng, 400, 1.5, 24_576))]
        return _turns(
            chain,
            start,
            opening,
            turns,
            f"session-{k}",
            reply=lambda: _lognormal(rng, 250, 0.8, 4096),
            then=lambda turn, answer: [
                (("answer", k, turn), answer),
                (("user", k, turn + 1), _lognormal(rng, 40, 1.1, 8192)),
            ],
            context_max=CONTEXT_MAX_TOKENS,
            pause=lambda: _lognormal(rng, 20, 1.0, 600),
        )

    out = _conversations(rng, requests, 6.5, conversation)
    return _workload("sessions", seed, out, "ShareGPT-like sessions, Poisson session starts")


def agentic(seed: int, requests: int = DEFAULT_REQUESTS) -> Workload:
    """Agent tasks: many short turns over one long context per task, each turn appending a tool call and result."""
    rng, chain = _start(seed, requests)
    system: _Piece = ("agent", 3000)

    def task(k: int, start: float) -> list[SimRequest]:
        turns = 5 + int(rng.geometric(1 / 15))
        opening: list[_Piece] = [system, (("task", k), _lognormal(rng, 3000, 0.8, 24_576))]
        return _turns(
            chain,
            start,
            opening,
            turns,
            f"task-{k}",
            reply=lambda: _lognormal(rng, 120, 0.7, 2048),
            then=lambda step, call: [(("call", k, step), call), (("tool", k, step), _lognormal(rng, 250, 1.0, 4096))],
            context_max=AGENT_CONTEXT_MAX_TOKENS,
            pause=lambda: _lognormal(rng, 2, 1.0, 120),
        )

    out = _conversations(rng, requests, 0.2, task)
    return _workload("agentic", seed, out, "agent loops over a shared task context, Poisson task starts")


# Retrieval-augmented generation

RAG_CHUNKS = 20_000
RAG_TOPICS = 2_000
RAG_CHUNK_TOKENS = 512
RAG_RANKING = 8
"""Chunks a topic's ranking holds: the retriever's candidates, of which a request takes the top 3 to 5."""
RAG_SWAP = 0.2
"""Chance that a retrieved position holds another chunk than the topic's (query wording, index updates)."""


def rag(seed: int, requests: int = DEFAULT_REQUESTS) -> Workload:
    """RAG: an instruction prefix, k = 3..5 chunks of a Zipf-popular topic's ranking in rank order, the question."""
    rng, chain = _start(seed, requests)
    chunk_popularity = _zipf(RAG_CHUNKS, 0.8)
    topic_popularity = _zipf(RAG_TOPICS, 1.0)
    rankings = [_distinct(rng, chunk_popularity, RAG_RANKING) for _ in range(RAG_TOPICS)]
    instruction: _Piece = ("rag-instruction", 200)
    out: list[SimRequest] = []
    for i, t in enumerate(_poisson(rng, requests, 10.0)):
        ranking = rankings[_rank(rng, topic_popularity)]
        k = int(rng.integers(3, 6))
        chosen: list[int] = []
        for chunk in ranking:
            pick = _rank(rng, chunk_popularity) if rng.random() < RAG_SWAP else chunk
            if pick not in chosen:
                chosen.append(pick)
            if len(chosen) == k:
                break
        pieces = [instruction, *((("chunk", c), RAG_CHUNK_TOKENS) for c in chosen)]
        pieces.append((("question", i), _lognormal(rng, 20, 0.5, 512)))
        out.append(_request(chain, t, pieces, _lognormal(rng, 80, 0.8, 2048), signature="rag+text"))
    return _workload("rag", seed, out, "Zipf topics over a Zipf chunk corpus, Poisson arrivals")


def _distinct(rng: np.random.Generator, cumulative: np.ndarray, k: int) -> list[int]:
    """`k` different draws of a distribution, in the order drawn."""
    out: list[int] = []
    while len(out) < k:
        if (pick := _rank(rng, cumulative)) not in out:
            out.append(pick)
    return out


# Multimodal

MM_APPS = 20
MM_MIX: Mapping[str, float] = {"text": 0.40, "image+text": 0.40, "audio+text": 0.12, "video+text": 0.08}
"""Shares of the request signatures."""


def _image_tokens(rng: np.random.Generator) -> int:
    """One image's tokens: ServeGen mm-image's per-image sizes (p50 432), capped at `IMAGE_TOKENS_MAX`."""
    return max(16, min(IMAGE_TOKENS_MAX, round(432 * math.exp(0.9 * rng.standard_normal()))))


def _media(rng: np.random.Generator, signature: str) -> tuple[dict[str, int], int]:
    """(media parts, media tokens) of a request, by the rules of the `mm` trace's derived audio and video."""
    if signature == "image+text":
        images = 1 if rng.random() < 0.84 else 1 + min(7, int(rng.geometric(0.5)))
        return {"image": images}, sum(_image_tokens(rng) for _ in range(images))
    if signature == "audio+text":
        return {"audio": 1}, audio_tokens(AUDIO_CLIP_MS * _image_tokens(rng) / IMAGE_TOKENS_MAX)
    if signature == "video+text":
        frames = int(rng.integers(VIDEO_FRAMES[0], VIDEO_FRAMES[1] + 1))
        return {"video": 1}, frames * _image_tokens(rng)
    return {}, 0


def multimodal(seed: int, requests: int = DEFAULT_REQUESTS) -> Workload:
    """Text, image, audio and video requests of 20 apps (Zipf), each app with a system prompt of its own."""
    rng, chain = _start(seed, requests)
    apps = _zipf(MM_APPS, 1.0)
    system_tokens = [_lognormal(rng, 300, 0.8, 4096) for _ in range(MM_APPS)]
    signatures = list(MM_MIX)
    mix = np.cumsum(list(MM_MIX.values()))
    out: list[SimRequest] = []
    for i, t in enumerate(_poisson(rng, requests, 10.0)):
        app = _rank(rng, apps)
        signature = signatures[_rank(rng, mix)]
        media, media_tokens = _media(rng, signature)
        pieces = ((("mm-system", app), system_tokens[app]), (("user", i), _lognormal(rng, 90, 2.0, 16_384)))
        output = _lognormal(rng, 94, 0.7, 2048)
        out.append(_request(chain, t, pieces, output, signature=signature, media=media, media_tokens=media_tokens))
    return _workload("multimodal", seed, out, "text/image/audio/video mix of Zipf apps, Poisson arrivals")


class Preset(Protocol):
    """A family's builder: a function of a seed (and a request count) returning a `Workload`."""

    def __call__(self, seed: int, requests: int = DEFAULT_REQUESTS) -> Workload: ...


PRESETS: Mapping[str, Preset] = {
    "tenants": tenants,
    "sessions": sessions,
    "agentic": agentic,
    "rag": rag,
    "multimodal": multimodal,
    "bursty": bursty,
    "ramp": ramp,
}


FAMILIES: Mapping[str, Preset] = {**PRESETS, "reasoning": reasoning}
"""Every family by name: the presets, and those only a bench replays (`reasoning`: `bench/eval_generality.py
--part decode`)."""


def family_workload(spec: str, requests: int | None = None) -> Workload:
    """The family `NAME[:seed]` (seed 1 when omitted) with `requests` requests (default `DEFAULT_REQUESTS`)."""
    name, _, seed_text = spec.partition(":")
    if name not in FAMILIES:
        raise ValueError(f"unknown workload family {name!r}; families: {', '.join(FAMILIES)}")
    try:
        seed = int(seed_text) if seed_text else 1
    except ValueError:
        raise ValueError(f"workload {spec!r}: the seed after ':' must be a whole number") from None
    return FAMILIES[name](seed, DEFAULT_REQUESTS if requests is None else requests)


if __name__ == "__main__":
    for preset in PRESETS:
        bounds = ", ".join(f"seed {s} {infinite_cache_hit_rate(family_workload(f'{preset}:{s}')):.3f}" for s in (1, 2))
        print(f"{preset}: prefix-hit bound {bounds}")
