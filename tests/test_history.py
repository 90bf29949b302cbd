"""History: rolling per-node windows in polars, Parquet segments with a size cap, resume after restart."""

from __future__ import annotations

import logging
from pathlib import Path

import polars as pl
import pytest

from prismlb.brain._history import _BATCH_ROWS, SCHEMA, History
from prismlb.wire import ModalityLatency, NodeMetrics, NodeVector

from ._helpers_vectors import node_vector
from .conftest import Clock

UNIX_NOW = 1_700_000_000.0
"""Where the tests' clocks start: the history stamps rows with Unix seconds."""


def vector(
    node_id: str = "node-a",
    seq: int = 1,
    sample_time: float = 1.0,
    latency: dict[str, ModalityLatency] | None = None,
    **metrics: float,
) -> NodeVector:
    return node_vector(node_id, seq, sample_time_unix_s=sample_time, metrics=NodeMetrics(**metrics), latency=latency)


def fill(history: History, clock: Clock, seconds: int, nodes: int = 3) -> None:
    """One vector per node per second for `seconds` seconds."""
    for _ in range(seconds):
        clock.now += 1.0
        for n in range(nodes):
            history.append(vector(f"node-{n}", seq=int(clock.now), sample_time=clock.now, cpu_util_ratio=0.5))


def segments(state_dir: Path) -> list[Path]:
    return sorted((state_dir / "history").glob("segment-*.parquet"))


def test_rows_flatten_metrics_and_summarise_latency() -> None:
    history = History(None, clock=Clock(UNIX_NOW))
    history.append(
        vector(
            seq=7,
            sample_time=5.0,
            latency={
                "llm": ModalityLatency(requests=10, ttft_p99_ms=100.0, e2e_p99_ms=800.0),
                "vlm": ModalityLatency(requests=2, ttft_p99_ms=300.0),
                "engine": ModalityLatency(requests=12, ttft_p99_ms=50.0, e2e_p99_ms=900.0),
            },
            cpu_util_ratio=0.25,
            mem_used_bytes=2**40,
            kv_cache_miss_ratio=0.5,
        )
    )
    row = history.frame().row(0, named=True)
    assert history.frame().schema == SCHEMA
    assert (row["node_id"], row["seq"], row["sample_time_unix_s"]) == ("node-a", 7, 5.0)
    assert row["cpu_util_ratio"] == 0.25 and row["mem_used_bytes"] == 2**40 and row["kv_cache_miss_ratio"] == 0.5
    assert row["gpu_mem_frag_ratio"] is None  # absent stays absent, never 0
    assert (row["ttft_p99_ms"], row["e2e_p99_ms"]) == (300.0, 900.0)  # worst over every entry
    assert (row["llm_requests"], row["llm_ttft_p99_ms"], row["llm_e2e_p99_ms"]) == (10, 100.0, 800.0)
    assert (row["vlm_requests"], row["vlm_ttft_p99_ms"], row["vlm_e2e_p99_ms"]) == (2, 300.0, None)
    assert row["av_requests"] is None and row["rag_ttft_p99_ms"] is None


def test_window_is_one_nodes_rows_in_sample_time_order() -> None:
    clock = Clock(UNIX_NOW)
    history = History(None, clock=clock)
    for seq, sample_time in ((2, 20.0), (1, 10.0), (3, 30.0)):
        history.append(vector("node-a", seq, sample_time))
        history.append(vector("node-b", seq, sample_time))
    window = history.window("node-a")
    assert window["seq"].to_list() == [1, 2, 3]
    assert set(window["node_id"]) == {"node-a"}
    assert history.frame().height == 6 == len(history)
    assert history.window("nobody").is_empty()


def test_rows_leave_with_the_window_so_memory_is_bounded() -> None:
    clock = Clock(UNIX_NOW)
    history = History(None, window_s=60.0, clock=clock)
    most = 0
    for _ in range(50):
        fill(history, clock, 100, nodes=10)
        most = max(most, len(history))
    assert most <= 10 * 61 + _BATCH_ROWS  # the window plus at most one batch not yet turned into a chunk
    frame = history.frame()
    assert frame.height == len(history) == 10 * 61
    assert frame["received_unix_s"].min() >= clock.now - 60.0
    assert history.rows_evicted == 0


def test_a_row_cap_bounds_memory_below_the_window() -> None:
    clock = Clock(UNIX_NOW)
    history = History(None, window_s=600.0, max_rows=100, clock=clock)
    fill(history, clock, 100)
    frame = history.frame()
    assert frame.height == 100
    assert history.rows_evicted == 200
    assert frame["received_unix_s"].min() == clock.now - 33.0  # the newest rows are kept


def test_segments_are_parquet_written_atomically(tmp_path: Path) -> None:
    clock = Clock(UNIX_NOW)
    history = History(tmp_path, segment_rows=50, clock=clock)
    fill(history, clock, 40)  # 120 rows: two segments of 50, 20 rows still in memory only
    files = segments(tmp_path)
    assert [f.name for f in files] == ["segment-0000000001.parquet", "segment-0000000002.parquet"]
    assert [pl.read_parquet(f).height for f in files] == [50, 50]
    assert history.segments_written == 2
    history.close()
    assert pl.read_parquet(segments(tmp_path)[-1]).height == 20
    assert not list((tmp_path / "history").glob("*.tmp"))


def test_segments_are_flushed_every_flush_s(tmp_path: Path) -> None:
    clock = Clock(UNIX_NOW)
    history = History(tmp_path, flush_s=5.0, clock=clock)
    fill(history, clock, 4)
    assert segments(tmp_path) == []
    fill(history, clock, 2)
    assert len(segments(tmp_path)) == 1


def test_segments_are_capped_oldest_first(tmp_path: Path) -> None:
    clock = Clock(UNIX_NOW)
    probe = History(tmp_path / "probe", segment_rows=30, clock=Clock(UNIX_NOW))
    fill(probe, Clock(UNIX_NOW), 10)
    size = segments(tmp_path / "probe")[0].stat().st_size
    history = History(tmp_path, segment_rows=30, max_bytes=int(size * 3.5), clock=clock)
    fill(history, clock, 100)  # ten segments written
    files = segments(tmp_path)
    assert history.segments_written == 10 and history.segments_deleted == 7
    assert [f.name for f in files] == [f"segment-{i:010d}.parquet" for i in (8, 9, 10)]
    assert sum(f.stat().st_size for f in files) <= history.max_bytes


def test_a_restarted_history_resumes_with_its_rows(tmp_path: Path) -> None:
    clock = Clock(UNIX_NOW)
    history = History(tmp_path, window_s=60.0, segment_rows=25, clock=clock)
    fill(history, clock, 100)
    before = history.frame()
    history.close()

    clock.now += 5.0
    resumed = History.load(tmp_path, window_s=60.0, segment_rows=25, clock=clock)
    after = resumed.frame()
    assert after.height == 3 * 56  # five of the window's 61 seconds passed while the brain was down
    assert after.equals(before.filter(pl.col("received_unix_s") >= clock.now - 60.0))
    fill(resumed, clock, 1)
    resumed_seqs = after.filter(pl.col("node_id") == "node-1")["seq"].to_list()
    assert resumed.window("node-1")["seq"].to_list() == [*resumed_seqs[1:], int(clock.now)]  # window moved 1 s
    assert resumed.segments_unreadable == 0


def test_a_corrupt_segment_is_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(UNIX_NOW)
    history = History(tmp_path, segment_rows=30, clock=clock)
    fill(history, clock, 40)
    history.close()
    first, second, third, _ = segments(tmp_path)
    first.write_bytes(b"not parquet at all")
    second.write_bytes(second.read_bytes()[:100])  # truncated
    third.write_bytes(third.read_bytes()[: third.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="prism"):  # an in-process replay earlier may have raised it
        resumed = History.load(tmp_path, segment_rows=30, clock=clock)
    assert resumed.segments_unreadable == 3
    assert len(resumed) == 3 * 40 - 90
    assert sum("unreadable" in r.getMessage() for r in caplog.records) == 3
    fill(resumed, clock, 10)  # the history keeps working and writes the next segment number
    assert segments(tmp_path)[-1].name == "segment-0000000005.parquet"


def test_a_failing_disk_is_counted_not_fatal(tmp_path: Path) -> None:
    clock = Clock(UNIX_NOW)
    history = History(tmp_path, segment_rows=10, clock=clock)
    folder = tmp_path / "history"
    folder.rmdir()
    folder.write_text("in the way")
    fill(history, clock, 10)
    assert history.write_errors == 3 and history.segments_written == 0
    assert len(history) == 30
    folder.unlink()
    folder.mkdir()
    fill(history, clock, 4)
    assert history.segments_written == 1


def test_counts_beyond_int64_become_null_not_a_crash() -> None:
    history = History(None, clock=Clock(UNIX_NOW))
    history.append(vector(mem_used_bytes=2**64 - 1))
    assert history.frame()["mem_used_bytes"].to_list() == [None]
