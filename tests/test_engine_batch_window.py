"""The emulated engine admitting requests through a batching window: gathering on a fake clock, the adaptive
window's breaker seen on `/metrics`, the engine process's `--batch-window` options, and the live bench."""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prismlb.demo import free_port, spawn, stop
from prismlb.demo._engine import main as engine_main
from prismlb.otel import BatchWindowSettings, BreakerState
from prismlb.sim import PROFILES, EmulatedEngine
from prismlb.sim._engine import CHARS_PER_TOKEN

from ._helpers_batch_window import quick_bench
from .conftest import Clock, wait_for

SETTINGS = BatchWindowSettings()
PREFILL = PROFILES["h100"].prefill_tokens_per_s


def engine_on(clock: Clock, batch_window: BatchWindowSettings | float | None) -> contextlib.closing[EmulatedEngine]:
    """An H100 engine on `clock`, never started: the test drives it with `step()`."""
    return contextlib.closing(EmulatedEngine("h100", batch_window=batch_window, clock=clock))


def run_until(engine: EmulatedEngine, clock: Clock, end: float) -> None:
    """Move the clock to `end`, stopping at everything due on the way, as the driving thread would."""
    while (due := engine.step()) <= end:
        clock.now = max(clock.now, due)
    clock.now = end
    engine.step()


def prompt(i: int, tokens: int) -> str:
    """A prompt of `tokens` emulated tokens, its first block unique (no prefix shared with another)."""
    return f"request {i:06d} ".ljust(tokens * CHARS_PER_TOKEN, "x")


def samples(engine: EmulatedEngine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The engine's `/metrics` exposition as parsed by Prometheus's own parser, by sample name and labels."""
    text = generate_latest(engine.metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(engine: EmulatedEngine, name: str, **labels: str) -> float:
    vllm = {"model_name": "prism-emulated-8b", "engine": "0"} if name.startswith("vllm:") else {}
    return samples(engine)[(name, tuple(sorted((vllm | labels).items())))]


def state(engine: EmulatedEngine) -> str:
    on = [s.value for s in BreakerState if value(engine, "prism_engine_batch_breaker_state", state=s.value) == 1]
    assert len(on) == 1
    return on[0]


def test_requests_gather_for_the_window_then_go_to_the_model_together() -> None:
    clock = Clock(1000.0)
    with engine_on(clock, SETTINGS) as engine:
        start = clock.now
        first = engine.submit(prompt(1, 100), {}, 1)
        assert engine.step() == pytest.approx(start + SETTINGS.max_window_s)
        clock.now += 0.1
        second = engine.submit(prompt(2, 100), {}, 1)
        assert engine.model.running == 0 and engine.batches == 0
        assert value(engine, "vllm:num_requests_waiting") == 2  # gathered requests wait too
        assert value(engine, "prism_engine_batch_window_seconds") == SETTINGS.max_window_s
        run_until(engine, clock, start + 0.3)
        assert engine.batches == 1
        assert first.job.admitted_s == pytest.approx(start + 0.2)
        assert second.job.admitted_s == pytest.approx(start + 0.2 + 100 / PREFILL)
        assert first.out.get_nowait() is first.job and second.out.get_nowait() is second.job
        assert value(engine, "vllm:num_requests_waiting") == 0
        assert value(engine, "prism_engine_batches_total") == 1
        assert engine.window is not None
        assert engine.window.p99_s() == pytest.approx(0.2, rel=0.01)  # the waits observed: 200 and 105 ms
        assert (engine.window.batches, engine.window.overruns) == (1, 0)
        assert value(engine, "vllm:time_to_first_token_seconds_count") == 2  # TTFT counts the window's wait


def test_the_window_shrinks_while_waits_are_over_target() -> None:
    clock = Clock(1000.0)
    with engine_on(clock, SETTINGS) as engine:
        start = clock.now
        streams = [engine.submit(prompt(i, 4000), {}, 1) for i in range(6)]  # 200 ms of prefill each, in a queue
        run_until(engine, clock, start + 1.5)
        waits = [s.job.admitted_s - s.job.arrival_s for s in streams if s.job.admitted_s is not None]
        assert waits == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.2])
        assert engine.window is not None and engine.window.p99_s() > SETTINGS.p99_target_s
        shrunk = value(engine, "prism_engine_batch_window_seconds")  # ten steps or so over target since 0.4 s
        assert SETTINGS.min_window_s <= shrunk < SETTINGS.max_window_s * (1 - SETTINGS.shrink) ** 8
        assert value(engine, "prism_engine_batch_overruns_total") == 1  # 1.2 s from hand-over to last first token
        assert state(engine) == "closed"


def test_overruns_open_the_breaker_then_a_passing_trial_closes_it() -> None:
    clock = Clock(1000.0)
    with engine_on(clock, SETTINGS) as engine:
        for i in range(3):  # three batches of one 8,000-token prompt: 400 ms from hand-over to first token
            engine.submit(prompt(i, 8000), {}, 1)
            run_until(engine, clock, clock.now + 1.0)
        assert engine.window is not None and engine.window.overruns == 3
        assert state(engine) == "open"
        assert value(engine, "prism_engine_batch_window_seconds") == 0
        assert value(engine, "prism_engine_batch_breaker_transitions_total", **{"from": "closed", "to": "open"}) == 1
        assert value(engine, "prism_engine_batch_breaker_transitions_total", **{"from": "open", "to": "closed"}) == 0

        batches = engine.batches
        alone = engine.submit(prompt(3, 100), {}, 1)  # open: handed to the model on arrival
        assert engine.batches == batches + 1 and alone.job.admitted_s == clock.now

        run_until(engine, clock, clock.now + SETTINGS.open_idle_s)
        assert state(engine) == "half_open"
        assert value(engine, "prism_engine_batch_window_seconds") == SETTINGS.min_window_s
        trial = engine.submit(prompt(4, 100), {}, 1)
        arrived = clock.now
        run_until(engine, clock, clock.now + 0.1)
        assert trial.job.admitted_s == pytest.approx(arrived + SETTINGS.min_window_s)
        assert state(engine) == "closed"
        counts = {
            (a.value, b.value): value(
                engine, "prism_engine_batch_breaker_transitions_total", **{"from": a.value, "to": b.value}
            )
            for a in BreakerState
            for b in BreakerState
            if a is not b
        }
        assert {k: v for k, v in counts.items() if v} == {
            ("closed", "open"): 1,
            ("open", "half_open"): 1,
            ("half_open", "closed"): 1,
        }


def test_a_fixed_window_gathers_without_a_breaker() -> None:
    clock = Clock(1000.0)
    with engine_on(clock, 0.3) as engine:
        streams = []
        for i in range(3):  # batches of 400 ms: overruns, which a fixed window does not heed
            streams.append(engine.submit(prompt(i, 8000), {}, 1))
            run_until(engine, clock, clock.now + 2.0)
        assert engine.window is None and engine.batches == 3
        assert [s.job.admitted_s - s.job.arrival_s for s in streams if s.job.admitted_s] == pytest.approx([0.3] * 3)
        assert value(engine, "prism_engine_batch_window_seconds") == 0.3
        assert not any(name.startswith("prism_engine_batch_breaker") for name, _ in samples(engine))


def test_without_a_window_requests_go_straight_to_the_model_and_no_window_metrics() -> None:
    clock = Clock(1000.0)
    with engine_on(clock, None) as engine:
        stream = engine.submit(prompt(1, 100), {}, 1)
        assert stream.job.admitted_s == clock.now
        assert not any(name.startswith("prism_engine_") for name, _ in samples(engine))


def test_a_prompt_too_large_for_the_cache_is_refused_at_submit() -> None:
    with engine_on(Clock(1000.0), SETTINGS) as engine:
        with pytest.raises(ValueError, match="exceed the KV cache"):
            engine.submit(prompt(1, 500_000), {}, 1)
        assert value(engine, "vllm:num_requests_waiting") == 0


def test_bad_window_options_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_adaptive:
        engine_main(["--batch-window", "adaptive", "--batch-window-max", "0.01"])
    assert exit_adaptive.value.code == 2
    assert "max_window_s (0.01) is under min_window_s (0.05)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_fixed:
        engine_main(["--batch-window", "fixed", "--batch-window-max", "nan"])
    assert exit_fixed.value.code == 2
    assert "a fixed batch window must be a finite number" in capsys.readouterr().err


def test_the_engine_process_admits_through_its_window() -> None:
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        log = Path(logs) / "engine.log"
        args = ["-m", "prismlb.demo._engine", "--gpu", "h100", "--port", str(port), "--batch-window", "fixed"]
        proc = spawn([*args, "--batch-window-max", "0.3"], log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: "engine on" in log.read_text(), what="the engine process to serve")
            payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
            sent = time.monotonic()
            ttft: float | None = None
            with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=10) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if ttft is None and line.startswith("data: "):
                        ttft = time.monotonic() - sent
            text = httpx.get(url + "/metrics", timeout=10).text
        finally:
            stop([proc])
        started = log.read_text()
    assert ttft is not None and ttft >= 0.3  # gathered for the fixed window before the model saw it
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["prism_engine_batch_window_seconds"].samples[0].value == 0.3
    assert families["prism_engine_batches"].samples[0].value == 1
    assert families["vllm:num_requests_waiting"].samples[0].labels == {"model_name": "prism-emulated-8b", "engine": "0"}
    assert "batch window fixed" in started


def test_a_quick_run_of_the_live_bench_prints_its_table() -> None:
    text, rows = quick_bench("batch_window_live.py")
    assert [r[0] for r in rows] == ["before", "spike", "after", "after"]
    for _, count, fixed, adaptive, ratio in rows:
        assert count > 0
        assert ratio == pytest.approx(fixed / adaptive, rel=0.02, abs=0.01)  # of the unrounded P99s
    assert re.search(r"^breaker transitions read from the adaptive engine's /metrics: ", text, re.M)
    assert "failed requests: fixed 0, adaptive 0" in text
