"""Each source at its own period, stale readings expiring, failures contained, the per-slice request windows, and
the vector made of them: measurements only, health and alarms judged by the brain from them."""

from __future__ import annotations

import logging

import msgspec
import pytest

from prismlb.agent._node import NodeSampler, Reading, Source, to_vector
from prismlb.agent._windows import SliceWindows
from prismlb.brain import Registry
from prismlb.semantics import Health
from prismlb.wire import MAX_VECTOR_BYTES, ModalityLatency, NodeVector, decode, encode


class Counting:
    def __init__(self, **metrics: float) -> None:
        self.calls = 0
        self.metrics = metrics

    def __call__(self) -> Reading:
        self.calls += 1
        return Reading(metrics=dict(self.metrics))


def test_sources_run_at_their_own_periods() -> None:
    frag, kv, pre, nvlink = Counting(gpu_mem_frag_ratio=0.1), Counting(kv_cache_miss_ratio=0.1), Counting(), Counting()
    sampler = NodeSampler(
        [Source("frag", 2, frag), Source("kv", 5, kv), Source("pre", 10, pre), Source("nvlink", 3, nvlink)]
    )
    for second in range(30):
        sampler.tick(float(second))
    assert (frag.calls, kv.calls, pre.calls, nvlink.calls) == (15, 6, 3, 10)


def test_stale_readings_expire_and_absent_stays_absent() -> None:
    values = {"kv_cache_miss_ratio": 0.1}
    sampler = NodeSampler(
        [Source("kv", 5, lambda: Reading(metrics=dict(values))), Source("host", 1, lambda: Reading())]
    )
    assert sampler.tick(0.0).metrics.kv_cache_miss_ratio == 0.1
    values["kv_cache_miss_ratio"] = None  # type: ignore[assignment]
    state = sampler.tick(5.0)
    assert state.metrics.kv_cache_miss_ratio is None, "a source that stops measuring a value reports it absent"
    assert state.metrics.cpu_util_ratio is None


def test_reading_older_than_three_periods_is_dropped() -> None:
    readings = iter([Reading(metrics={"nvlink_util_ratio": 0.5})])
    sampler = NodeSampler([Source("nvlink", 3, lambda: next(readings))])
    assert sampler.tick(0.0).metrics.nvlink_util_ratio == 0.5
    assert sampler.tick(9.0).metrics.nvlink_util_ratio == 0.5  # the source fails from now on (StopIteration)
    assert sampler.tick(9.5).metrics.nvlink_util_ratio is None
    assert sampler.failures_total["nvlink"] == 1


def test_failures_log_once_per_kind_and_do_not_spread(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Reading:
        raise OSError("device gone")

    sampler = NodeSampler(
        [
            Source("gpu", 1, broken),
            Source("bogus", 1, lambda: Reading(metrics={"no_such_metric": 1.0})),
            Source("host", 1, lambda: Reading(metrics={"cpu_util_ratio": 0.5})),
        ]
    )
    with caplog.at_level(logging.WARNING):
        for second in range(5):
            state = sampler.tick(float(second))
    assert state.metrics.cpu_util_ratio == 0.5
    assert sampler.failures_total == {"gpu": 5, "bogus": 5, "host": 0}
    assert len([r for r in caplog.records if "failed" in r.message]) == 2


def test_the_brain_judges_health_from_the_agents_measurements(caplog: pytest.LogCaptureFixture) -> None:
    metrics = {"kv_cache_miss_ratio": 0.1}
    sampler = NodeSampler([Source("kv", 1, lambda: Reading(metrics=dict(metrics)))])
    registry = Registry(wall_clock=lambda: 0.0)

    def judged(now: float) -> Health:
        vector = to_vector(
            sampler.tick(now),
            node_id="n1",
            host="h1",
            endpoint="http://10.0.0.1:8000",
            labels={},
            seq=int(now),
            sample_time_unix_s=now,
            period_s=1.0,
            started_unix_s=None,
        )
        assert b"health" not in encode(vector) and b"alarms" not in encode(vector), "measurements only"
        assert registry.update(vector, now)
        return registry.nodes["n1"].health

    first = judged(0.0)
    assert first.alarms == () and first.score == pytest.approx(1 - 0.5 * 0.1 / 0.18)
    metrics["kv_cache_miss_ratio"] = 0.3
    with caplog.at_level(logging.INFO):
        assert judged(1.0).alarms == ("kv_cache_miss_ratio",)
        judged(2.0)
    assert len([r for r in caplog.records if "alarms:" in r.message]) == 1, "a change of alarms is logged once"


def test_duplicate_source_names_are_refused() -> None:
    with pytest.raises(ValueError):
        NodeSampler([Source("a", 1, Reading), Source("a", 2, Reading)])


def test_jittery_ticks_do_not_skip_a_period() -> None:
    source = Counting(cpu_util_ratio=0.1)
    sampler = NodeSampler([Source("host", 1.0, source)])
    for tick in range(20):
        sampler.tick(tick * 1.0 + (0.003 if tick % 2 else -0.003))
    assert source.calls == 20


def test_the_vector_carries_the_state_and_the_nodes_identity() -> None:
    latency = {"llm": ModalityLatency(requests=3, ttft_p99_ms=120.0)}
    sampler = NodeSampler(
        [
            Source("kv", 1, lambda: Reading(metrics={"kv_cache_miss_ratio": 0.3})),
            Source("load", 1, lambda: Reading(metrics={"requests_per_s": 2.5}, latency=latency)),
        ]
    )
    state = sampler.tick(0.0)
    labels = {"gpu": "a100"}
    vector = to_vector(
        state,
        node_id="n1",
        host="h1",
        endpoint="http://10.0.0.1:8000",
        zone="z",
        labels=labels,
        seq=7,
        sample_time_unix_s=1_700_000_000.0,
        period_s=1.0,
        started_unix_s=1_699_999_000.0,
    )
    labels["gpu"] = "h100"
    assert vector.labels == {"gpu": "a100"}, "the vector keeps its own copy of the labels"
    assert (vector.node_id, vector.host, vector.zone, vector.seq, vector.started_unix_s) == (
        "n1",
        "h1",
        "z",
        7,
        1_699_999_000.0,
    )
    assert vector.metrics == state.metrics and vector.metrics.requests_per_s == 2.5 and vector.latency == latency
    assert decode(encode(vector), (NodeVector,), MAX_VECTOR_BYTES) == vector, "a valid wire message"


def test_slice_windows_give_each_slices_latency_over_the_window_of_their_reports() -> None:
    windows = SliceWindows(10.0)
    assert windows.requests_per_s(0.0) is None and windows.latency(0.0) == {}
    for i in range(100):
        windows.add("vlm", 100.0 + i * 0.05, ttft_ms=float(i), e2e_ms=1000.0 + i, error=i % 10 == 0)
    windows.add("llm", 104.0, e2e_ms=50.0)  # a request whose span had no TTFT
    latency = windows.latency(105.0)
    assert set(latency) == {"vlm", "llm"}
    assert (latency["vlm"].requests, latency["vlm"].errors) == (100, 10)
    assert latency["vlm"].ttft_p50_ms == pytest.approx(49.5) and latency["vlm"].ttft_p99_ms == pytest.approx(98.01)
    assert latency["vlm"].e2e_p95_ms == pytest.approx(1094.05)
    assert latency["llm"].ttft_p99_ms is None and latency["llm"].e2e_p50_ms == 50.0
    assert windows.requests_per_s(105.0) == pytest.approx(10.1)
    later = windows.latency(114.025)  # llm's report and vlm's first 81 are over 10 s old
    assert set(later) == {"vlm"} and (later["vlm"].requests, later["vlm"].errors) == (19, 1)
    assert later["vlm"].ttft_p50_ms == pytest.approx(90.0)
    assert windows.requests_per_s(114.025) == pytest.approx(1.9)
    assert windows.latency(200.0) == {} and windows.requests_per_s(200.0) == 0.0
    with pytest.raises(ValueError):
        SliceWindows(0.0)


def test_an_older_agents_health_fields_are_ignored_by_the_brain() -> None:
    """Agents before the brain became the one authority sent their own `alarms` and `health_score`: a brain takes
    their vectors and judges the measurements itself."""
    older = msgspec.msgpack.encode(
        {
            "node_id": "n1",
            "host": "h1",
            "endpoint": "http://10.0.0.1:8000",
            "seq": 1,
            "sample_time_unix_s": 1.0,
            "period_s": 1.0,
            "metrics": {"kv_cache_miss_ratio": 0.3, "health_score": 1.0},
            "alarms": [],
        }
    )
    vector = msgspec.msgpack.decode(older, type=NodeVector)
    registry = Registry(wall_clock=lambda: 1.0)
    assert registry.update(vector, 0.0)
    assert registry.nodes["n1"].health.alarms == ("kv_cache_miss_ratio",), "judged from the measurement"
