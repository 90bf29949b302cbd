"""Each source at its own period, stale readings expiring, failures contained, health and alarms."""

from __future__ import annotations

import logging

import pytest

from prismlb.agent._node import NodeSampler, Reading, Source


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
    sampler = NodeSampler([Source("kv", 5, lambda: Reading(metrics=dict(values))), Source("host", 1, lambda: Reading())])
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


def test_health_score_and_alarms_over_present_dimensions(caplog: pytest.LogCaptureFixture) -> None:
    metrics = {"kv_cache_miss_ratio": 0.1}
    sampler = NodeSampler([Source("kv", 1, lambda: Reading(metrics=dict(metrics)))])
    state = sampler.tick(0.0)
    assert state.alarms == [] and state.metrics.health_score == pytest.approx(1 - 0.5 * 0.1 / 0.18)
    metrics["kv_cache_miss_ratio"] = 0.3
    with caplog.at_level(logging.INFO):
        state = sampler.tick(1.0)
        sampler.tick(2.0)
    assert state.alarms == ["kv_cache_miss_ratio"]
    assert len([r for r in caplog.records if r.message.startswith("alarms:")]) == 1
    assert NodeSampler([Source("x", 1, Reading)]).tick(0.0).metrics.health_score is None


def test_duplicate_source_names_are_refused() -> None:
    with pytest.raises(ValueError):
        NodeSampler([Source("a", 1, Reading), Source("a", 2, Reading)])


def test_jittery_ticks_do_not_skip_a_period() -> None:
    source = Counting(cpu_util_ratio=0.1)
    sampler = NodeSampler([Source("host", 1.0, source)])
    for tick in range(20):
        sampler.tick(tick * 1.0 + (0.003 if tick % 2 else -0.003))
    assert source.calls == 20
