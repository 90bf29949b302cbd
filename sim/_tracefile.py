"""Request traces from files, for `prism eval --trace`: Mooncake's JSON-lines format, and the CSV formats of the
public LLM serving traces that record arrivals and token counts only.

Mooncake's format has one request per line, prefix blocks chained as Mooncake's `hash_ids` are, with optional
session ids and modalities; media costs follow the rules of the ServeGen multimodal mix (`_workload`). A `.csv`
file is one of `CSV_FORMATS` (Azure's LLM inference traces, BurstGPT), known by its header; its prompts share
no blocks, since those traces do not say what prompts have in common. The shared Mooncake and Azure traces are
read by the same loader. The formats and their rules are written down in docs/sim-workloads.md ("Your own
traces").
"""

from __future__ import annotations

import codecs
import csv
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import msgspec

from ._types import SimRequest, Workload
from ._workload import (
    AUDIO_CLIP_MS,
    BLOCK_TOKENS,
    IMAGE_TOKENS_MAX,
    _ordered,
    _unique_blocks,
    audio_tokens,
    spread_over_resolution,
)

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


@dataclass(frozen=True, slots=True)
class CsvFormat:
    """A CSV trace format: the columns that give each request's arrival and token counts (others are ignored)."""

    name: str
    time: str
    """The arrival's column, read by `parse_time`."""
    input: str
    """The prompt's tokens."""
    output: str
    """The reply's tokens."""
    parse_time: Callable[[str], Any]
    """A cell of `time` to a value whose differences `seconds` measures."""
    seconds: Callable[[Any, Any], float]
    """Seconds from the second parsed time to the first."""

    def columns(self) -> str:
        """The format's name and the columns it needs, for the error of a header that has none."""
        return f"{self.name} ({self.time}, {self.input}, {self.output})"


CSV_FORMATS = (
    CsvFormat(
        "Azure LLM inference",
        "TIMESTAMP",
        "ContextTokens",
        "GeneratedTokens",
        lambda text: _utc(datetime.fromisoformat(text)),
        lambda t, t0: (t - t0).total_seconds(),
    ),
    CsvFormat("BurstGPT", "Timestamp", "Request tokens", "Response tokens", float, lambda t, t0: t - t0),
)
"""The CSV formats `load_trace` knows, by header: Azure's LLM inference traces (Splitwise, 2023 and 2024; a datetime
per request) and BurstGPT's (seconds from the trace's start; its failed requests, 0 response tokens, arrive like
the others)."""


def _utc(moment: datetime) -> datetime:
    """A datetime as naive UTC: a file may write some times with their offset and others without, and the
    differences between them must still be defined (a naive time is taken as UTC)."""
    return moment if moment.tzinfo is None else moment.astimezone(timezone.utc).replace(tzinfo=None)


def load_trace(path: Path, *, limit: int | None = None, seed: int = 0) -> Workload:
    """The first `limit` requests of the file (all when None), in arrival order: a workload named after the
    file's stem, each arrival drawn (`seed`) within the resolution of the file's timestamps
    (`spread_over_resolution`). A `.csv` file is read as one of `CSV_FORMATS`, any other as Mooncake-format JSON
    lines. Blank lines are skipped; line numbers in errors count every line of the file."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must not be negative, not {limit}")
    if path.suffix.lower() == ".csv":
        return _load_csv(path, limit, seed)
    requests: list[SimRequest] = []
    lines: list[int] = []
    parents: dict[int, int] = {}
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if number == 1:
                line = line.removeprefix(codecs.BOM_UTF8)  # written by some editors; no part of the first request
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


def _load_csv(path: Path, limit: int | None, seed: int) -> Workload:
    """`load_trace` for a CSV file: its format from the header, then one request per row, each prompt in blocks
    of its own (`_unique_blocks`), arrivals in seconds from the first row's."""
    with path.open("rb") as f:
        # Decoded line by line, so that a byte that is not UTF-8 is found on its line; -sig: a spreadsheet's
        # byte-order mark is no part of the first column's name.
        reader = csv.DictReader(line.decode("utf-8-sig") for line in f)
        try:
            header = reader.fieldnames or []
            form = next((c for c in CSV_FORMATS if {c.time, c.input, c.output} <= set(header)), None)
            if form is None:
                known = "; ".join(c.columns() for c in CSV_FORMATS)
                raise _BadLine(f"the header names no known CSV format's columns: {known}")
            times: list[Any] = []
            inputs: list[int] = []
            outputs: list[int] = []
            for row in itertools.islice(reader, limit):
                times.append(_cell(row, form.time, form.parse_time, f"a time as {form.name} writes it"))
                inputs.append(max(1, _cell(row, form.input, _count, "a whole number ≥ 0")))
                outputs.append(max(1, _cell(row, form.output, _count, "a whole number ≥ 0")))
        except UnicodeDecodeError as bad:
            raise TraceFormatError(path, reader.line_num + 1, f"not UTF-8 text ({bad.reason})") from None
        except (_BadLine, csv.Error) as bad:
            raise TraceFormatError(path, max(1, reader.line_num), str(bad)) from None
    requests = [
        SimRequest(0, form.seconds(t, times[0]), n, out, blocks)
        for t, n, out, blocks in zip(times, inputs, outputs, _unique_blocks(inputs), strict=True)
    ]
    source = f"{path}; {form.name} CSV, no prefix information: unique blocks per request"
    return Workload(path.stem, _ordered(spread_over_resolution(requests, seed)), BLOCK_TOKENS, source)


def _cell(row: dict[str | Any, str | Any], column: str, parse: Callable[[str], Any], what: str) -> Any:
    """A row's cell parsed; a missing, unreadable or non-finite one is the line's error, naming `what` it should be."""
    text = row.get(column)
    try:
        value = parse(text.strip()) if isinstance(text, str) else None
    except (ValueError, OverflowError):
        value = None
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        raise _BadLine(f"{column} is {text!r}, not {what}")
    return value


def _count(text: str) -> int | None:
    """A token count's cell: a whole number ≥ 0 in ASCII digits, else None."""
    return int(text) if text.isascii() and text.isdigit() else None


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
