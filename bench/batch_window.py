"""The adaptive batch window against a fixed one, in front of the replay's engine model, through a load spike.

Run: .venv/bin/python bench/batch_window.py [--quick] [--seed 1]

The server: an admission queue in front of one `EngineModel` (the H100 profile; the timings of the emulated
engine and the cluster replay, docs/sim.md). A batch opens with the first request that finds none gathering;
the window is read then (`window_s`), and when it has passed every request gathered is handed to the engine at
once (a window of 0 hands each request over as it arrives). The engine queues and prefills them as it does any
request. The window observes each request's wait, from its arrival to the start of its prefill (the window's
wait plus the engine's queue: the part of the time to first token a window changes; the longest prompts'
prefill alone takes over 200 ms on this profile, so a bound on the whole TTFT would hold any window at its
floor). A batch's run time, for the breaker: from its hand-over to its last request's first token.

The load: the Azure LLM inference trace (conv), its prompt and output token counts in trace order, with Poisson
arrivals at the rate that offers 60% of the profile's prefill rate (mean prompt tokens × rate = 0.6 × prefill
tokens/s), three times that rate during the spike. Simulated time: the run is deterministic for a seed and
takes seconds.

The same arrivals go through three servers: the fixed window (200 ms, the adaptive window's maximum and
starting point), the adaptive window with its default settings, and no window at all (each request handed over
on arrival). The engine model prefills one request at a time at a rate that does not depend on how many came
together, so in this model a window buys no throughput and costs only its wait: the no-window server is the
floor any window can reach, and what is measured is each window's cost and how the adaptive one bounds it.
`bench/batch_window_live.py` sends the same arrivals to emulated engine processes that embed the windows.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prismlb.otel import AdaptiveBatchWindow, BatchWindowSettings, BreakerState, BreakerTransition
from prismlb.semantics import quantile
from prismlb.sim import PROFILES, EngineModel, Job, azure
from prismlb.sim._model import Event

GPU = "h100"
UTILISATION = 0.6
"""Offered prefill work over the prefill rate before and after the spike (`--load`), as `prism eval` levels are."""
SPIKE = 3.0
"""The spike's arrival rate over the steady one (`--spike`)."""
TRACE_REQUESTS = 4000
"""Requests read from the trace's start, for their token counts; a run takes what it needs in order."""
PHASES_S = {"full": (40.0, 10.0, 50.0), "quick": (10.0, 10.0, 25.0)}
"""Seconds before, during and after the spike."""
SAMPLE_S = 0.1
"""How often the adaptive window and its breaker are sampled for the timeline."""


class Window(Protocol):
    """What the server asks of a window and tells it (AdaptiveBatchWindow's interface)."""

    def window_s(self, now: float | None = None) -> float: ...
    def observe(self, latency_s: float, now: float | None = None) -> bool: ...
    def record_batch(self, duration_s: float, now: float | None = None) -> bool: ...


class FixedWindow:
    """A window that never moves and has no breaker; it ignores what it is told."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s

    def window_s(self, now: float | None = None) -> float:
        return self._window_s

    def observe(self, latency_s: float, now: float | None = None) -> bool:
        return True

    def record_batch(self, duration_s: float, now: float | None = None) -> bool:
        return True


class SimClock:
    """The simulation's time, the adaptive window's clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class Batch:
    handed_s: float
    waiting: int
    """Requests whose first token has not come yet."""


@dataclass
class Run:
    """What one server did."""

    requests: list[tuple[float, float, float]] = field(default_factory=list)
    """(arrival s, wait s, TTFT s) per request."""
    timeline: list[tuple[float, float, str]] = field(default_factory=list)
    """(time s, window s, breaker state) every SAMPLE_S."""
    batches: int = 0


def arrivals(
    phases_s: tuple[float, float, float], load: float, spike: float, seed: int
) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens): the trace's token counts in its order, Poisson arrivals at the
    rate that offers `load` of the prefill rate, `spike` times that rate during the spike."""
    before_s, spike_s, after_s = phases_s
    trace = azure("conv", TRACE_REQUESTS).requests
    rate = load * PROFILES[GPU].prefill_tokens_per_s * len(trace) / sum(r.input_tokens for r in trace)
    rng = random.Random(seed)
    spike_end, end = before_s + spike_s, before_s + spike_s + after_s
    out: list[tuple[float, int, int]] = []
    t = 0.0
    for r in trace:
        t += rng.expovariate(rate * (spike if before_s <= t < spike_end else 1.0))
        if t >= end:
            return out
        out.append((t, r.input_tokens, r.output_tokens))
    raise SystemExit(f"the first {TRACE_REQUESTS} trace requests end before the run does; read more of the trace")


def serve(requests: Sequence[tuple[float, int, int]], window: Window, clock: SimClock) -> Run:
    """Run the admission queue and the engine model over `requests`, everything due at one time in the order:
    the engine's events, a batch whose window has passed, new arrivals, the timeline sample."""
    engine = EngineModel(PROFILES[GPU])
    run = Run()
    jobs = [Job((), prompt, output, 0.0, arrival) for arrival, prompt, output in requests]
    waits: dict[Job, float] = {}
    gathering: list[Job] = []
    deadline, next_sample = math.inf, 0.0
    i = 0
    adaptive = window if isinstance(window, AdaptiveBatchWindow) else None

    def handle(events: list[Event]) -> None:
        for kind, job, t in events:
            if kind == "admitted":
                waits[job] = t - job.arrival_s
                window.observe(t - job.arrival_s, t)
            elif kind == "first_token":
                run.requests.append((job.arrival_s, waits.pop(job), t - job.arrival_s))
                batch = job.tag
                assert isinstance(batch, Batch)
                batch.waiting -= 1
                if not batch.waiting:
                    window.record_batch(t - batch.handed_s, t)

    def hand_over(now: float) -> None:
        batch = Batch(now, len(gathering))
        run.batches += 1
        for job in gathering:
            job.tag = batch
            handle(engine.submit(job, now))
        gathering.clear()

    while i < len(jobs) or gathering or engine.running or engine.waiting:
        now = min(jobs[i].arrival_s if i < len(jobs) else math.inf, deadline, engine.next_event_s(), next_sample)
        clock.now = now
        handle(engine.advance(now))
        if deadline <= now:
            hand_over(now)
            deadline = math.inf
        while i < len(jobs) and jobs[i].arrival_s <= now:
            gathering.append(jobs[i])
            i += 1
            if len(gathering) == 1:
                deadline = now + window.window_s(now)
            if deadline <= now:
                hand_over(now)
                deadline = math.inf
        if next_sample <= now:
            state = adaptive.state if adaptive is not None else ""
            run.timeline.append((now, window.window_s(now), str(state)))
            next_sample = now + SAMPLE_S if i < len(jobs) else math.inf
    return run


def p99s_ms(run: Run, start: float, end: float) -> tuple[int, float, float]:
    """Requests arriving in [start, end), the P99 of their wait and of their TTFT, in ms."""
    inside = [(wait, ttft) for arrival, wait, ttft in run.requests if start <= arrival < end]
    return (
        len(inside),
        quantile([w for w, _ in inside], 0.99) * 1e3,
        quantile([t for _, t in inside], 0.99) * 1e3,
    )


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b > 0 else "-"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def phase_rows(runs: dict[str, Run], phases: Sequence[tuple[str, float, float]], target_ms: float) -> list[list[str]]:
    rows = []
    for label, start, end in phases:
        n, fixed_wait, fixed_ttft = p99s_ms(runs["fixed"], start, end)
        _, wait, ttft = p99s_ms(runs["adaptive"], start, end)
        _, none_wait, none_ttft = p99s_ms(runs["none"], start, end)
        rows.append(
            [
                label,
                str(n),
                f"{fixed_ttft:,.0f}",
                f"{ttft:,.0f}",
                ratio(fixed_ttft, ttft),
                f"{none_ttft:,.0f}",
                f"{fixed_wait:,.0f}",
                f"{wait:,.0f}",
                ratio(fixed_wait, wait),
                f"{none_wait:,.0f}",
                f"≤ {target_ms:.0f}",
            ]
        )
    return rows


def intervals(
    timeline: Sequence[tuple[float, float, str]], spike: tuple[float, float], label: str, every_s: float, end_s: float
) -> Iterator[tuple[float, float, list[str]]]:
    """Each `every_s` interval up to `end_s` that holds a sample of `timeline` ((time s, window s, breaker state)):
    its start, its end and a timeline row's first cells: the interval, the load (`label` inside `spike`), the
    window's range in ms and the breaker's states."""
    order = [s.value for s in BreakerState]
    for k in range(math.ceil(end_s / every_s)):
        start, end = k * every_s, (k + 1) * every_s
        inside = [(w, s) for t, w, s in timeline if start <= t < end]
        if not inside:
            continue
        low, high = min(w for w, _ in inside), max(w for w, _ in inside)
        yield (
            start,
            end,
            [
                f"{start:.0f}–{end:.0f}",
                label if spike[0] <= start < spike[1] else "",
                f"{low * 1e3:.0f}–{high * 1e3:.0f}" if high - low >= 5e-4 else f"{low * 1e3:.0f}",
                ", ".join(sorted({s for _, s in inside}, key=order.index)),
            ],
        )


def timeline_rows(run: Run, spike: tuple[float, float], label: str, every_s: float, end_s: float) -> list[list[str]]:
    """Per interval: load, the adaptive window's range, the breaker's states, P99 wait and TTFT by arrival."""
    rows = []
    for start, end, cells in intervals(run.timeline, spike, label, every_s, end_s):
        n, wait, ttft = p99s_ms(run, start, end)
        rows.append([*cells, str(n), f"{wait:,.0f}" if n else "-", f"{ttft:,.0f}" if n else "-"])
    return rows


def transition_rows(transitions: Sequence[BreakerTransition]) -> list[list[str]]:
    return [[f"{t.at_s:.2f}", f"{t.source} → {t.target}", t.reason] for t in transitions]


def counts_text(counts: Mapping[str, int]) -> str:
    """Breaker transitions by kind, `none` when there were none."""
    return ", ".join(f"{kind} {n}" for kind, n in counts.items()) or "none"


def parse_options(
    argv: Sequence[str] | None, doc: str | None, phases_s: Mapping[str, tuple[float, float, float]], load: float
) -> tuple[argparse.Namespace, tuple[float, float, float]]:
    """The spike benches' flags (`--quick`, `--seed`, `--load` defaulting to `load`, `--spike`) and the run's
    phases, `phases_s`'s quick or full ones; a usage error for a load or spike that is not a positive number."""
    before_s, spike_s, after_s = phases_s["quick"]
    quick = f"shorter phases: {before_s:g} s before, {spike_s:g} s spike, {after_s:g} s after"
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--seed", type=int, default=1, help="seed of the Poisson arrivals (default 1)")
    parser.add_argument("--load", type=float, default=load, help=f"steady load (default {load})")
    parser.add_argument("--spike", type=float, default=SPIKE, help=f"spike over steady rate (default {SPIKE:g})")
    args = parser.parse_args(argv)
    if not (0 < args.load and 0 < args.spike and math.isfinite(args.load * args.spike)):
        parser.error("--load and --spike must be positive numbers")
    return args, phases_s["quick" if args.quick else "full"]


def model_runs(
    requests: Sequence[tuple[float, int, int]], settings: BatchWindowSettings
) -> tuple[dict[str, Run], AdaptiveBatchWindow]:
    """`requests` served by the engine model through the fixed window (the adaptive one's maximum) and through
    the adaptive window with `settings`, by name; and that adaptive window, for its breaker's record."""
    clock = SimClock()
    adaptive = AdaptiveBatchWindow(settings, clock=clock)
    fixed = serve(requests, FixedWindow(settings.max_window_s), SimClock())
    return {"fixed": fixed, "adaptive": serve(requests, adaptive, clock)}, adaptive


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> None:
    args, phases_s = parse_options(argv, __doc__, PHASES_S, UTILISATION)
    before_s, spike_s, after_s = phases_s
    spike_end, end_s = before_s + spike_s, before_s + spike_s + after_s
    requests = arrivals(phases_s, args.load, args.spike, args.seed)
    settings = BatchWindowSettings()
    runs, adaptive = model_runs(requests, settings)
    runs["none"] = serve(requests, FixedWindow(0.0), SimClock())
    phases = [
        (f"before (steady {args.load:.0%})", 0.0, before_s),
        (f"spike ({args.spike:g}×)", before_s, spike_end),
        ("after, first 10 s", spike_end, spike_end + 10.0),
        ("after, next 10 s", spike_end + 10.0, spike_end + 20.0),
        ("after, rest", spike_end + 20.0, end_s),
    ]
    steady = sum(1 for arrival, _, _ in requests if arrival < before_s) / before_s
    out(
        f"{GPU} engine model; Azure conv token counts, Poisson arrivals offering {args.load:.0%} of the prefill rate "
        f"({steady:.1f} req/s before the spike), {args.spike:g}× from {before_s:g} s to {spike_end:g} s; "
        f"{len(requests)} requests, seed {args.seed}"
    )
    out("")
    header = (
        "phase (by arrival)",
        "requests",
        "P99 TTFT ms: fixed 200 ms",
        "adaptive",
        "fixed / adaptive",
        "no window",
        "P99 wait ms: fixed",
        "adaptive",
        "fixed / adaptive",
        "no window",
        "design target, wait",
    )
    out(table(header, phase_rows(runs, phases, settings.p99_target_s * 1e3)))
    out("")
    out(
        f"batches handed to the engine: {', '.join(f'{name} {run.batches}' for name, run in runs.items())}; "
        f"adaptive: {adaptive.overruns} of {adaptive.batches} overran (≥ {settings.overrun_s * 1e3:.0f} ms)"
    )
    out("")
    out("adaptive window over time (window and breaker sampled every 100 ms; P99s of the requests arriving then):")
    out("")
    every = 1.0 if args.quick else 2.0
    header = ("t s", "load", "window ms", "breaker", "requests", "P99 wait ms", "P99 TTFT ms")
    out(table(header, timeline_rows(runs["adaptive"], (before_s, spike_end), f"{args.spike:g}×", every, end_s)))
    out("")
    out(f"breaker transitions ({counts_text(adaptive.transition_counts())}):")
    out("")
    out(table(("t s", "transition", "why"), transition_rows(adaptive.transitions)))


if __name__ == "__main__":
    main()
