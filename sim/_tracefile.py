"""Request traces from any file in Mooncake's JSON-lines format, for `prism eval --trace`.

One request per line, prefix blocks chained as Mooncake's `hash_ids` are, with optional session ids and
modalities. The shared Mooncake conversation trace is read by the same loader. Media costs follow the rules
of the ServeGen multimodal mix (`_workload`). The format and its rules are written down in
docs/sim-workloads.md ("Your own traces").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import msgspec

from ._types import SimRequest, Workload
from ._workload import AUDIO_CLIP_MS, BLOCK_TOKENS, IMAGE_TOKENS_MAX, _ordered, audio_tokens, spread_over_resolution

MODALITIES = ("text", "image+text", "audio+text", "video+text", "rag+text")
"""The `modality` values a line may carry; each is the request's `X-Modality-Signature`."""
_MEDIA_FIELD = {"image+text": "image_tokens", "video+text": "image_tokens", "audio+text": "audio_ms"}
"""The field that sizes a modality's media; modalities not named here have no media."""
_FIRST = -1
"""The parent recorded for a request's first block (block ids are never negative)."""

_Count = Annotated[int, msgspec.Meta(ge=0)]


class _Line(msgspec.Struct, gc=False):
    """One line as the format types it. msgspec checks types and bounds while it parses (JSON integers only where
    counts belong, `true` is no number), which reads the 12,031-line Mooncake trace faster than `json.loads`."""

    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    """Milliseconds."""
    input_length: _Count
    output_length: _Count
    hash_ids: list[_Count]
    session_id: Annotated[str, msgspec.Meta(min_length=1)] | int | None = None
    modality: str | None = None
    image_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    audio_ms: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Milliseconds."""


_DECODER = msgspec.json.Decoder(_Line)


class TraceFormatError(ValueError):
    """A line of a trace file that is not a request; the message names the file and the line (from 1), so the
    person who wrote the file can find and fix it."""

    def __init__(self, path: Path, line: int, problem: str) -> None:
        super().__init__(f"{path}, line {line}: {problem}")
        self.path = path
        self.line = line


class _BadLine(Exception):
    """What is wrong with the line being read; `load_trace` adds the file and line number."""


def load_trace(path: Path, *, limit: int | None = None, seed: int = 0) -> Workload:
    """The first `limit` requests of the file (all when None), in arrival order: a workload named after the
    file's stem, each arrival drawn (`seed`) within the resolution of the file's timestamps
    (`spread_over_resolution`). Blank lines are skipped; line numbers in errors count every line of the file."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must not be negative, not {limit}")
    requests: list[SimRequest] = []
    lines: list[int] = []
    parents: dict[int, int] = {}
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                request = _request(_DECODER.decode(line))
                _chain(request.blocks, parents, requests, lines)
            except (msgspec.DecodeError, msgspec.ValidationError, _BadLine) as bad:
                raise TraceFormatError(path, number, str(bad)) from None
            requests.append(request)
            lines.append(number)
    source = f"{path}; Mooncake-format JSON lines, hash_ids as blocks"
    return Workload(path.stem, _ordered(spread_over_resolution(requests, seed)), BLOCK_TOKENS, source)


def _request(row: _Line) -> SimRequest:
    """The line's request (id and arrival shifted later by `_ordered`), its own fields checked."""
    text_tokens = max(1, row.input_length)
    most = -(-text_tokens // BLOCK_TOKENS)
    if len(row.hash_ids) > most:
        raise _BadLine(
            f"hash_ids has {len(row.hash_ids)} ids but input_length {text_tokens} fills only {most} blocks of "
            f"{BLOCK_TOKENS}"
        )
    modality = "text" if row.modality is None else row.modality
    if modality not in MODALITIES:
        raise _BadLine(f"modality {modality!r} is not one of {', '.join(MODALITIES)}")
    media, media_tokens = _media(row, modality)
    session = str(row.session_id) if isinstance(row.session_id, int) else row.session_id
    return SimRequest(
        0,
        row.timestamp / 1000,
        text_tokens + media_tokens,
        max(1, row.output_length),
        tuple(row.hash_ids),
        modality,
        media,
        media_tokens,
        session,
    )


def _media(row: _Line, modality: str) -> tuple[dict[str, int], int]:
    """(media parts, media tokens), sized as the ServeGen mix sizes them: images of at most `IMAGE_TOKENS_MAX`
    tokens each, a video as one part holding its frames' tokens, audio in Whisper windows of `AUDIO_CLIP_MS`."""
    wanted = _MEDIA_FIELD.get(modality)
    for name in ("image_tokens", "audio_ms"):
        if name != wanted and getattr(row, name) is not None:
            users = " and ".join(m for m, field in _MEDIA_FIELD.items() if field == name)
            raise _BadLine(f"{name} sizes {users} requests, not {modality}")
    if modality == "audio+text":
        if row.audio_ms is None:
            raise _BadLine(f"{modality} requests need audio_ms")
        return {"audio": math.ceil(row.audio_ms / AUDIO_CLIP_MS)}, audio_tokens(row.audio_ms)
    if modality in ("image+text", "video+text"):
        if row.image_tokens is None:
            raise _BadLine(f"{modality} requests need image_tokens")
        parts = {"image": -(-row.image_tokens // IMAGE_TOKENS_MAX)} if modality == "image+text" else {"video": 1}
        return parts, row.image_tokens
    return {}, 0


def _chain(ids: tuple[int, ...], parents: dict[int, int], earlier: list[SimRequest], lines: list[int]) -> None:
    """Check that the ids are chained as an engine's prefix hashes are (an id stands for its whole prefix, so it
    always comes after the same id, or always first) and record them in `parents` (id → the id before it).
    The check runs in C (`dict.get` with the expected parent as default) for the 300,000 ids of the Mooncake
    trace; `earlier` (the requests read so far) and their `lines` only word the error."""
    expected = [_FIRST, *ids[:-1]]
    if list(map(parents.get, ids, expected)) == expected and len(set(ids)) == len(ids):
        parents.update(zip(ids, expected))
        return
    for i, block in enumerate(ids):
        if block in ids[:i]:
            raise _BadLine(f"hash_ids[{i}] = {block} repeats an id of the same request: ids must be chained")
        if parents.get(block, expected[i]) != expected[i]:
            line, first = next((n, r.blocks) for r, n in zip(earlier, lines, strict=True) if block in r.blocks)
            where = first.index(block)
            raise _BadLine(
                f"hash_ids[{i}] = {block} comes after {_after(ids, i)} here but after {_after(first, where)} on "
                f"line {line}: ids must be chained (equal id = equal prefix up to it)"
            )


def _after(ids: tuple[int, ...], i: int) -> str:
    """What block `i` comes after, in words, for the chaining error."""
    return "nothing (first block)" if i == 0 else f"id {ids[i - 1]}"
