"""Health scoring, registry staleness, per-slice weights in the registry and table versioning."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import pytest

from prismlb.brain import BrainConfig, Registry, TableBuilder, compute_weights, next_epoch, resolve_config
from prismlb.brain._registry import MAX_ADMIT_MS, QUALITY_SMOOTHING_S, admit_ms, stall_ms
from prismlb.semantics import RTO_MIN_MS, Slice, health
from prismlb.wire import ConfigError, NodeMetrics, NodeVector

from ._helpers_vectors import node_vector


def vec(node_id: str, seq: int, period_s: float = 1.0, **metrics: float) -> NodeVector:
    return node_vector(node_id, seq, period_s=period_s, metrics=NodeMetrics(**metrics))


def test_health_is_neutral_without_dimensions() -> None:
    h = health(NodeMetrics())
    assert h.score == 1.0 and h.dimensions == () and h.alarms == ()


def test_health_renormalises_over_present_dimensions() -> None:
    only_kv = health(NodeMetrics(kv_cache_miss_ratio=0.18))
    assert only_kv.score == pytest.approx(0.5)
    assert only_kv.alarms == ()
    both = health(NodeMetrics(kv_cache_miss_ratio=0.36, gpu_mem_frag_ratio=0.0))
    assert both.score == pytest.approx((0.27 * 0.0 + 0.32 * 1.0) / (0.27 + 0.32))
    assert both.alarms == ("kv_cache_miss_ratio",)


def test_health_alarms_at_the_designs_thresholds() -> None:
    h = health(
        NodeMetrics(gpu_mem_frag_ratio=0.46, kv_cache_miss_ratio=0.17, cpu_preproc_p95_ms=121.0, nvlink_util_ratio=0.83)
    )
    assert set(h.alarms) == {"gpu_mem_frag_ratio", "cpu_preproc_p95_ms", "nvlink_util_ratio"}


def test_registry_drops_node_after_three_missed_periods() -> None:
    reg = Registry(stale_periods=3)
    reg.update(vec("a", 1, period_s=1.0), now=0.0)
    reg.update(vec("b", 1, period_s=2.0), now=0.0)
    assert reg.expire(now=2.9) == []
    assert reg.expire(now=3.1) == ["a"]
    assert reg.expire(now=5.9) == []
    assert reg.expire(now=6.1) == ["b"]
    assert reg.nodes == {}


def test_registry_ignores_replayed_vectors() -> None:
    reg = Registry()
    reg.update(vec("a", 5, cpu_util_ratio=0.1), now=0.0)
    reg.update(vec("a", 4, cpu_util_ratio=0.9), now=1.0)
    assert reg.replayed == 1
    assert reg.nodes["a"].vector.seq == 5
    assert reg.nodes["a"].last_seen == 0.0


def test_weight_hysteresis_ignores_small_changes() -> None:
    reg = Registry()
    key = (Slice.LLM, None)
    reg.update(vec("ref", 1, cpu_util_ratio=0.0), now=0.0)  # the pool's healthiest
    reg.update(vec("a", 1, cpu_util_ratio=0.0), now=0.0)
    compute_weights(reg.nodes, {})
    assert reg.nodes["a"].weights[key] == 1.0
    reg.update(vec("a", 2, 3600.0, cpu_util_ratio=0.1), now=1.0)  # an hour-long window replaces the average
    compute_weights(reg.nodes, {})
    assert reg.nodes["a"].weights[key] == 1.0
    reg.update(vec("a", 3, 3600.0, cpu_util_ratio=0.9), now=2.0)
    compute_weights(reg.nodes, {})
    assert reg.nodes["a"].weights[key] == pytest.approx(0.5)


def test_quality_is_smoothed_over_vectors() -> None:
    reg = Registry()
    reg.update(vec("a", 1, kv_cache_miss_ratio=0.36), now=0.0)  # score 0 and one alarm
    assert reg.nodes["a"].quality == 0.0
    reg.update(vec("a", 2, kv_cache_miss_ratio=0.0), now=1.0)  # one quiet second: quality 1.0 for that window
    state = reg.nodes["a"]
    assert state.quality == pytest.approx(1 - math.exp(-1 / QUALITY_SMOOTHING_S))
    for seq in range(3, 3 + 60):
        reg.update(vec("a", seq, kv_cache_miss_ratio=0.0), now=float(seq))
    assert state.quality > 0.95


def test_stall_is_retransmits_per_request_times_the_minimum_timeout() -> None:
    assert stall_ms(NodeMetrics(tcp_retransmits_per_s=3.0, requests_per_s=10.0)) == pytest.approx(0.3 * RTO_MIN_MS)
    assert stall_ms(NodeMetrics(tcp_retransmits_per_s=0.0, requests_per_s=10.0)) == 0.0
    # a window with a request or two and a burst of retransmits counts ten a request at most
    assert stall_ms(NodeMetrics(tcp_retransmits_per_s=500.0, requests_per_s=0.1)) == 10 * RTO_MIN_MS
    # without the tracer's rate, or without requests, nothing says what a request meets
    assert stall_ms(NodeMetrics(requests_per_s=10.0)) is None
    assert stall_ms(NodeMetrics(tcp_retransmits_per_s=3.0, requests_per_s=0.0)) is None
    assert stall_ms(NodeMetrics(tcp_retransmits_per_s=3.0)) is None


def _engine(usage: float | None, running: int | None, waiting: int | None, pace: float | None) -> NodeMetrics:
    return NodeMetrics(
        kv_cache_usage_ratio=usage, requests_running=running, requests_waiting=waiting, requests_per_s=pace
    )


def test_admit_wait_counts_the_requests_past_the_free_cache_in_ends_at_the_nodes_pace() -> None:
    # 90 running hold 0.99 of the cache: the free 0.01 holds 0.9 of one more, so the new request waits for an end,
    # at 1.5 ends a second; with 2 waiting, it is 2.1 past the room: 3 ends
    assert admit_ms(_engine(0.99, 90, 0, 1.5)) == pytest.approx(1000 / 1.5)
    assert admit_ms(_engine(0.99, 90, 2, 1.5)) == pytest.approx(3000 / 1.5)
    # a busy prefill-bound engine: 5 running hold a fifth, its rest holds 20 more, and the 3 waiting wait for prefill
    assert admit_ms(_engine(0.2, 5, 3, 1.5)) is None
    # an empty cache, an idle engine or a figure missing says nothing
    assert admit_ms(_engine(0.0, 0, 4, 1.5)) is None
    assert admit_ms(_engine(None, 90, 2, 1.5)) is None
    assert admit_ms(_engine(0.99, 90, None, 1.5)) is None
    assert admit_ms(_engine(0.99, 90, 2, 0.0)) is None
    # a full cache with no request ending: at most a minute
    assert admit_ms(_engine(1.0, 90, 500, 0.001)) == MAX_ADMIT_MS


def test_admit_wait_is_published_in_steps_from_the_latest_vector() -> None:
    reg = Registry()
    full = {"kv_cache_usage_ratio": 0.99, "requests_running": 90, "requests_waiting": 2, "requests_per_s": 1.5}
    reg.update(vec("a", 1, **full), now=0.0)
    entry = next(n for n in compute_weights(reg.nodes, {})[Slice.LLM] if n.node_id == "a")
    assert entry.admit_ms == 2000.0  # 1,999.99… ms, in steps of 10 ms
    reg.update(vec("a", 2, **{**full, "kv_cache_usage_ratio": 0.5, "requests_running": 40}), now=1.0)
    entry = next(n for n in compute_weights(reg.nodes, {})[Slice.LLM] if n.node_id == "a")
    assert entry.admit_ms is None  # a request ended and room came back: nothing is held over


def _stall_entry(reg: Registry) -> float | None:
    return next(n.stall_ms for n in compute_weights(reg.nodes, {})[Slice.LLM] if n.node_id == "a")


def test_stall_is_smoothed_published_in_steps_and_dropped_when_the_loss_ends() -> None:
    reg = Registry()
    reg.update(vec("a", 1, tcp_retransmits_per_s=0.0, requests_per_s=10.0), now=0.0)
    assert _stall_entry(reg) is None  # a sound network publishes nothing
    reg.update(vec("a", 2, tcp_retransmits_per_s=10.0, requests_per_s=10.0), now=1.0)  # one bad second: 200 ms
    one = 1 - math.exp(-1 / QUALITY_SMOOTHING_S)
    assert reg.nodes["a"].stall_ms == pytest.approx(RTO_MIN_MS * one)  # 13 ms: one window moves it a little
    assert _stall_entry(reg) == 10.0
    reg.update(vec("a", 3, requests_per_s=10.0), now=2.0)  # a window without the rate keeps the average
    assert reg.nodes["a"].stall_ms == pytest.approx(RTO_MIN_MS * one)
    for seq in range(4, 64):  # a minute of the same loss
        reg.update(vec("a", seq, tcp_retransmits_per_s=10.0, requests_per_s=10.0), now=float(seq))
    assert _stall_entry(reg) == pytest.approx(200.0, abs=10.0)
    for seq in range(64, 184):  # two minutes of a sound network again
        reg.update(vec("a", seq, tcp_retransmits_per_s=0.0, requests_per_s=10.0), now=float(seq))
        published = _stall_entry(reg)
    assert published is None


def test_stall_is_held_while_it_drifts_less_than_the_hysteresis() -> None:
    reg = Registry()
    reg.update(vec("a", 1, 3600.0, tcp_retransmits_per_s=5.0, requests_per_s=10.0), now=0.0)  # 100 ms
    assert _stall_entry(reg) == 100.0
    reg.update(vec("a", 2, 3600.0, tcp_retransmits_per_s=5.3, requests_per_s=10.0), now=1.0)  # 106 ms
    assert _stall_entry(reg) == 100.0
    reg.update(vec("a", 3, 3600.0, tcp_retransmits_per_s=5.5, requests_per_s=10.0), now=2.0)  # 110 ms
    assert _stall_entry(reg) == 110.0


def test_table_version_moves_only_on_change() -> None:
    reg = Registry()
    builder = TableBuilder(epoch=7)
    reg.update(vec("a", 1), now=0.0)
    first = builder.build(compute_weights(reg.nodes, {}))
    assert first is not None and first.order == (7, 1)
    reg.update(vec("a", 2), now=1.0)
    assert builder.build(compute_weights(reg.nodes, {})) is None
    reg.update(vec("b", 1), now=1.0)
    second = builder.build(compute_weights(reg.nodes, {}))
    assert second is not None and second.order == (7, 2)
    assert [s.name for s in second.slices] == ["llm", "vlm", "av", "rag"]
    assert [n.node_id for n in second.slices[0].nodes] == ["a", "b"]


def test_a_change_in_the_wait_for_cache_room_alone_publishes_a_table() -> None:
    """Routers take the admit wait from the table: one kept until some weight moved would go on passing over a node
    whose cache has had room since."""
    reg = Registry()
    builder = TableBuilder(epoch=1)
    full = {"kv_cache_usage_ratio": 0.99, "requests_running": 90, "requests_waiting": 2, "requests_per_s": 1.5}
    reg.update(vec("a", 1, **full), now=0.0)
    reg.update(vec("b", 1), now=0.0)
    first = builder.build(compute_weights(reg.nodes, {}))
    assert first is not None and first.slices[0].nodes[0].admit_ms == 2000.0
    reg.update(vec("a", 2, **full), now=1.0)
    assert builder.build(compute_weights(reg.nodes, {})) is None  # the same wait: nothing to send
    reg.update(vec("a", 3, **{**full, "kv_cache_usage_ratio": 0.5, "requests_running": 40}), now=2.0)
    second = builder.build(compute_weights(reg.nodes, {}))
    assert second is not None and second.version == first.version + 1
    assert second.slices[0].nodes[0].admit_ms is None


def test_epoch_is_persisted_and_monotonic(tmp_path: Path) -> None:
    first = next_epoch(tmp_path)
    second = next_epoch(tmp_path)
    assert second > first
    (tmp_path / "epoch").write_text(str(int(time.time()) + 1000))
    assert next_epoch(tmp_path) == int(time.time()) + 1001


def test_config_resolution_order_and_validation() -> None:
    args = argparse.Namespace(ingest=None, updates="tcp://127.0.0.1:7001", snapshot=None)
    env = {"PRISM_BRAIN_INGEST": "tcp://127.0.0.1:7000", "PRISM_BRAIN_UPDATES": "tcp://127.0.0.1:9999"}
    cfg = resolve_config(args, env)
    assert cfg.ingest == "tcp://127.0.0.1:7000"
    assert cfg.updates == "tcp://127.0.0.1:7001"
    assert cfg.snapshot == BrainConfig().snapshot
    with pytest.raises(ConfigError):
        resolve_config(argparse.Namespace(ingest="127.0.0.1:5555"), {})
    with pytest.raises(ConfigError):
        resolve_config(argparse.Namespace(curve_secret="x"), {})
    with pytest.raises(ConfigError):
        resolve_config(argparse.Namespace(metrics_port="70000"), {})


def test_latency_weights_are_off_unless_the_flag_or_the_variable_asks() -> None:
    assert not resolve_config(argparse.Namespace(), {}).latency_weights
    assert resolve_config(argparse.Namespace(latency_weights=True), {}).latency_weights
    assert resolve_config(argparse.Namespace(), {"PRISM_BRAIN_LATENCY_WEIGHTS": "1"}).latency_weights
    with pytest.raises(ConfigError, match="latency weights"):
        resolve_config(argparse.Namespace(), {"PRISM_BRAIN_LATENCY_WEIGHTS": "sometimes"})
