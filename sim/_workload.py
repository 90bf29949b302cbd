"""Workloads for the cluster replay: public traces turned into `SimRequest`s, and load scaled to a utilisation.

Mooncake conversation keeps its prefix blocks; Azure code and conv have none (every request gets unique blocks);
the multimodal mix is sampled from ServeGen mm-image's distributions with a fixed seed, audio and video requests
derived from its image requests. The rules and constants are written down in docs/sim-workloads.md.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from ._traces import traces_dir
from ._types import SimRequest, Workload

BLOCK_TOKENS = 512
"""Tokens per prefix block: Mooncake's `hash_ids` granularity, used for every workload."""
LEVELS: Mapping[str, float] = {"50%": 0.5, "80%": 0.8, "95%": 0.95}
"""Named utilisation levels: offered prefill work over the cluster's prefill capacity."""
WORKLOADS = ("mooncake", "azure-code", "azure-conv", "mm")
MM_DEFAULT_COUNT = 6000
MOONCAKE_TRACE = Path("mooncake") / "conversation_trace.jsonl"
"""Mooncake's conversation trace (FAST'25), under `traces_dir()`; its `hash_ids` cover `BLOCK_TOKENS` each."""

ROUNDED_PER_TIMESTAMP = 2.0
"""Requests per distinct timestamp from which a recorded trace is taken to round its timestamps
(`spread_over_resolution`): Mooncake's conversation trace has 10.2, Azure's 1.0."""

MM_START_S = 15 * 3600
"""ServeGen's day starts at 0 s; 15:00 is a steady busy hour (11.5–13 req/s over 17–19 active clients)."""
MM_AUDIO_SHARE = 0.15
"""Of the requests that carry images, the share turned into audio+text requests."""
MM_VIDEO_SHARE = 0.05
"""Of the requests that carry images, the share turned into video+text requests."""
IMAGE_TOKENS_MAX = 1280
"""The largest per-image token count in mm-image: Qwen2-VL's default cap (max_pixels 1280 × 28 × 28)."""
AUDIO_TOKENS_PER_CLIP = 1500
"""Whisper's encoder: a 30 s clip gives 1500 frames (50 per second)."""
AUDIO_CLIP_MS = 30_000
"""Whisper's window: the longest clip one encoder pass takes (`AUDIO_TOKENS_PER_CLIP` frames)."""
VIDEO_FRAMES = (4, 8)
"""Frames per derived video, uniform and inclusive; each frame costs one sampled image's tokens."""

_WINDOW_S = 600
_DAY_S = 86_400
_MM_IMAGE = Path("servegen") / "mm-image"

_Dist = tuple[np.ndarray, np.ndarray]
"""A discrete distribution: values and their cumulative probabilities."""


@dataclass(frozen=True, slots=True)
class _Client:
    """One ServeGen client: its 10-minute arrival windows and its per-window request distributions."""

    windows: Mapping[int, tuple[float, str, float]]
    """Window start s → (rate req/s, inter-arrival distribution name, its shape parameter)."""
    dataset_starts: tuple[int, ...]
    dataset: tuple[Mapping[str, _Dist], ...]


def mooncake_conversation(limit: int | None = None, *, seed: int = 0) -> Workload:
    """Mooncake's conversation trace (FAST'25) with its 512-token prefix blocks; no session ids. Its timestamps
    lie on a 3-second grid, so `seed` draws where in its 3 s each arrival stands (`spread_over_resolution`).

    It goes through the loader of `prism eval --trace` files, so the format those files follow is the one this
    trace is read by."""
    from ._tracefile import load_trace  # imported here: the loader builds on this module's constants and rules

    path = traces_dir() / MOONCAKE_TRACE
    source = (
        f"kvcache-ai/Mooncake FAST25-release/traces/{path.name}; hash_ids as blocks, no session ids; "
        f"arrivals spread over the timestamps' resolution, seed {seed}"
    )
    return replace(load_trace(path, limit=limit, seed=seed), name="mooncake", source=source)


def mooncake_tokens(hash_ids: Sequence[int], length: int) -> list[int]:
    """The first `length` token ids of a Mooncake prompt, for what reads tokens rather than blocks (a router's
    prefix key): each `BLOCK_TOKENS`-token block's tokens derived from its hash id, so equal ids give equal
    blocks and the turns of a conversation share their prefix's tokens."""
    return [hash_ids[t // BLOCK_TOKENS] * BLOCK_TOKENS + t % BLOCK_TOKENS for t in range(length)]


def azure(kind: Literal["code", "conv"], limit: int | None = None, *, seed: int = 0) -> Workload:
    """Azure LLM inference trace (Splitwise, ISCA'24), code or conv; each request gets prefix blocks of its own.
    Its timestamps are to the microsecond, one request each, and are kept (`spread_over_resolution`).

    It goes through the loader of `prism eval --trace` files, as Mooncake's does."""
    from ._tracefile import load_trace  # imported here: the loader builds on this module's constants and rules

    if kind not in ("code", "conv"):
        raise ValueError(f"Azure trace kind must be 'code' or 'conv', not {kind!r}")
    path = traces_dir() / "azure" / f"AzureLLMInferenceTrace_{kind}.csv"
    source = f"Azure/AzurePublicDataset data/{path.name}; no prefix information: unique blocks per request"
    return replace(load_trace(path, limit=limit, seed=seed), name=f"azure-{kind}", source=source)


def servegen_mm(seed: int, count: int = MM_DEFAULT_COUNT, *, start_s: float = MM_START_S) -> Workload:
    """`count` requests sampled from ServeGen mm-image from the 10-minute window holding `start_s`."""
    if count <= 0:
        raise ValueError(f"count must be positive, not {count}")
    rng = np.random.default_rng(seed)
    clients = _servegen_clients(traces_dir() / _MM_IMAGE)
    times, owners = _mm_arrivals(rng, clients, int(start_s // _WINDOW_S * _WINDOW_S), count)
    requests = _mm_requests(rng, clients, times, owners)
    source = (
        f"alibaba/ServeGen data/multimodal/mm-image ({len(clients)} clients), seed {seed}, from {start_s:.0f} s; "
        f"audio {MM_AUDIO_SHARE:.0%} and video {MM_VIDEO_SHARE:.0%} of image requests derived (docs/sim-workloads.md)"
    )
    return Workload("mm", _ordered(requests), BLOCK_TOKENS, source)


def load(name: str, *, seed: int, limit: int | None) -> Workload:
    """A workload by name (`WORKLOADS`): `seed` draws the multimodal sample, and where in their timestamps'
    resolution the recorded traces' arrivals stand; for `mm`, `limit` is the count."""
    if name == "mooncake":
        return mooncake_conversation(limit, seed=seed)
    if name in ("azure-code", "azure-conv"):
        return azure("code" if name == "azure-code" else "conv", limit, seed=seed)
    if name == "mm":
        return servegen_mm(seed, MM_DEFAULT_COUNT if limit is None else limit)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def offered_utilisation(
    workload: Workload, capacity_tokens_per_s: float, *, encoder_s_per_media: Mapping[str, float] | None = None
) -> float:
    """Prefill work (prompt tokens over capacity, plus encoder time, no cache reuse) over the arrival span."""
    return _work_s(workload, capacity_tokens_per_s, encoder_s_per_media) / _span_s(workload)


def scale_to_utilisation(
    workload: Workload,
    utilisation: float,
    capacity_tokens_per_s: float,
    *,
    encoder_s_per_media: Mapping[str, float] | None = None,
) -> Workload:
    """The workload with arrival times stretched or compressed so its offered utilisation is `utilisation`."""
    if not (0 < utilisation and math.isfinite(utilisation)):
        raise ValueError(f"utilisation must be a positive number, not {utilisation}")
    factor = offered_utilisation(workload, capacity_tokens_per_s, encoder_s_per_media=encoder_s_per_media) / utilisation
    requests = [replace(r, arrival_s=r.arrival_s * factor) for r in workload.requests]
    source = f"{workload.source}; arrivals ×{factor:.6g} for utilisation {utilisation:g}"
    return replace(workload, requests=requests, source=source)


def infinite_cache_hit_rate(workload: Workload) -> float:
    """Share of prompt tokens in blocks seen earlier in the trace: the bound of any prefix cache."""
    seen: set[int] = set()
    hits = total = 0
    for r in workload.requests:
        covered = r.input_tokens - r.media_tokens
        for i, block in enumerate(r.blocks):
            if block in seen:
                hits += min(workload.block_tokens, covered - i * workload.block_tokens)
        seen.update(r.blocks)
        total += r.input_tokens
    return hits / total if total else 0.0


def audio_tokens(audio_ms: float) -> int:
    """Prompt tokens of an audio clip: Whisper's encoder frames at 50 per second (`AUDIO_TOKENS_PER_CLIP` per
    `AUDIO_CLIP_MS`), at least one; the one rule for derived (ServeGen) and given (trace file) audio lengths."""
    return max(1, round(audio_ms * AUDIO_TOKENS_PER_CLIP / AUDIO_CLIP_MS))


def _ordered(requests: list[SimRequest]) -> list[SimRequest]:
    """Requests sorted by arrival (stable), arrivals shifted to start at 0, ids 0..n-1 in that order."""
    ranked = sorted(requests, key=lambda r: r.arrival_s)
    t0 = ranked[0].arrival_s if ranked else 0.0
    return [replace(r, id=i, arrival_s=r.arrival_s - t0) for i, r in enumerate(ranked)]


def spread_over_resolution(requests: Sequence[SimRequest], seed: int) -> list[SimRequest]:
    """A recorded trace's arrivals placed within the resolution of its timestamps, in the trace's order.

    A trace that rounds its timestamps records every request of a span at one instant: Mooncake's conversation
    trace puts its 12,031 arrivals on 1,180 times 2,997-3,003 ms apart, ten to a time on average and up to 28.
    Replayed as written, each time is a burst within one microsecond that no gateway saw: one central router
    still places it one request after the other, while routers that learn of each other's placements through
    a brain a few milliseconds later place it blind of each other. The resolution is the smallest gap between
    two distinct timestamps; each request arrives at a uniform draw (`seed`) within one resolution after its
    timestamp, the draws of a shared timestamp sorted so the trace's order stands (a conversation's next turn
    still comes after the one before). Only a trace that records at least `ROUNDED_PER_TIMESTAMP` requests per
    distinct timestamp is taken as rounded; any other (Azure's, to the microsecond; a file with one deliberate
    burst) keeps its timestamps as they are."""
    ranked = sorted(requests, key=lambda r: r.arrival_s)  # stable: the file's order within a timestamp
    times = sorted({r.arrival_s for r in ranked})
    if len(times) < 2 or len(ranked) < ROUNDED_PER_TIMESTAMP * len(times):
        return ranked
    resolution = min(b - a for a, b in itertools.pairwise(times))
    rng = np.random.default_rng(seed)
    out: list[SimRequest] = []
    for at, tied in itertools.groupby(ranked, key=lambda r: r.arrival_s):
        same = list(tied)
        offsets = np.sort(rng.random(len(same))) * resolution
        out += [replace(r, arrival_s=at + float(offset)) for r, offset in zip(same, offsets, strict=True)]
    return out


def _unique_blocks(token_counts: Iterable[int]) -> list[tuple[int, ...]]:
    """Consecutive block ids from 0, ceil(tokens / BLOCK_TOKENS) per prompt: no id is used twice."""
    blocks = []
    start = 0
    for tokens in token_counts:
        n = -(-tokens // BLOCK_TOKENS)
        blocks.append(tuple(range(start, start + n)))
        start += n
    return blocks


def _span_s(workload: Workload) -> float:
    """Seconds from the first arrival to the last; ValueError when there is no span to scale."""
    if not workload.requests:
        raise ValueError(f"workload {workload.name!r} has no requests")
    span = workload.requests[-1].arrival_s - workload.requests[0].arrival_s
    if span <= 0:
        raise ValueError(f"workload {workload.name!r} spans no time (one instant); it cannot be scaled")
    return span


def _work_s(workload: Workload, capacity: float, encoder_s: Mapping[str, float] | None) -> float:
    """Prefill seconds of all requests without cache reuse: prompt tokens over capacity, plus encoders."""
    if not capacity > 0:
        raise ValueError(f"capacity_tokens_per_s must be positive, not {capacity}")
    work = sum(r.input_tokens for r in workload.requests) / capacity
    if encoder_s is None:
        return work
    for r in workload.requests:
        for modality, n in r.media.items():
            if modality not in encoder_s:
                raise ValueError(f"encoder_s_per_media has no time for {modality!r} media")
            work += encoder_s[modality] * n
    return work


def _servegen_clients(folder: Path) -> tuple[_Client, ...]:
    """ServeGen clients from `chunk-N-trace.csv` and `chunk-N-dataset.json`, N = 0, 1, ..."""
    clients = []
    for n in itertools.count():
        trace, dataset = folder / f"chunk-{n}-trace.csv", folder / f"chunk-{n}-dataset.json"
        if not trace.exists():
            break
        with trace.open(newline="") as f:
            windows = {int(w[0]): (float(w[1]), w[3], float(w[4])) for w in csv.reader(f) if float(w[1]) > 0}
        by_start = sorted((int(k), v) for k, v in json.loads(dataset.read_text()).items())
        dists = tuple({field: _parse_dist(text) for field, text in fields.items()} for _, fields in by_start)
        clients.append(_Client(windows, tuple(k for k, _ in by_start), dists))
    if not clients:
        raise FileNotFoundError(f"no ServeGen chunk-0-trace.csv in {folder}")
    return tuple(clients)


def _parse_dist(text: str) -> _Dist:
    """ServeGen's `{value: probability, ...}` string, parsed as numbers (never evaluated)."""
    pairs = [item.split(":") for item in text.strip().removeprefix("{").removesuffix("}").split(",")]
    values = np.array([int(v) for v, _ in pairs])
    cumulative = np.cumsum([float(p) for _, p in pairs])
    return values, cumulative / cumulative[-1]


def _draw(rng: np.random.Generator, dist: _Dist, n: int) -> np.ndarray:
    """`n` samples of a discrete distribution."""
    values, cumulative = dist
    return values[np.minimum(np.searchsorted(cumulative, rng.random(n), side="right"), len(values) - 1)]


def _unit_gaps(rng: np.random.Generator, name: str, shape: float, n: int) -> np.ndarray:
    """`n` inter-arrival gaps of mean 1 with the named distribution's shape (and so its CV)."""
    if name == "Gamma":
        return rng.gamma(shape, 1 / shape, n)
    if name == "Weibull":
        return rng.weibull(shape, n) / math.gamma(1 + 1 / shape)
    raise ValueError(f"unknown ServeGen inter-arrival distribution {name!r}")


def _window_arrivals(rng: np.random.Generator, rate: float, name: str, shape: float) -> np.ndarray:
    """Arrival offsets in one 10-minute window: a renewal process at `rate`, entered at a uniform phase."""
    n = int(rate * _WINDOW_S * 1.5) + 16
    while True:
        gaps = _unit_gaps(rng, name, shape, n) / rate
        gaps[0] *= rng.random()
        offsets = np.cumsum(gaps)
        if offsets[-1] >= _WINDOW_S:
            return offsets[offsets < _WINDOW_S]
        n *= 2


def _mm_arrivals(
    rng: np.random.Generator, clients: tuple[_Client, ...], start_s: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """The first `count` arrivals (s) and their clients, merging every client's windows from `start_s` on."""
    times: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    total = 0
    window = start_s
    while total < count:
        for c, client in enumerate(clients):
            if (row := client.windows.get(window % _DAY_S)) is not None:
                offsets = _window_arrivals(rng, *row)
                times.append(window + offsets)
                owners.append(np.full(len(offsets), c))
                total += len(offsets)
        window += _WINDOW_S
    order = np.argsort(np.concatenate(times), kind="stable")[:count]
    return np.concatenate(times)[order], np.concatenate(owners)[order]


def _mm_requests(
    rng: np.random.Generator, clients: tuple[_Client, ...], times: np.ndarray, owners: np.ndarray
) -> list[SimRequest]:
    """Requests for the arrivals, sampled per (client, 6-hour dataset window) group from its distributions."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (t, c) in enumerate(zip(times.tolist(), owners.tolist(), strict=True)):
        starts = clients[c].dataset_starts
        groups.setdefault((c, bisect.bisect_right(starts, t % _DAY_S) - 1), []).append(i)
    requests: list[SimRequest] = []
    next_block = len(clients)
    for (c, w), members in sorted(groups.items()):
        contents = _mm_contents(rng, clients[c].dataset[w], len(members))
        for i, (text, output, signature, media, media_tokens) in zip(members, contents, strict=True):
            n_blocks = -(-text // BLOCK_TOKENS)
            blocks = (c, *range(next_block, next_block + n_blocks - 1))
            next_block += n_blocks - 1
            requests.append(
                SimRequest(0, float(times[i]), text + media_tokens, output, blocks, signature, media, media_tokens)
            )
    return requests


def _mm_contents(
    rng: np.random.Generator, dists: Mapping[str, _Dist], m: int
) -> list[tuple[int, int, str, dict[str, int], int]]:
    """`m` requests' (text tokens, output tokens, signature, media, media tokens) from one window's distributions."""
    text = np.maximum(_draw(rng, dists["text_tokens"], m), 1).tolist()
    output = np.maximum(_draw(rng, dists["output_tokens"], m), 1).tolist()
    images = _draw(rng, dists["image_count"], m)
    per_image = _draw(rng, dists["image_tokens"], int(images.sum()))
    image_tokens = np.bincount(np.repeat(np.arange(m), images), weights=per_image, minlength=m).astype(int).tolist()
    probe = _draw(rng, dists["image_tokens"], m).tolist()
    choice = rng.random(m).tolist()
    frames = rng.integers(VIDEO_FRAMES[0], VIDEO_FRAMES[1] + 1, m).tolist()
    media = map(_modality, images.tolist(), image_tokens, choice, probe, frames)
    return [(t, o, *parts) for t, o, parts in zip(text, output, media, strict=True)]


def _modality(images: int, image_tokens: int, u: float, probe: int, frames: int) -> tuple[str, dict[str, int], int]:
    """(signature, media, media tokens): text only, the images, or audio / video sized by one image draw `probe`."""
    if images == 0:
        return "text", {}, 0
    if u < MM_AUDIO_SHARE:
        return "audio+text", {"audio": 1}, audio_tokens(AUDIO_CLIP_MS * probe / IMAGE_TOKENS_MAX)
    if u < MM_AUDIO_SHARE + MM_VIDEO_SHARE:
        return "video+text", {"video": 1}, frames * probe
    return "image+text", {"image": images}, image_tokens
