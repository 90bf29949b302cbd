"""Request traces from any file in Mooncake's JSON-lines format, for `prism eval --trace`.

One request per line, prefix blocks chained as Mooncake's `hash_ids` are, with optional session ids and
modalities. The shared Mooncake conversation trace is read by the same loader. Media costs follow the rules
of the ServeGen multimodal mix (`_workload`). The format and its rules are written down in
docs/sim-workloads.md ("Your own traces").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from ._types import SimRequest, Workload
from ._workload import AUDIO_CLIP_MS, BLOCK_TOKENS, IMAGE_TOKENS_MAX, _ordered, audio_tokens

MODALITIES = ("text", "image+text", "audio+text", "video+text", "rag+text")
"""The `modality` values a line may carry; each is the request's `X-Modality-Signature`."""
_MEDIA_FIELD = {"image+text": "image_tokens", "video+text": "image_tokens", "audio+text": "audio_ms"}
"""The field that sizes a modality's media; modalities not named here have no media."""
_T = TypeVar("_T")


class TraceFormatError(ValueError):
    """A line of a trace file that is not a request; the message names the file and the line (from 1), so the
    person who wrote the file can find and fix it."""

    def __init__(self, path: Path, line: int, problem: str) -> None:
        super().__init__(f"{path}, line {line}: {problem}")
        self.path = path
        self.line = line


class _BadLine(Exception):
    """What is wrong with the line being read; `load_trace` adds the file and line number."""


def load_trace(path: Path, *, limit: int | None = None) -> Workload:
    """The first `limit` requests of the file (all when None), in arrival order: a workload named after the
    file's stem. Blank lines are skipped; line numbers in errors count every line of the file."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must not be negative, not {limit}")
    requests: list[SimRequest] = []
    parents: dict[int, tuple[int | None, int]] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                requests.append(_request(line, number, parents))
            except _BadLine as bad:
                raise TraceFormatError(path, number, str(bad)) from None
    source = f"{path}; Mooncake-format JSON lines, hash_ids as blocks"
    return Workload(path.stem, _ordered(requests), BLOCK_TOKENS, source)


def _request(line: str, number: int, parents: dict[int, tuple[int | None, int]]) -> SimRequest:
    """One line's request (id and arrival shifted later); `parents` maps each block id seen to the id before it
    and the line it was first seen on, so a chain that contradicts an earlier one is caught."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise _BadLine(f"not JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(row, dict):
        raise _BadLine(f"not a JSON object but {_show(row)}")
    timestamp = _required(row, "timestamp", _number(row, "timestamp"))
    text_tokens = max(1, _required(row, "input_length", _whole(row, "input_length")))
    output_tokens = max(1, _required(row, "output_length", _whole(row, "output_length")))
    blocks = _blocks(row, text_tokens, number, parents)
    modality = row.get("modality", "text")
    if modality is None:
        modality = "text"
    if modality not in MODALITIES:
        raise _BadLine(f"modality {_show(modality)} is not one of {', '.join(MODALITIES)}")
    media, media_tokens = _media(row, modality)
    return SimRequest(
        0,
        timestamp / 1000,
        text_tokens + media_tokens,
        output_tokens,
        blocks,
        modality,
        media,
        media_tokens,
        _session(row),
    )


def _blocks(
    row: Mapping[str, object], text_tokens: int, number: int, parents: dict[int, tuple[int | None, int]]
) -> tuple[int, ...]:
    """`hash_ids` checked as the simulated prefix cache needs them: whole numbers, no more than the prompt's
    text has blocks, and each id always after the same id (an id stands for its whole prefix)."""
    ids = _required(row, "hash_ids", row.get("hash_ids"))
    if not isinstance(ids, list):
        raise _BadLine(f"hash_ids must be a list of whole numbers, not {_show(ids)}")
    if not all(type(block) is int and block >= 0 for block in ids):  # `type` is int: a bool is not a block id
        i, block = next((i, b) for i, b in enumerate(ids) if type(b) is not int or b < 0)
        kind = "must not be negative" if type(block) is int else "must be a whole number"
        raise _BadLine(f"hash_ids[{i}] {kind}, not {_show(block)}")
    most = -(-text_tokens // BLOCK_TOKENS)
    if len(ids) > most:
        raise _BadLine(
            f"hash_ids has {len(ids)} ids but input_length {text_tokens} fills only {most} blocks of {BLOCK_TOKENS}"
        )
    for i, (block, parent) in enumerate(zip(ids, (None, *ids))):
        seen = parents.get(block)
        if seen is None:
            parents[block] = (parent, number)
        elif seen[0] != parent:
            raise _BadLine(
                f"hash_ids[{i}] = {block} comes after {_after(parent)} here but after {_after(seen[0])} on line "
                f"{seen[1]}: ids must be chained (equal id = equal prefix up to it)"
            )
    return tuple(ids)


def _media(row: Mapping[str, object], modality: str) -> tuple[dict[str, int], int]:
    """(media parts, media tokens), sized as the ServeGen mix sizes them: images of at most `IMAGE_TOKENS_MAX`
    tokens each, a video as one part holding its frames' tokens, audio in Whisper windows of `AUDIO_CLIP_MS`."""
    wanted = _MEDIA_FIELD.get(modality)
    image_tokens = _whole(row, "image_tokens", minimum=1)
    audio_ms = _number(row, "audio_ms")
    for name, value in (("image_tokens", image_tokens), ("audio_ms", audio_ms)):
        if value is not None and name != wanted:
            users = " and ".join(m for m, field in _MEDIA_FIELD.items() if field == name)
            raise _BadLine(f"{name} sizes {users} requests, not {modality}")
    if modality == "image+text":
        tokens = _required(row, "image_tokens", image_tokens)
        return {"image": -(-tokens // IMAGE_TOKENS_MAX)}, tokens
    if modality == "video+text":
        return {"video": 1}, _required(row, "image_tokens", image_tokens)
    if modality == "audio+text":
        length = _required(row, "audio_ms", audio_ms)
        if length == 0:
            raise _BadLine("audio_ms must be more than 0")
        return {"audio": math.ceil(length / AUDIO_CLIP_MS)}, audio_tokens(length)
    return {}, 0


def _session(row: Mapping[str, object]) -> str | None:
    """`session_id` as the session token a caller would send: a non-empty string, or a whole number as text."""
    value = row.get("session_id")
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise _BadLine(f"session_id must be a non-empty string or a whole number, not {_show(value)}")
    return value


def _whole(row: Mapping[str, object], name: str, *, minimum: int = 0) -> int | None:
    """The field as a JSON integer of at least `minimum`; None when absent or null."""
    value = row.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _BadLine(f"{name} must be a whole number, not {_show(value)}")
    if value < minimum:
        raise _BadLine(f"{name} must be at least {minimum}, not {value}")
    return value


def _number(row: Mapping[str, object], name: str) -> int | float | None:
    """The field as a finite JSON number of at least 0; None when absent or null."""
    value = row.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _BadLine(f"{name} must be a number, not {_show(value)}")
    if value < 0:
        raise _BadLine(f"{name} must not be negative, not {value}")
    return value


def _required(row: Mapping[str, object], name: str, value: _T | None) -> _T:
    """`value` (a field read from `row`), which the format requires."""
    if value is None:
        raise _BadLine(f"missing field {name}" if name not in row else f"{name} must not be null")
    return value


def _after(parent: int | None) -> str:
    """A block's predecessor in words, for the chaining error."""
    return "nothing (first block)" if parent is None else f"id {parent}"


def _show(value: object) -> str:
    """A value as it was written, cut short enough for one line of an error."""
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
