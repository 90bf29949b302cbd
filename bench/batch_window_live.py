"""The adaptive batch window against a fixed one, live: an emulated engine process per window, loaded over HTTP
through a spike.

Run: .venv/bin/python bench/batch_window_live.py [--quick] [--seed 1] [--load 0.3] [--spike 3]

For each window in turn, one emulated engine process (`python -m prismlb.demo._engine --gpu h100 --batch-window
fixed|adaptive`, time scale 1: model seconds are wall seconds) admits requests through its window as a server
embedding `AdaptiveBatchWindow` would: the first request that finds no batch gathering opens one, and when the
window has passed every request gathered goes to the engine model at once. The fixed window is 200 ms (the
adaptive window's maximum and start); the adaptive one has its default settings, observing each request's wait
before its prefill and each batch's run time (docs/batch-window.md).

The load: the arrivals of bench/batch_window.py (the Azure conv trace's prompt token counts in trace order,
Poisson arrivals at the rate that offers `--load` of the prefill rate, `--spike` times that rate during the
spike), the same for both engines, sent open loop (each request at its arrival time, whatever the others are
doing) as streamed chat completions with httpx. Outputs are capped at MAX_TOKENS tokens: the window acts before
the prefill, and a short stream keeps the client and the engine, which share this machine's cores, from
competing for them with thousands of chunks a second. A request's TTFT is from sending it to its first streamed
chunk. Every SAMPLE_S the bench reads the engine's `/metrics` (the window and the breaker's state), and at the
end the breaker's transition counters. The same requests also go through bench/batch_window.py's server (the
engine model alone, simulated time): what the live engines add to it is HTTP, processes and threads.

The default load, 30% before the spike and 90% during it, is where the adaptive window has room to move: at 60%
(`--load 0.6`) the spike overloads the engine and its queue, not any window, sets the TTFT (the simulated bench
shows both).
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from batch_window import (  # bench/batch_window.py: this script's directory is the first entry of sys.path
    GPU,
    Run,
    arrivals,
    counts_text,
    intervals,
    model_runs,
    p99s_ms,
    parse_options,
    ratio,
    table,
)
from prometheus_client.parser import text_string_to_metric_families

from prismlb.demo import free_port, spawn, stop, wait_healthy
from prismlb.otel import BatchWindowSettings
from prismlb.semantics import quantile
from prismlb.sim._engine import CHARS_PER_TOKEN, MODEL_NAME

LOAD = 0.3
"""Offered prefill work over the prefill rate before and after the spike (`--load`)."""
PHASES_S = {"full": (10.0, 8.0, 18.0), "quick": (1.0, 1.0, 2.0)}
"""Seconds before, during and after the spike; the full run's two engines take about 80 s together."""
MAX_TOKENS = 8
"""Output tokens at most per request (the trace's count when smaller), for the engines and the model alike."""
SAMPLE_S = 0.25
"""How often the engine's `/metrics` is read for the timeline."""
START_LIMIT_S = 30.0
DRAIN_LIMIT_S = 60.0
"""Seconds the requests still streaming after the last arrival get to finish."""
WINDOWS = ("fixed", "adaptive")


@dataclass
class Live:
    """What one engine did under the load."""

    ttfts: list[tuple[float, float]] = field(default_factory=list)
    """(arrival s, TTFT s) per request answered."""
    failures: list[str] = field(default_factory=list)
    timeline: list[tuple[float, float, str]] = field(default_factory=list)
    """(time s, window s, breaker state: empty without a breaker) every SAMPLE_S."""
    transitions: dict[str, int] = field(default_factory=dict)
    """Breaker transitions by kind (`closed->open`), from the counters at the end."""
    batches: int = 0
    overruns: int = 0


def prompt(index: int, tokens: int) -> str:
    """A prompt of `tokens` emulated tokens whose first block is its own: no prefix shared with another."""
    return f"request {index:06d} ".ljust(tokens * CHARS_PER_TOKEN, "x")


def read_metrics(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Samples of a `/metrics` exposition (Prometheus's own parser), by sample name, then labels."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def window_and_state(samples: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> tuple[float, str]:
    """The engine's window (s) and breaker state (empty without a breaker)."""
    window = next(iter(samples["prism_engine_batch_window_seconds"].values()))
    states = samples.get("prism_engine_batch_breaker_state", {})
    on = [dict(labels)["state"] for labels, v in states.items() if v == 1]
    return window, on[0] if on else ""


async def one(client: httpx.AsyncClient, index: int, tokens: int, max_tokens: int) -> float:
    """Send one streamed request; seconds to its first chunk (the stream is read to its end)."""
    payload = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt(index, tokens)}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    sent = time.monotonic()
    first: float | None = None
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: "):
                first = time.monotonic() - sent
    if first is None:
        raise RuntimeError("the stream ended without a chunk")
    return first


async def drive(url: str, requests: Sequence[tuple[float, int, int]]) -> Live:
    """The open-loop load on the engine at `url`, its `/metrics` sampled meanwhile and read at the end."""
    live = Live()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0), limits=limits) as client:
        start = time.monotonic()
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                at = time.monotonic() - start
                window, state = window_and_state(read_metrics((await client.get("/metrics")).text))
                live.timeline.append((at, window, state))
                await asyncio.sleep(max(0.0, at + SAMPLE_S - (time.monotonic() - start)))

        async def timed(index: int, at: float, tokens: int, max_tokens: int) -> None:
            try:
                live.ttfts.append((at, await one(client, index, tokens, max_tokens)))
            except (httpx.HTTPError, RuntimeError) as exc:
                live.failures.append(f"request {index}: {exc!r}")

        sampler = asyncio.create_task(sample())
        tasks = []
        for index, (at, tokens, output) in enumerate(requests):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(timed(index, at, tokens, output)))
        _, unfinished = await asyncio.wait(tasks, timeout=DRAIN_LIMIT_S)
        for task in unfinished:
            task.cancel()
        live.failures.extend(f"unfinished after {DRAIN_LIMIT_S:g} s" for _ in unfinished)
        done.set()
        await sampler
        end = read_metrics((await client.get("/metrics")).text)
    live.batches = int(next(iter(end["prism_engine_batches_total"].values())))
    live.overruns = int(sum(end.get("prism_engine_batch_overruns_total", {}).values()))
    for labels, n in end.get("prism_engine_batch_breaker_transitions_total", {}).items():
        kind = dict(labels)
        if n:
            live.transitions[f"{kind['from']}->{kind['to']}"] = int(n)
    return live


def run_engine(window: str, requests: Sequence[tuple[float, int, int]], logs: Path) -> Live:
    """One engine process with `window`, loaded with `requests`, stopped afterwards."""
    port = free_port()
    log = logs / f"engine-{window}.log"
    args = ["-m", "prismlb.demo._engine", "--gpu", GPU, "--port", str(port), "--batch-window", window]
    proc = spawn(args, log)
    try:
        url = f"http://127.0.0.1:{port}"
        if not wait_healthy(f"{url}/health", proc, time.monotonic() + START_LIMIT_S):
            raise SystemExit(f"the engine at {url} did not start:\n{log.read_text(errors='replace')}")
        return asyncio.run(drive(url, requests))
    finally:
        stop([proc])


def p99_ms(live: Live, start: float, end: float) -> float:
    """P99 TTFT (ms) of the requests arriving in [start, end); NaN when none was answered."""
    return quantile([t for at, t in live.ttfts if start <= at < end], 0.99) * 1e3


def ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}"


def phase_rows(
    runs: dict[str, Live],
    models: dict[str, Run],
    requests: Sequence[tuple[float, int, int]],
    phases: Sequence[tuple[str, float, float]],
) -> list[list[str]]:
    rows = []
    for label, start, end in phases:
        n = sum(1 for at, _, _ in requests if start <= at < end)
        fixed, adaptive = p99_ms(runs["fixed"], start, end), p99_ms(runs["adaptive"], start, end)
        model_fixed, model_adaptive = (p99s_ms(models[w], start, end)[2] for w in WINDOWS)
        row = [label, str(n), ms(fixed), ms(adaptive), ratio(fixed, adaptive)]
        rows.append(row + [ms(model_fixed), ms(model_adaptive), ratio(model_fixed, model_adaptive)])
    return rows


def timeline_rows(
    runs: dict[str, Live], spike: tuple[float, float], label: str, every_s: float, end_s: float
) -> list[list[str]]:
    """Per interval until the last arrival: load, the adaptive engine's window range and breaker states, P99 TTFT
    by arrival of both engines."""
    adaptive = runs["adaptive"]
    return [
        [
            *cells,
            str(sum(1 for at, _ in adaptive.ttfts if start <= at < end)),
            ms(p99_ms(runs["fixed"], start, end)),
            ms(p99_ms(adaptive, start, end)),
        ]
        for start, end, cells in intervals(adaptive.timeline, spike, label, every_s, end_s)
    ]


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> None:
    args, phases_s = parse_options(argv, __doc__, PHASES_S, LOAD)
    rates = (args.load, args.spike, args.seed)
    before_s, spike_s, after_s = phases_s
    spike_end, end_s = before_s + spike_s, before_s + spike_s + after_s
    requests = [(at, tokens, min(output, MAX_TOKENS)) for at, tokens, output in arrivals(phases_s, *rates)]
    settings = BatchWindowSettings()
    with tempfile.TemporaryDirectory(prefix="prism-batch-window-") as logs:
        runs = {window: run_engine(window, requests, Path(logs)) for window in WINDOWS}
    models, model_window = model_runs(requests, settings)
    half = after_s / 2
    phases = [
        (f"before (steady {args.load:.0%})", 0.0, before_s),
        (f"spike ({args.spike:g}×)", before_s, spike_end),
        (f"after, first {half:g} s", spike_end, spike_end + half),
        ("after, rest", spike_end + half, end_s),
    ]
    steady = sum(1 for at, _, _ in requests if at < before_s) / before_s
    out(
        f"{GPU} emulated engine, one process per window, time scale 1; Azure conv token counts, Poisson arrivals "
        f"offering {args.load:.0%} of the prefill rate ({steady:.1f} req/s before the spike), {args.spike:g}× from "
        f"{before_s:g} s to {spike_end:g} s; {len(requests)} requests per engine, outputs capped at {MAX_TOKENS} "
        f"tokens, seed {args.seed}"
    )
    out("")
    fixed_ms = settings.max_window_s * 1e3
    header = (
        "phase (by arrival)",
        "requests",
        f"P99 TTFT ms: fixed {fixed_ms:.0f} ms",
        "adaptive",
        "fixed / adaptive",
        "model alone: fixed",
        "adaptive",
        "fixed / adaptive",
    )
    out(table(header, phase_rows(runs, models, requests, phases)))
    out("")
    adaptive = runs["adaptive"]
    out(
        f"batches handed to the model: {', '.join(f'{name} {run.batches}' for name, run in runs.items())}; "
        f"adaptive: {adaptive.overruns} of {adaptive.batches} overran (≥ {settings.overrun_s * 1e3:.0f} ms)"
    )
    out(f"failed requests: {', '.join(f'{name} {len(run.failures)}' for name, run in runs.items())}")
    for name, run in runs.items():
        for failure in run.failures[:3]:
            out(f"  {name}: {failure}")
    out("")
    out(
        f"adaptive engine over time (its /metrics read every {SAMPLE_S * 1e3:.0f} ms; "
        "requests and P99 TTFT by arrival):"
    )
    out("")
    header = ("t s", "load", "window ms", "breaker", "requests", "P99 TTFT ms: fixed", "adaptive")
    every = 1.0 if args.quick else 2.0
    out(table(header, timeline_rows(runs, (before_s, spike_end), f"{args.spike:g}×", every, end_s)))
    out("")
    counts, model_counts = counts_text(adaptive.transitions), counts_text(model_window.transition_counts())
    out(f"breaker transitions read from the adaptive engine's /metrics: {counts}; the model alone: {model_counts}")


if __name__ == "__main__":
    main()
