"""The adaptive batch window (`prismlb.otel.AdaptiveBatchWindow`): the window's steps, the breaker's states, what
it rejects, and a quick run of `bench/batch_window.py`. Every time is a fake clock's."""

from __future__ import annotations

import logging
import math
import re
import threading

import numpy as np
import pytest

from prismlb import otel
from prismlb.otel import AdaptiveBatchWindow, BatchWindowSettings, BreakerState
from prismlb.semantics import quantile
from prismlb.wire import ConfigError

from ._helpers_batch_window import quick_bench
from .conftest import Clock

OVER = 0.5
"""A latency over the 200 ms target."""
UNDER = 0.05
"""A latency under it."""


def window(**settings: float) -> tuple[AdaptiveBatchWindow, Clock]:
    clock = Clock(1000.0)
    return AdaptiveBatchWindow(BatchWindowSettings(**settings), clock=clock), clock  # type: ignore[arg-type]


def open_breaker(w: AdaptiveBatchWindow, clock: Clock) -> None:
    for _ in range(3):
        assert w.record_batch(0.3)
    assert w.state is BreakerState.OPEN


def test_the_exports_and_the_defaults() -> None:
    assert {"AdaptiveBatchWindow", "BatchWindowSettings", "BreakerState", "BreakerTransition"} <= set(otel.__all__)
    s = BatchWindowSettings()
    assert (s.p99_target_s, s.min_window_s, s.max_window_s, s.step_s, s.shrink) == (0.2, 0.05, 0.2, 0.1, 0.1)
    assert (s.overrun_s, s.overruns_to_open, s.open_idle_s) == (0.3, 3, 5.0)
    w, _ = window()
    assert w.state is BreakerState.CLOSED
    assert w.window_s() == 0.2


def test_the_window_shrinks_10_percent_per_100_ms_while_p99_is_over_the_target_never_below_the_floor() -> None:
    w, clock = window()
    expected = 0.2
    for step in range(1, 40):
        w.observe(OVER)
        clock.now += 0.05
        assert w.window_s() == pytest.approx(expected)  # half a step: nothing moves
        clock.now += 0.05
        expected = max(0.05, expected * 0.9)
        assert w.window_s() == pytest.approx(expected), f"step {step}"
    assert w.window_s() == pytest.approx(0.05)
    assert w.window_s(clock.now + 1e6) == pytest.approx(0.05)  # a long gap: many steps, still the floor


def test_steps_missed_between_calls_are_taken_at_once_with_the_p99_of_that_moment() -> None:
    w, clock = window()
    w.observe(OVER)
    assert w.window_s(clock.now + 0.3) == pytest.approx(0.2 * 0.9**3)
    # step boundaries are kept on the grid: 0.35 s later is three steps and a half
    assert w.window_s(clock.now + 0.65) == pytest.approx(0.2 * 0.9**6)


def test_the_window_holds_without_latencies_and_grows_back_10_percent_per_step_up_to_the_maximum() -> None:
    w, clock = window()
    w.observe(OVER)
    clock.now += 0.5
    shrunk = w.window_s()
    assert shrunk == pytest.approx(0.2 * 0.9**5)
    clock.now += 5.0  # the over-target latency has left the 1 s span; nothing since: hold
    assert w.window_s() == pytest.approx(shrunk)
    w.observe(UNDER)
    clock.now += 0.1
    assert w.window_s() == pytest.approx(shrunk * 1.1)
    for _ in range(30):
        w.observe(UNDER)
        clock.now += 0.1
        assert w.window_s() <= 0.2
    assert w.window_s() == pytest.approx(0.2)


def test_the_p99_is_the_projects_quantile_over_the_last_span() -> None:
    w, clock = window()
    rng = np.random.default_rng(7)
    early = rng.uniform(0, 1, 200).tolist()
    for value in early:
        w.observe(value)
    clock.now += 0.6
    late = rng.uniform(0, 0.1, 300).tolist()
    for value in late:
        w.observe(value)
    assert w.p99_s() == quantile(early + late, 0.99)
    clock.now += 0.5  # the early ones are 1.1 s old now
    assert w.p99_s() == quantile(late, 0.99)
    clock.now += 1.0
    assert math.isnan(w.p99_s())


def test_three_overruns_in_a_row_open_the_breaker_and_turn_batching_off() -> None:
    w, clock = window()
    assert w.record_batch(0.3)  # 300 ms is an overrun
    assert w.record_batch(0.31)
    assert w.record_batch(0.299)  # a pass breaks the run
    assert w.record_batch(0.4)
    clock.now += 1.0
    assert w.record_batch(0.4)
    assert w.state is BreakerState.CLOSED
    assert w.record_batch(0.4)
    assert w.state is BreakerState.OPEN
    assert w.window_s() == 0.0
    (transition,) = w.transitions
    assert (transition.at_s, transition.source, transition.target) == (1001.0, BreakerState.CLOSED, BreakerState.OPEN)
    assert transition.reason == "3 batches in a row overran"
    assert w.transition_counts() == {"closed->open": 1}
    assert (w.batches, w.overruns) == (6, 5)


def test_the_breaker_goes_half_open_after_5_s_without_an_overrun() -> None:
    w, clock = window()
    open_breaker(w, clock)
    clock.now += 4.0
    assert w.record_batch(0.5)  # still overrunning while open: the 5 s start again
    clock.now += 4.99
    assert w.state is BreakerState.OPEN
    assert w.window_s() == 0.0
    clock.now += 0.5
    assert w.state is BreakerState.HALF_OPEN
    assert w.window_s() == pytest.approx(0.05)  # the trial batches at the floor
    last = w.transitions[-1]
    assert (last.source, last.target) == (BreakerState.OPEN, BreakerState.HALF_OPEN)
    assert last.at_s == pytest.approx(1009.0)  # when it became due, not when it was noticed
    assert last.reason == "5 s without an overrun"


def test_a_passing_trial_closes_the_breaker_and_the_window_grows_back_from_the_floor() -> None:
    w, clock = window()
    open_breaker(w, clock)
    clock.now += 5.0
    assert w.state is BreakerState.HALF_OPEN
    assert w.record_batch(0.12)
    assert w.state is BreakerState.CLOSED
    assert w.transitions[-1].reason == "the trial batch passed (120 ms)"
    assert w.window_s() == pytest.approx(0.05)
    w.observe(UNDER)
    clock.now += 0.1
    assert w.window_s() == pytest.approx(0.055)
    assert w.transition_counts() == {"closed->open": 1, "open->half_open": 1, "half_open->closed": 1}


def test_an_overrunning_trial_opens_the_breaker_again_for_another_5_s() -> None:
    w, clock = window()
    open_breaker(w, clock)
    clock.now += 5.0
    assert w.record_batch(0.35)
    assert w.state is BreakerState.OPEN
    clock.now = 1009.9
    assert w.state is BreakerState.OPEN
    clock.now = 1010.0
    assert w.state is BreakerState.HALF_OPEN
    assert w.transition_counts() == {"closed->open": 1, "open->half_open": 2, "half_open->open": 1}


def test_the_window_does_not_move_while_the_breaker_is_not_closed() -> None:
    w, clock = window()
    open_breaker(w, clock)
    for _ in range(20):
        w.observe(UNDER)
        clock.now += 0.1
    assert w.state is BreakerState.OPEN
    clock.now = 1005.0
    assert w.record_batch(0.1)
    assert w.state is BreakerState.CLOSED
    assert w.window_s() == pytest.approx(0.05)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.001, True, "0.1", None])
def test_bad_latencies_and_durations_are_rejected_counted_and_logged_once(
    bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    w, clock = window()
    with caplog.at_level(logging.WARNING, logger="prism.otel"):
        for _ in range(3):
            assert not w.observe(bad)  # type: ignore[arg-type]
            assert not w.record_batch(bad)  # type: ignore[arg-type]
    assert w.rejects.counts() == {"latency": 3, "duration": 3}
    assert len(caplog.records) == 2
    assert "latency must be a finite number of seconds ≥ 0" in caplog.records[0].getMessage()
    assert math.isnan(w.p99_s())
    assert w.batches == 0
    assert w.observe(np.float32(0.1)) and w.record_batch(0)  # numpy numbers and zero are fine


def test_a_time_that_is_not_a_number_is_rejected_and_moves_nothing() -> None:
    w, clock = window()
    w.observe(OVER)
    assert not w.observe(OVER, math.nan)
    assert w.window_s(math.inf) == 0.2
    assert w.rejects.counts() == {"time": 2}
    assert w.window_s(clock.now - 5) == 0.2  # a time before the last one moves nothing either


@pytest.mark.parametrize(
    "field, value",
    [
        ("p99_target_s", 0.0),
        ("p99_target_s", math.nan),
        ("min_window_s", -0.05),
        ("max_window_s", 0.01),
        ("step_s", 0.0),
        ("shrink", 1.0),
        ("shrink", 0.0),
        ("grow", 0.0),
        ("overrun_s", math.inf),
        ("overruns_to_open", 0),
        ("overruns_to_open", 2.5),
        ("open_idle_s", -1.0),
        ("p99_span_s", 0.0),
        ("max_samples", 0),
        ("step_s", True),
        ("min_window_s", "0.05"),
    ],
)
def test_bad_settings_are_refused_with_the_setting_named(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        BatchWindowSettings(**{field: value})  # type: ignore[arg-type]


def test_every_transition_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    w, clock = window()
    with caplog.at_level(logging.INFO, logger="prism.otel"):
        open_breaker(w, clock)
        clock.now += 5.0
        w.record_batch(0.1)
    lines = [r.getMessage() for r in caplog.records]
    assert [re.match(r"batch breaker (\S+ -> \S+)", line).group(1) for line in lines] == [  # type: ignore[union-attr]
        "closed -> open",
        "open -> half_open",
        "half_open -> closed",
    ]


def test_threads_reporting_at_once_lose_nothing() -> None:
    clock = Clock(1000.0)
    lock = threading.Lock()

    def tick() -> float:
        with lock:
            clock.now += 0.001
            return clock.now

    w = AdaptiveBatchWindow(BatchWindowSettings(max_samples=100_000), clock=tick)
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        for i in range(2000):
            w.observe(UNDER)
            w.record_batch(0.4 if i % 2 else 0.1)
            w.window_s()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (w.batches, w.overruns) == (8000, 4000)
    assert len(w.transitions) == min(256, sum(w.transition_counts().values()))


def test_a_quick_run_of_the_bench_prints_its_tables() -> None:
    text, rows = quick_bench("batch_window.py")
    assert len(rows) == 5
    for _, count, fixed, adaptive, ratio in rows:
        assert count > 0
        assert ratio == pytest.approx(fixed / adaptive, abs=0.01)
    assert "| t s | load | window ms | breaker |" in text
    assert re.search(r"^\| 1[0-9]–\d+ \| 3× \|", text, re.M), "the spike is marked in the timeline"
    assert "| closed → open | 3 batches in a row overran |" in text
