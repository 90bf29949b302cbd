"""A hot model-version switch under load: multi-turn sessions stream through Prism's router while the A/B arm
moves from v1 to v2, once with session snapshots (the new version loads each moved session's context) and once
without (it recomputes it).

Run: .venv/bin/python bench/version_switch.py [--quick] [--seed 1] [--variant snapshots|recompute]

Each variant starts a fresh cluster on loopback with `prismlb.demo`'s process helpers: a brain (`prism brain`,
its admin API behind a token file), A100 engines (`python -m prismlb.demo._engine`, time scale 1) of model
version v1 and v2 (2 + 2; 1 + 1 with `--quick`), with `--snapshot-dir` on one shared directory in the snapshots
variant, and an agent per engine (`prism agent --label model_version=vN`, no eBPF). In this process: a router
(`Router.connect` to the brain) under `AsyncPrismTransport`, and the sessions.

The experiment starts as a canary, `prism ctl experiment set switch --slice llm --arm v1=0.9 --arm v2=0.1`.
Each session is a conversation of its own: a first prompt of DOC_TOKENS tokens (a document no other session
shares), then turns adding USER_TOKENS tokens each, MAX_TOKENS tokens out, streamed, with a think time between
turns; the next turn sends back the answer's `X-Context-Signature` (which only engines with snapshots send) and
its `X-Session-Token` always. Half-way the bench moves the arm, `prism ctl experiment set switch --slice llm
--arm v2=1`, and the sessions keep going until the end; streams in flight at the switch finish on v1, and each
session's next turn goes to v2 (the router moves it and carries its signature).

Reported per variant: requests sent, answered and lost (no complete answer: goal 0), streams broken (a stream
that began and did not end with `[DONE]`: goal 0), the moved sessions' first request on v2 (TTFT from sending it
to its first streamed chunk, and the share of its prompt the engine found cached, `usage.prompt_tokens_details.
cached_tokens`), and from the engines' `/metrics` the snapshot write and context load times (P50/P95 from their
histograms summed over the engines; the share within the targets, 8 ms and 12 ms, is exact: both are bucket
bounds) and what became of each request that carried a signature. Last, the directory store alone, once the
clusters are stopped: snapshots of the moved contexts' mean size written and read in this process, which shows
what of the engines' times is the store and what is contention on the host. Results: docs/version-switch.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prismlb.agent._engine import histogram_quantile
from prismlb.demo import free_port, llm_nodes, log_tails, percentile, signals_interrupt, spawn, stop, wait_healthy
from prismlb.otel import DirectorySnapshotStore, SessionSnapshot, context_hash
from prismlb.router import CONTEXT_HEADER, SESSION_HEADER, AsyncPrismTransport, Router
from prismlb.sim._engine import BLOCK_SIZE_TOKENS, CHARS_PER_TOKEN, MODEL_NAME
from prismlb.wire import BrainAddress, RoutingTable

EXPERIMENT = "switch"
CANARY = {"v1": 0.9, "v2": 0.1}
SWITCHED = {"v2": 1.0}
GPU = "a100"
MAX_TOKENS = 12
USER_TOKENS = 60
THINK_S = (0.2, 0.6)
"""Seconds a session waits between an answer and its next turn (uniform)."""
WRITE_TARGET_S = 0.008
LOAD_TARGET_S = 0.012
"""The targets at P95: a snapshot written within 8 ms, a context loaded within 12 ms."""
START_LIMIT_S = 40.0
DRAIN_LIMIT_S = 30.0
WORDS = (
    "alpha bravo cargo delta engine falcon garden harbor island jungle kernel lantern meadow nectar orbit "
    "prism quartz river signal timber umbra vector willow xenon yellow zephyr"
).split()


@dataclass(frozen=True)
class Scale:
    """How big a run is: engines per version, sessions, their first prompt, the phases' seconds."""

    engines: int
    sessions: int
    doc_tokens: int
    spread_s: float
    """Seconds over which the sessions' first turns are spread."""
    before_s: float
    after_s: float


SCALES = {
    "full": Scale(engines=2, sessions=24, doc_tokens=3000, spread_s=6.0, before_s=15.0, after_s=15.0),
    "quick": Scale(engines=1, sessions=8, doc_tokens=1500, spread_s=2.0, before_s=3.0, after_s=3.0),
}
VARIANTS = ("snapshots", "recompute")


@dataclass
class Turn:
    """One request of a session, as the client saw it."""

    session: int
    index: int
    sent_s: float
    end_s: float = 0.0
    ttft_s: float | None = None
    version: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    broken: bool = False
    """It began streaming and did not end with `[DONE]`."""


@dataclass
class Outcome:
    """One variant's run."""

    variant: str
    turns: list[Turn] = field(default_factory=list)
    switch_sent_s: float | None = None
    switch_applied_s: float | None = None
    """When the router's table first had the switched arms (seconds from the start of the load)."""
    writes: list[tuple[float, float]] = field(default_factory=list)
    loads: list[tuple[float, float]] = field(default_factory=list)
    """Snapshot write and context load histograms summed over the engines: cumulative (bound, count)."""
    outcomes: dict[str, int] = field(default_factory=dict)
    """Requests that carried a signature, by what the engines did with their context."""
    store_errors: dict[str, int] = field(default_factory=dict)
    write_failures: int = 0
    problem: str | None = None

    @property
    def lost(self) -> list[Turn]:
        return [t for t in self.turns if t.error is not None]

    @property
    def broken(self) -> list[Turn]:
        return [t for t in self.turns if t.broken]

    def moved(self) -> list[Turn]:
        """Each session's first answered turn on v2 after one on v1: the requests the switch moved."""
        first: list[Turn] = []
        last: dict[int, str] = {}
        for turn in sorted(self.turns, key=lambda t: t.sent_s):
            if turn.error is not None or turn.version is None:
                continue
            if turn.version == "v2" and last.get(turn.session) == "v1":
                first.append(turn)
            last[turn.session] = turn.version
        return first

    def settled(self) -> list[Turn]:
        """The moved sessions' later turns on v2: the same engines and period, the context already there."""
        moved = self.moved()
        first = {t.session: t for t in moved}
        return [
            t
            for t in self.turns
            if t.error is None and t.version == "v2" and t.session in first and t.sent_s > first[t.session].sent_s
        ]

    def across_switch(self) -> list[Turn]:
        """Requests sent before the router applied the switch and finished after it."""
        at = self.switch_applied_s
        return [t for t in self.turns if at is not None and t.sent_s < at < t.end_s]


def words(rng: random.Random, tokens: int) -> str:
    """About `tokens` emulated tokens of words drawn from `rng`."""
    text = " ".join(rng.choice(WORDS) for _ in range(tokens * CHARS_PER_TOKEN // 6 + 1))
    return text[: tokens * CHARS_PER_TOKEN]


async def one_turn(
    client: httpx.AsyncClient, turn: Turn, messages: list[dict[str, str]], headers: dict[str, str]
) -> str | None:
    """Send one streamed turn and read it to its end into `turn`; the answer's context signature."""
    payload = {"model": MODEL_NAME, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True}
    started = time.monotonic()
    signature: str | None = None
    began = done = False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=payload, headers=headers) as response:
            if response.status_code != 200:
                turn.error = f"HTTP {response.status_code}"
                return None
            turn.version = response.headers.get("X-Emulated-Model-Version")
            signature = response.headers.get(CONTEXT_HEADER)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[len("data: ") :])
                if not began:
                    began = True
                    turn.ttft_s = time.monotonic() - started
                usage = chunk.get("usage")
                if usage:
                    turn.prompt_tokens = usage["prompt_tokens"]
                    turn.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    if turn.error is None and not done:
        turn.error = "the stream ended without [DONE]"
    turn.broken = began and not done
    return signature if turn.error is None else None


async def session(
    client: httpx.AsyncClient, index: int, seed: int, scale: Scale, start: float, stop_at: float, out: Outcome
) -> None:
    """One conversation, turn after turn, until `stop_at` (monotonic); its history keeps the answered turns only,
    so after a failed one the session asks again."""
    rng = random.Random(seed * 1_000_003 + index)
    token = f"session-{seed}-{index}"
    history = [{"role": "system", "content": f"session {index}: " + words(rng, scale.doc_tokens)}]
    signature: str | None = None
    await asyncio.sleep(scale.spread_s * index / scale.sessions)
    number = 0
    while time.monotonic() < stop_at:
        question = {"role": "user", "content": f"question {number}: " + words(rng, USER_TOKENS)}
        headers = {SESSION_HEADER: token, "X-Modality-Signature": "text"}
        if signature is not None:
            headers[CONTEXT_HEADER] = signature
        turn = Turn(index, number, time.monotonic() - start)
        out.turns.append(turn)
        answered = await one_turn(client, turn, [*history, question], headers)
        turn.end_s = time.monotonic() - start
        if turn.error is None:
            history += [question, {"role": "assistant", "content": "tok " * MAX_TOKENS}]
            signature = answered or signature
            number += 1
        await asyncio.sleep(rng.uniform(*THINK_S))


def ctl(admin: str, token_file: Path, arms: dict[str, float]) -> None:
    """`prism ctl experiment set` with these arms; SystemExit when it fails."""
    command = [sys.executable, "-m", "prismlb.cli", "ctl", "--admin", admin, "--token-file", str(token_file)]
    command += ["experiment", "set", EXPERIMENT, "--slice", "llm"]
    for version, fraction in arms.items():
        command += ["--arm", f"{version}={fraction:g}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[2:])} failed: {done.stderr.strip()}")


def has_arms(table: RoutingTable | None, arms: dict[str, float]) -> bool:
    """Whether the table's experiment on the text slice has exactly these arms' versions."""
    if table is None:
        return False
    return any(e.name == EXPERIMENT and {a.model_version for a in e.arms} == set(arms) for e in table.experiments)


async def drive(router: Router, outcome: Outcome, scale: Scale, seed: int, admin: str, token_file: Path) -> None:
    """The sessions through the router, the switch half-way, then the drain."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    transport = AsyncPrismTransport(router)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://prism", timeout=httpx.Timeout(60.0, connect=2.0), limits=limits
    ) as client:
        start = time.monotonic()
        stop_at = start + scale.before_s + scale.after_s
        tasks = [
            asyncio.create_task(session(client, i, seed, scale, start, stop_at, outcome)) for i in range(scale.sessions)
        ]
        await asyncio.sleep(scale.before_s)
        outcome.switch_sent_s = time.monotonic() - start
        switch = asyncio.create_task(asyncio.to_thread(ctl, admin, token_file, SWITCHED))
        while not has_arms(router.table, SWITCHED):  # watched while the command runs: it exits after the brain
            if switch.done():  # took the change, and the table may reach the router first
                switch.result()
            await asyncio.sleep(0.005)
        outcome.switch_applied_s = time.monotonic() - start
        await switch
        _, unfinished = await asyncio.wait(tasks, timeout=stop_at - time.monotonic() + DRAIN_LIMIT_S)
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        for turn in outcome.turns:
            if not turn.end_s:
                turn.error, turn.end_s = f"unfinished {DRAIN_LIMIT_S:g} s after the end", time.monotonic() - start


def histogram(texts: Sequence[str], name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets summed over several `/metrics` expositions (Prometheus's parser)."""
    counts: dict[float, float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == f"{name}_bucket":
                    bound = float(sample.labels["le"])
                    counts[bound] = counts.get(bound, 0.0) + sample.value
    return sorted(counts.items())


def by_label(texts: Sequence[str], name: str, label: str) -> dict[str, int]:
    """A counter's samples summed by one label over several expositions."""
    out: dict[str, int] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    key = sample.labels.get(label, "")
                    out[key] = out.get(key, 0) + int(sample.value)
    return out


def run(variant: str, scale: Scale, seed: int, logs: Path) -> Outcome:
    """One variant on a fresh cluster; every process it started is stopped before it returns."""
    outcome = Outcome(variant)
    logs.mkdir(parents=True)
    token_file = logs / "admin-token"
    token_file.touch(mode=0o600)  # the brain refuses a token file others could read
    token_file.write_text(secrets.token_hex(24))
    snapshots = logs / "snapshots"
    ingest = f"tcp://127.0.0.1:{free_port()}"
    address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    admin = f"http://127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen[bytes]] = []
    engines: list[tuple[str, str, subprocess.Popen[bytes]]] = []
    with contextlib.ExitStack() as stack:
        stack.callback(stop, procs)
        brain = [
            *("-m", "prismlb.cli", "brain", "--ingest", ingest, "--updates", address.updates),
            *("--snapshot", address.snapshot, "--metrics-port", str(free_port()), "--admin-port", admin.split(":")[-1]),
            *("--state-dir", str(logs / "brain-state"), "--admin-token-file", str(token_file)),
        ]
        procs.append(spawn(brain, logs / "brain.log"))
        for version in ("v1", "v2"):
            for i in range(scale.engines):
                node, port, kv = f"{version}-{i + 1}", free_port(), f"tcp://127.0.0.1:{free_port()}"
                url = f"http://127.0.0.1:{port}"
                args = ["-m", "prismlb.demo._engine", "--gpu", GPU, "--port", str(port), "--kv-events", kv]
                args += ["--model-version", version]
                if variant == "snapshots":
                    args += ["--snapshot-dir", str(snapshots)]
                engine = spawn(args, logs / f"engine-{node}.log")
                procs.append(engine)
                engines.append((node, url, engine))
                agent = [
                    *("-m", "prismlb.cli", "agent", "--node-id", node, "--brain", ingest, "--endpoint", url),
                    *("--engine-url", f"{url}/metrics", "--kv-events", kv, "--label", f"model_version={version}"),
                    *("--otlp-grpc-port", str(free_port()), "--otlp-http-port", "0"),
                    *("--metrics-port", str(free_port()), "--period", "1", "--no-ebpf"),
                ]
                procs.insert(0, spawn(agent, logs / f"agent-{node}.log"))
        deadline = time.monotonic() + START_LIMIT_S
        for node, url, engine in engines:
            if not wait_healthy(f"{url}/health", engine, deadline):
                outcome.problem = f"engine {node} did not start\n{log_tails(logs, 6)}"
                return outcome
        router = stack.enter_context(Router.connect(address))
        while time.monotonic() < deadline:
            with contextlib.suppress(SystemExit):
                ctl(admin, token_file, CANARY)
                break
            time.sleep(0.2)
        wanted = {node for node, _, _ in engines}
        while {n.node_id for n in llm_nodes(router.table)} != wanted or not has_arms(router.table, CANARY):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                outcome.problem = f"no routing table with every node and the canary\n{log_tails(logs, 6)}"
                return outcome
            time.sleep(0.1)
        asyncio.run(drive(router, outcome, scale, seed, admin, token_file))
        texts = [httpx.get(f"{url}/metrics", timeout=5.0).text for _, url, _ in engines]
    outcome.writes = histogram(texts, "prism_engine_snapshot_write_seconds")
    outcome.loads = histogram(texts, "prism_engine_context_load_seconds")
    outcome.outcomes = by_label(texts, "prism_engine_context_requests_total", "outcome")
    outcome.store_errors = by_label(texts, "prism_engine_snapshot_store_errors_total", "kind")
    outcome.write_failures = sum(by_label(texts, "prism_engine_snapshot_write_failures_total", "").values())
    return outcome


def store_alone(path: Path, tokens: int, count: int = 500) -> list[str]:
    """The directory store by itself, in this process, once the clusters are stopped: `count` sessions' snapshots
    of a `tokens`-token context written, then read, each timed; what the engines' times add to it is contention."""
    store = DirectorySnapshotStore(path)
    blocks = tuple(range(tokens // BLOCK_SIZE_TOKENS))
    writes, loads = [], []
    for i in range(count):
        name = f"session-{i}"
        snapshot = SessionSnapshot(
            session=name,
            context_hash=context_hash(name, blocks, tokens),
            last_active_unix_s=time.time(),
            token_offset=tokens,
            blocks=blocks,
        )
        started = time.perf_counter()
        store.save(snapshot)
        writes.append(time.perf_counter() - started)
    for i in range(count):
        started = time.perf_counter()
        store.load(f"session-{i}")
        loads.append(time.perf_counter() - started)
    return [
        f"== the store alone (in {path.parent.parent}: {count} snapshots of a {tokens}-token context, "
        f"{len(blocks)} blocks): write p50 {ms(percentile(writes, 0.5), 2)}, p95 {ms(percentile(writes, 0.95), 2)}; "
        f"load p50 {ms(percentile(loads, 0.5), 2)}, p95 {ms(percentile(loads, 0.95), 2)}"
    ]


def ms(seconds: float | None, digits: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f} ms"


def within(buckets: Sequence[tuple[float, float]], bound: float) -> str:
    """The share of observations at or under `bound` (a bucket bound: exact)."""
    total = buckets[-1][1] if buckets else 0.0
    under = next((count for le, count in buckets if abs(le - bound) < 1e-12), None)
    return "-" if not total or under is None else f"{under / total:.1%}"


def latency_line(name: str, buckets: Sequence[tuple[float, float]], target: float) -> str:
    count = int(buckets[-1][1]) if buckets else 0
    if not count:
        return f"{name}: none"
    p50, p95 = histogram_quantile(0.5, buckets), histogram_quantile(0.95, buckets)
    return (
        f"{name}: {count}, p50 {ms(p50)}, p95 {ms(p95)} (target {target * 1000:g} ms: "
        f"{'met' if p95 is not None and p95 <= target else 'missed'}, {within(buckets, target)} within it)"
    )


def report(outcome: Outcome, scale: Scale) -> list[str]:
    """The variant's summary lines."""
    if outcome.problem:
        return [f"== {outcome.variant}: did not run: {outcome.problem}"]
    turns = outcome.turns
    answered = [t for t in turns if t.error is None]
    moved = outcome.moved()
    across = outcome.across_switch()
    sessions_v2 = {t.session for t in answered if t.version == "v2"}
    lines = [
        f"== {outcome.variant}: {scale.sessions} sessions on {scale.engines} + {scale.engines} {GPU} engines "
        f"(v1 + v2), switch after {scale.before_s:g} s, {scale.before_s + scale.after_s:g} s of load",
        f"   requests: {len(turns)} sent, {len(answered)} answered, {len(outcome.lost)} lost, "
        f"{len(outcome.broken)} streams broken; {len(across)} in flight across the switch, "
        f"{sum(1 for t in across if t.error is None)} of them finished",
        f"   switch: prism ctl at {outcome.switch_sent_s or 0:.2f} s, seen in the router's table at "
        f"{outcome.switch_applied_s or 0:.2f} s; sessions moved v1 → v2: {len(moved)}, on v2 from the canary: "
        f"{len(sessions_v2) - len(moved)}, of {scale.sessions}",
    ]
    for name, group in (("moved sessions' first request on v2", moved), ("their later turns on v2", outcome.settled())):
        ttfts = [t.ttft_s for t in group if t.ttft_s is not None]
        prompt = sum(t.prompt_tokens for t in group)
        cached = sum(t.cached_tokens for t in group)
        share = f"{cached / prompt:.1%}" if prompt else "-"
        lines.append(
            f"   {name}: {len(group)}, TTFT p50 {ms(percentile(ttfts, 0.5))}, p95 {ms(percentile(ttfts, 0.95))}; "
            f"cached {share} of {prompt} prompt tokens"
        )
    lines.append("   " + latency_line("snapshot writes", outcome.writes, WRITE_TARGET_S))
    lines.append("   " + latency_line("context loads", outcome.loads, LOAD_TARGET_S))
    signed = ", ".join(f"{k} {v}" for k, v in sorted(outcome.outcomes.items()) if v) or "none"
    errors = ", ".join(f"{k} {v}" for k, v in sorted(outcome.store_errors.items())) or "none"
    lines.append(
        f"   requests with a signature, by context outcome: {signed}; store errors: {errors}; "
        f"writes refused: {outcome.write_failures}"
    )
    for turn in outcome.lost[:5]:
        lines.append(f"   lost: session {turn.session} turn {turn.index} at {turn.sent_s:.2f} s: {turn.error}")
    return lines


def comparison(outcomes: Sequence[Outcome]) -> list[str]:
    """The moved sessions' first request on v2 in each variant, side by side."""
    ran = [o for o in outcomes if not o.problem]
    if len(ran) < 2:
        return []
    head = "| moved sessions' first request on v2 | " + " | ".join(o.variant for o in ran) + " |"
    rows = [head, "|" + "---|" * (len(ran) + 1)]

    def row(name: str, value: Callable[[Outcome], str]) -> None:
        rows.append(f"| {name} | " + " | ".join(value(o) for o in ran) + " |")

    def ttft(turns: Sequence[Turn], q: float) -> str:
        return ms(percentile([t.ttft_s for t in turns if t.ttft_s is not None], q))

    def cached(o: Outcome) -> str:
        moved = o.moved()
        prompt = sum(t.prompt_tokens for t in moved)
        return f"{sum(t.cached_tokens for t in moved) / prompt:.1%}" if prompt else "-"

    row("sessions moved", lambda o: str(len(o.moved())))
    row("TTFT p50", lambda o: ttft(o.moved(), 0.5))
    row("TTFT p95", lambda o: ttft(o.moved(), 0.95))
    row("prompt tokens cached", cached)
    row("their later turns on v2: TTFT p50", lambda o: ttft(o.settled(), 0.5))
    row("requests lost", lambda o: str(len(o.lost)))
    row("streams broken", lambda o: str(len(o.broken)))
    return rows


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> list[Outcome]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 + 1 engines, 8 sessions, 3 s before and after")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variant", choices=VARIANTS, action="append", help="run only this variant (repeatable)")
    args = parser.parse_args(argv)
    scale = SCALES["quick" if args.quick else "full"]
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="prism-version-switch-") as tmp, signals_interrupt():
        for variant in args.variant or VARIANTS:
            outcome = run(variant, scale, args.seed, Path(tmp) / variant)
            outcomes.append(outcome)
            for line in report(outcome, scale):
                out(line)
        moved = [t.prompt_tokens for o in outcomes for t in o.moved()]
        for line in store_alone(Path(tmp) / "store-alone", sum(moved) // len(moved) if moved else scale.doc_tokens):
            out(line)
    for line in comparison(outcomes):
        out(line)
    return outcomes


if __name__ == "__main__":
    main()
