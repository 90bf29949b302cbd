"""Rolling per-node history of node vectors as polars rows, persisted as Parquet segments.

A row is one vector: node id, `seq`, sample time, the brain's receive time, period, every `NodeMetrics`
field, and latency summaries (the worst TTFT and end-to-end P99 over all of the vector's latency entries, and
requests, TTFT P99 and end-to-end P99 per modality slice). Memory holds the last `window_s` seconds, at most
`max_rows` rows. With a state folder, rows go to `state_dir/history/segment-<n>.parquet` every `flush_s` or
`segment_rows` rows (written aside, then renamed), the oldest segments are deleted while the folder is over
`max_bytes`, and `History.load` resumes with the rows still inside the window. Rows not yet flushed when the
brain is killed are lost; `close()` flushes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict, Unpack, cast

import msgspec
import polars as pl

from prismlb.semantics import Slice
from prismlb.wire import ModalityLatency, NodeMetrics, NodeVector

_log = logging.getLogger("prism.brain.history")

_BATCH_ROWS = 16_384  # rows buffered as Python tuples before they become one polars chunk
_SLICES = tuple(s.value for s in Slice)


def _metric_columns() -> dict[str, pl.DataType]:
    """One column per `NodeMetrics` field: Int64 for counts, Float32 for the rest."""
    info = cast(msgspec.inspect.StructType, msgspec.inspect.type_info(NodeMetrics))
    columns: dict[str, pl.DataType] = {}
    for field in info.fields:
        kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        counts = any(isinstance(kind, msgspec.inspect.IntType) for kind in kinds)
        columns[field.name] = pl.Int64() if counts else pl.Float32()
    return columns


SCHEMA = pl.Schema(
    {
        "node_id": pl.String(),
        "seq": pl.Int64(),
        "sample_time_unix_s": pl.Float64(),
        "received_unix_s": pl.Float64(),
        "period_s": pl.Float32(),
        **_metric_columns(),
        "ttft_p99_ms": pl.Float32(),
        "e2e_p99_ms": pl.Float32(),
        **{
            f"{name}_{column}": dtype
            for name in _SLICES
            for column, dtype in (("requests", pl.Int64()), ("ttft_p99_ms", pl.Float32()), ("e2e_p99_ms", pl.Float32()))
        },
    }
)
_EMPTY = pl.DataFrame(schema=SCHEMA)
_IO_ERRORS = (OSError, pl.exceptions.PolarsError, pl.exceptions.PanicException)

Row = tuple[object, ...]
_NO_LATENCY: Row = (None,) * (2 + 3 * len(_SLICES))
_SLICE_AT = {name: 2 + 3 * i for i, name in enumerate(_SLICES)}


def _latency(latency: dict[str, ModalityLatency]) -> Row:
    """The worst TTFT and end-to-end P99 over all entries, then requests, TTFT P99, e2e P99 per slice."""
    if not latency:
        return _NO_LATENCY
    out = list(_NO_LATENCY)
    ttft = e2e = -1.0
    for name, entry in latency.items():
        entry_ttft, entry_e2e = entry.ttft_p99_ms, entry.e2e_p99_ms
        if entry_ttft is not None and entry_ttft > ttft:
            ttft = entry_ttft
        if entry_e2e is not None and entry_e2e > e2e:
            e2e = entry_e2e
        at = _SLICE_AT.get(name)
        if at is not None:
            out[at : at + 3] = (entry.requests, entry_ttft, entry_e2e)
    if ttft >= 0.0:
        out[0] = ttft
    if e2e >= 0.0:
        out[1] = e2e
    return tuple(out)


def _row(vector: NodeVector, received_unix_s: float) -> Row:
    return (
        vector.node_id,
        vector.seq,
        vector.sample_time_unix_s,
        received_unix_s,
        vector.period_s,
        *msgspec.structs.astuple(vector.metrics),
        *_latency(vector.latency),
    )


def _frame(rows: list[Row]) -> pl.DataFrame:
    """Rows as one chunk; a count beyond Int64 becomes null rather than failing the batch."""
    return pl.DataFrame(list(zip(*rows, strict=True)), schema=SCHEMA, orient="col", strict=False)


class HistoryOptions(TypedDict, total=False):
    """`History`'s keyword settings (its constructor has their defaults), which `History.load` passes on."""

    segment_rows: int
    max_bytes: int
    max_rows: int
    flush_s: float
    clock: Callable[[], float]


class History:
    """Recent node vectors for all nodes; thread-safe, `append` and `extend` are cheap (a tuple per vector)."""

    def __init__(
        self,
        state_dir: Path | None,
        window_s: float = 600.0,
        *,
        segment_rows: int = 100_000,
        max_bytes: int = 256 * 1024 * 1024,
        max_rows: int = 2_000_000,
        flush_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.window_s = window_s
        self.segment_rows = segment_rows
        self.max_bytes = max_bytes
        self.max_rows = max_rows
        self.flush_s = flush_s
        self._clock = clock
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._pending: list[Row] = []
        self._chunks: list[pl.DataFrame] = []
        self._rows = 0  # in _chunks
        self._unsaved: list[pl.DataFrame] = []
        self._unsaved_rows = 0  # in _unsaved and _pending
        self._last_received = 0.0
        self._last_flush = clock()
        self._failing = False
        self.segments_written = 0
        self.segments_deleted = 0
        self.segments_unreadable = 0
        self.write_errors = 0
        self.rows_evicted = 0  # dropped before leaving the window, to stay within max_rows
        self._dir = state_dir / "history" if state_dir is not None else None
        self._segments: list[tuple[int, Path, int]] = []  # (index, path, bytes), oldest first
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._inventory(self._dir)
            self._enforce_cap()

    @classmethod
    def load(cls, state_dir: Path, window_s: float = 600.0, **options: Unpack[HistoryOptions]) -> History:
        """A history on `state_dir` that resumes with the persisted rows still inside the window; unreadable
        segments are skipped, logged and counted."""
        history = cls(state_dir, window_s, **options)
        history._resume()
        return history

    def append(self, vector: NodeVector) -> None:
        """Add one accepted vector, stamped with the brain's clock (never going backwards)."""
        self.extend([vector])

    def extend(self, vectors: list[NodeVector]) -> None:
        """Add a batch of accepted vectors, all stamped with one reading of the brain's clock: one lock and
        one clock call per batch instead of per vector. Rows are built before anything is added, so a vector
        that cannot become a row raises with none of the batch added."""
        with self._lock:
            received = max(self._last_received, self._clock())
            rows = [_row(vector, received) for vector in vectors]
            self._last_received = received
            self._pending.extend(rows)
            self._unsaved_rows += len(rows)
            if len(self._pending) >= _BATCH_ROWS:
                self._seal(received)
            due = self._dir is not None and (
                self._unsaved_rows >= self.segment_rows or received - self._last_flush >= self.flush_s
            )
        if due:
            self.flush()

    def frame(self) -> pl.DataFrame:
        """Every row inside the window, all nodes, in arrival order."""
        with self._lock:
            self._seal(self._clock())
            return pl.concat(self._chunks, rechunk=False).clone() if self._chunks else _EMPTY.clone()

    def window(self, node_id: str) -> pl.DataFrame:
        """One node's rows inside the window, ordered by sample time; for all nodes, use `frame()` once."""
        return self.frame().filter(pl.col("node_id") == node_id).sort("sample_time_unix_s", "seq")

    def __len__(self) -> int:
        """Rows held in memory (the window, plus received rows not yet checked against it)."""
        with self._lock:
            return self._rows + len(self._pending)

    def flush(self) -> None:
        """Write the rows received since the last flush as one segment (no-op without a state folder)."""
        if self._dir is None:
            return
        with self._flush_lock:
            with self._lock:
                self._last_flush = self._clock()
                self._seal(self._last_flush)
                batch, self._unsaved, self._unsaved_rows = self._unsaved, [], 0
            if batch:
                self._write(self._dir, pl.concat(batch))

    def close(self) -> None:
        self.flush()

    def _seal(self, now: float) -> None:
        """Turn the pending tuples into a chunk (merged into a small last chunk), then drop expired rows."""
        if self._pending:
            chunk = _frame(self._pending)
            self._pending = []
            if self._dir is not None:
                self._unsaved.append(chunk)
            self._rows += chunk.height
            if self._chunks and self._chunks[-1].height < _BATCH_ROWS:
                chunk = pl.concat([self._chunks.pop(), chunk])
            self._chunks.append(chunk)
        self._prune(now)

    def _prune(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._chunks:
            times = self._chunks[0]["received_unix_s"]
            if times[-1] >= cutoff:
                self._drop_front(int(times.search_sorted(cutoff, side="left")))
                break
            self._drop_front(self._chunks[0].height)
        excess = self._rows - self.max_rows
        while excess > 0:
            dropped = min(excess, self._chunks[0].height)
            self._drop_front(dropped)
            self.rows_evicted += dropped
            excess -= dropped

    def _drop_front(self, rows: int) -> None:
        """Drop the oldest `rows` rows of the first chunk (a zero-copy slice, or the whole chunk)."""
        if rows <= 0:
            return
        first = self._chunks[0]
        if rows >= first.height:
            self._chunks.pop(0)
        else:
            self._chunks[0] = first.slice(rows)
        self._rows -= min(rows, first.height)

    def _inventory(self, folder: Path) -> None:
        for tmp in folder.glob("*.parquet.tmp"):  # left by a crash during a write
            with contextlib.suppress(OSError):
                tmp.unlink()
        for path in folder.glob("segment-*.parquet"):
            try:
                self._segments.append((int(path.stem.removeprefix("segment-")), path, path.stat().st_size))
            except (ValueError, OSError):
                continue
        self._segments.sort()

    def _resume(self) -> None:
        """Read segments newest first until one is entirely older than the window or `max_rows` are loaded."""
        cutoff = self._clock() - self.window_s
        loaded: list[pl.DataFrame] = []
        rows = 0
        for _, path, _ in reversed(self._segments):
            try:
                frame = pl.scan_parquet(path).filter(pl.col("received_unix_s") >= cutoff).collect()
                if frame.schema != SCHEMA:
                    raise pl.exceptions.SchemaError(f"columns {frame.schema} are not this build's")
            except _IO_ERRORS as exc:
                self.segments_unreadable += 1
                _log.warning("history segment %s skipped, unreadable: %s", path, exc)
                continue
            if frame.is_empty():
                break
            loaded.append(frame)
            rows += frame.height
            if rows >= self.max_rows:
                break
        self._chunks = [*reversed(loaded), *self._chunks]
        self._rows = sum(c.height for c in self._chunks)
        if loaded:
            self._last_received = max(self._last_received, loaded[0]["received_unix_s"][-1])
        self._prune(self._clock())
        _log.info("history resumed: %d rows from %d segments", self._rows, len(loaded))

    def _write(self, folder: Path, frame: pl.DataFrame) -> None:
        index = self._segments[-1][0] + 1 if self._segments else 1
        path = folder / f"segment-{index:010d}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as out:
                frame.write_parquet(out, compression="zstd")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
            size = path.stat().st_size
        except _IO_ERRORS as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.write_errors += 1
            if not self._failing:
                _log.warning("history segment not written, %d rows lost from disk: %s", frame.height, exc)
            self._failing = True
            return
        if self._failing:
            _log.info("history segments are written again")
        self._failing = False
        self._segments.append((index, path, size))
        self.segments_written += 1
        self._enforce_cap()

    def _enforce_cap(self) -> None:
        """Delete the oldest segments while the folder is over `max_bytes`."""
        total = sum(size for _, _, size in self._segments)
        while self._segments and total > self.max_bytes:
            _, path, size = self._segments.pop(0)
            with contextlib.suppress(OSError):
                path.unlink()
            total -= size
            self.segments_deleted += 1
            if not self._segments:
                _log.warning("history segment %s alone is over the %d-byte cap; deleted", path, self.max_bytes)
