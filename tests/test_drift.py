"""P99 drift: change points on 5 s windows, robustness to noise, attribution, listeners."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import pytest

from prismlb.brain._drift import WINDOW_S, DriftDetector, DriftEvent, Group, node_dimensions
from prismlb.wire import NodeMetrics

LLM = Group("llm")
Dims = Callable[[int], Mapping[str, float]]


def run(
    detector: DriftDetector,
    p99s: list[float],
    group: Group = LLM,
    dims: Dims | None = None,
    before_close: Callable[[int, float], None] | None = None,
) -> list[DriftEvent]:
    """Window i holds one observation at 5i + 1 s; a check 7.5 s later closes it."""
    events = []
    for i, p99 in enumerate(p99s):
        at = i * WINDOW_S + 1.0
        detector.observe(group, p99, at, dimensions=dims(i) if dims else None)
        if before_close is not None:
            before_close(i, at)
        events += detector.check(at + 6.5)
    return events


def noisy_dims(rng: random.Random, kv_step_at: int | None = None) -> Dims:
    def dims(i: int) -> dict[str, float]:
        kv = 0.25 if kv_step_at is not None and i >= kv_step_at else 0.05
        return {
            "kv_cache_miss_ratio": rng.gauss(kv, 0.005),
            "cpu_util_ratio": rng.gauss(0.5, 0.05),
            "gpu_mem_frag_ratio": rng.gauss(0.2, 0.02),
            "nvlink_util_ratio": rng.gauss(0.3, 0.03),
            "requests_waiting": rng.gauss(4.0, 1.0),
        }

    return dims


def steps(rng: random.Random, levels: list[tuple[float, int]], sd: float = 10.0) -> list[float]:
    return [rng.gauss(level, sd) for level, count in levels for _ in range(count)]


def test_gaussian_noise_fires_nothing() -> None:
    for seed in range(3):
        rng = random.Random(seed)
        detector = DriftDetector()
        assert run(detector, steps(rng, [(300.0, 2000)], sd=25.0), dims=noisy_dims(rng)) == []
        assert not detector.events


def test_a_step_change_fires_exactly_one_event() -> None:
    rng = random.Random(42)
    detector = DriftDetector()
    events = run(detector, steps(rng, [(300.0, 60), (420.0, 120)]))
    assert len(events) == 1
    event = events[0]
    assert event.group == LLM
    assert event.at_s == 60 * WINDOW_S
    assert event.z > 3.5
    assert event.p99_before_ms == pytest.approx(300.0, abs=8.0)
    assert event.p99_after_ms == pytest.approx(420.0, abs=15.0)
    assert list(detector.events) == events


def test_a_step_down_fires_too_and_each_step_once() -> None:
    rng = random.Random(7)
    detector = DriftDetector()
    events = run(detector, steps(rng, [(300.0, 40), (500.0, 40), (300.0, 40)]))
    assert [e.at_s for e in events] == [40 * WINDOW_S, 80 * WINDOW_S]
    assert events[0].z > 3.5 and events[1].z < -3.5


def test_a_lone_spike_is_absorbed() -> None:
    rng = random.Random(3)
    p99s = steps(rng, [(300.0, 60)])
    p99s[30] = 900.0
    p99s[45] = 50.0
    assert run(DriftDetector(), p99s) == []


def test_nothing_fires_before_the_baseline_fills() -> None:
    assert run(DriftDetector(), [300.0] * 5 + [900.0] * 6) == []


def test_groups_are_independent() -> None:
    rng = random.Random(5)
    detector = DriftDetector()
    canary = Group("llm", "v2")
    for i, (a, b) in enumerate(zip(steps(rng, [(300.0, 80)]), steps(rng, [(300.0, 40), (450.0, 40)]))):
        detector.observe(LLM, a, i * WINDOW_S + 1.0)
        detector.observe(canary, b, i * WINDOW_S + 1.0)
        detector.check(i * WINDOW_S + 7.5)
    assert [e.group for e in detector.events] == [canary]


def test_window_p99_is_request_weighted() -> None:
    detector = DriftDetector()
    for i in range(20):
        detector.observe(LLM, 300.0, i * WINDOW_S + 1.0, requests=1)
        # a node with 9x the requests moves the window far more than a quiet one
        detector.observe(LLM, 300.0 if i < 15 else 400.0, i * WINDOW_S + 2.0, requests=9)
        detector.check(i * WINDOW_S + 7.5)
    [event] = detector.events
    assert event.p99_after_ms == pytest.approx(390.0)


def test_attribution_ranks_the_moved_node_dimension_first() -> None:
    rng = random.Random(11)
    detector = DriftDetector()
    events = run(
        detector,
        steps(rng, [(300.0, 60), (480.0, 10)]),
        dims=noisy_dims(rng, kv_step_at=60),
        before_close=lambda i, at: detector.note_change("config", "table", at),  # a new table every window
    )
    [event] = events
    assert event.causes[0][:2] == ("dimension", "kv_cache_miss_ratio")
    assert event.causes[0].score > 10
    assert all(c.name != "table" for c in event.causes)  # routine changes are not news


def test_attribution_ranks_the_version_change_first() -> None:
    rng = random.Random(13)
    detector = DriftDetector()

    def changes(i: int, at: float) -> None:
        if i == 20:
            detector.note_change("config", "experiment canary revision 2", at)  # long before: not related
        if i == 59:
            detector.note_change("version", "node-a model_version v1 -> v2", at + 2.0)

    events = run(detector, steps(rng, [(300.0, 60), (450.0, 10)]), dims=noisy_dims(rng), before_close=changes)
    [event] = events
    assert event.causes[0][:2] == ("version", "node-a model_version v1 -> v2")
    assert event.causes[0].score == pytest.approx(3.0, abs=0.3)  # a first-ever change
    assert all("canary" not in c.name for c in event.causes)
    assert all(c.kind != "dimension" for c in event.causes)


def test_listeners_get_events_and_a_failing_one_is_contained() -> None:
    rng = random.Random(17)
    detector = DriftDetector(keep_events=1)
    seen: list[DriftEvent] = []

    def broken(event: DriftEvent) -> None:
        raise RuntimeError("listener bug")

    detector.subscribe(broken)
    detector.subscribe(seen.append)
    events = run(detector, steps(rng, [(300.0, 40), (500.0, 40), (300.0, 40)]))
    assert seen == events and len(events) == 2
    assert list(detector.events) == events[-1:]


def test_late_and_far_future_observations_are_dropped() -> None:
    detector = DriftDetector()
    detector.observe(LLM, 300.0, 1.0)
    detector.check(100.0)
    detector.observe(LLM, 300.0, 50.0)  # its window closed at the last check
    detector.observe(LLM, 300.0, 10_000.0)  # far ahead of the last check
    detector.observe(LLM, float("nan"), 101.0)
    assert detector.dropped == 3


def test_node_dimensions_skip_counters_and_capacities() -> None:
    dims = node_dimensions(
        NodeMetrics(cpu_util_ratio=0.5, connect_calls_total=10, mem_total_bytes=1, kv_cache_miss_ratio=0.1)
    )
    assert dims == {"cpu_util_ratio": 0.5, "kv_cache_miss_ratio": 0.1}
