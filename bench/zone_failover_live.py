"""A zone outage on the real path: live processes in two zones, routers in each zone, one zone's hosts killed.

Run: .venv/bin/python bench/zone_failover_live.py [--quick] [--model FILE] [--seed 1]

Each variant starts a fresh cluster on loopback with `prismlb.demo`'s process helpers: a brain (`prism brain`,
with `--failover-model FILE` in the student variant), A100 emulated engines (`python -m prismlb.demo._engine`;
`--model-version` set to the engine's zone, so an answer's `X-Emulated-Model-Version` header names the zone that
served it) and an agent per engine (`prism agent --zone a|b --period 1`, no eBPF), two per zone. In this process:
one router per zone (`Router.connect`, `Settings(zone=...)`; zone-blind: no zone) under `AsyncPrismTransport`,
each sending RATE requests a second (open loop, short distinct prompts, not streamed).

After a warm-up, a steady phase measures the cross-zone share (answers served in another zone than their
caller's); then zone a's engines and agents are killed (SIGKILL: the hosts are gone) and both routers go on.
Reported per variant: cross-zone share before the outage, requests failed after it (a refused connection is
retried once on another endpoint, `Settings.connect_tries`; a request fails when both attempts do), the last
failure's time after the kill (recovery: every request after it was answered), when zone a's callers' row of the
split first sent nothing to zone a (the brain's reaction, read from the router's table), and the answers' P50/P99
before and after. Variants: `rule` (the brain's default split), `zone-blind` (routers without a zone: the ring
over every node, as before zone splits existed), and `student` when `--model` names a trained student
(`prism train failover`). Results: docs/failover.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from prismlb.demo import free_port, percentile, signals_interrupt, spawn, stop
from prismlb.router import AsyncPrismTransport, Router, Settings
from prismlb.sim._engine import MODEL_NAME
from prismlb.wire import BrainAddress, RoutingTable

ZONES = ("a", "b")
FAILED_ZONE = "a"
GPU = "a100"
RATE = 6.0
"""Requests a second from each zone's router."""
START_LIMIT_S = 40.0


@dataclass(frozen=True)
class Phases:
    engines: int  # per zone
    warm_s: float
    steady_s: float
    after_s: float


FULL = Phases(engines=2, warm_s=5.0, steady_s=10.0, after_s=12.0)
QUICK = Phases(engines=1, warm_s=3.0, steady_s=5.0, after_s=6.0)


@dataclass
class Answer:
    """One request of the load and how it ended."""

    caller: str
    """The zone it was sent from."""
    sent_s: float
    """Since the kill (negative before it)."""
    served: str | None = None
    """The zone that answered; None: failed."""
    latency_s: float = 0.0


@dataclass
class Outcome:
    """One variant's run."""

    variant: str
    answers: list[Answer] = field(default_factory=list)
    split_moved_s: float | None = None
    """When zone a's callers' row first gave zone a nothing, after the kill."""
    problem: str | None = None
    """Why the variant's load never ran (its routers never had a full table in time); its row says only this."""


def table_ready(table: RoutingTable | None, nodes: int, zoned: bool) -> bool:
    if table is None or sum(len(s.nodes) for s in table.slices if s.name == "llm") != nodes:
        return False
    return not zoned or {row.caller for row in table.zones} == set(ZONES)


def left_zone(table: RoutingTable | None) -> bool:
    """Zone a's callers' row gives zone a nothing."""
    if table is None:
        return False
    row = next((r for r in table.zones if r.caller == FAILED_ZONE), None)
    return row is not None and all(s.zone != FAILED_ZONE for s in row.shares)


async def caller(
    router: Router, zone: str, rng: random.Random, kill_at: float, stop_at: float, out: list[Answer]
) -> None:
    """Open-loop requests at RATE per second until `stop_at` (monotonic), each recorded in `out`."""
    pending: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(
        transport=AsyncPrismTransport(router), base_url="http://prism", timeout=10.0
    ) as client:

        async def one(number: int) -> None:
            started = time.monotonic()
            answer = Answer(zone, started - kill_at)
            out.append(answer)
            payload = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": f"{zone}-{number}-{rng.random():.12f} tell me"}],
                "max_tokens": 4,
            }
            with contextlib.suppress(httpx.HTTPError):
                response = await client.post("/v1/chat/completions", json=payload)
                if response.status_code == 200:
                    answer.served = response.headers.get("X-Emulated-Model-Version", "?")
            answer.latency_s = time.monotonic() - started

        number = 0
        next_at = time.monotonic()
        while next_at < stop_at:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            task = asyncio.create_task(one(number))
            pending.add(task)
            task.add_done_callback(pending.discard)
            number += 1
            next_at += rng.expovariate(RATE)
        await asyncio.gather(*pending)


def run(variant: str, phases: Phases, model: Path | None, seed: int, logs: Path) -> Outcome:
    """One variant on a fresh cluster; every process it started is stopped before it returns."""
    outcome = Outcome(variant)
    logs.mkdir(parents=True)
    ingest = f"tcp://127.0.0.1:{free_port()}"
    address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    procs: list[subprocess.Popen[bytes]] = []
    doomed: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        stack.callback(stop, procs)
        brain = [
            *("-m", "prismlb.cli", "brain", "--ingest", ingest, "--updates", address.updates),
            *("--snapshot", address.snapshot, "--metrics-port", "0", "--admin-port", "0", "--holddown-s", "0"),
            *(("--failover-model", str(model)) if variant == "student" and model is not None else ()),
        ]
        procs.append(spawn(brain, logs / "brain.log"))
        urls: list[str] = []
        for zone in ZONES:
            for i in range(phases.engines):
                node, port, kv = f"{zone}-{i + 1}", free_port(), f"tcp://127.0.0.1:{free_port()}"
                url = f"http://127.0.0.1:{port}"
                args = ["-m", "prismlb.demo._engine", "--gpu", GPU, "--port", str(port), "--kv-events", kv]
                engine = spawn([*args, "--model-version", zone], logs / f"engine-{node}.log")
                agent = spawn(
                    [
                        *("-m", "prismlb.cli", "agent", "--node-id", node, "--brain", ingest, "--endpoint", url),
                        *("--engine-url", f"{url}/metrics", "--kv-events", kv, "--zone", zone),
                        *("--otlp-grpc-port", str(free_port()), "--otlp-http-port", "0"),
                        *("--metrics-port", "0", "--period", "1", "--no-ebpf"),
                    ],
                    logs / f"agent-{node}.log",
                )
                procs[:0] = [agent, engine]
                urls.append(url)
                if zone == FAILED_ZONE:
                    doomed += [engine, agent]
        zoned = variant != "zone-blind"
        routers = {
            zone: stack.enter_context(Router.connect(address, settings=Settings(zone=zone if zoned else "")))
            for zone in ZONES
        }
        deadline = time.monotonic() + START_LIMIT_S
        while not all(table_ready(r.table, len(urls), zoned) for r in routers.values()):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                outcome.problem = f"no table with every node{' and both zones' if zoned else ''} in time ({logs})"
                return outcome
            time.sleep(0.1)
        rng = random.Random(seed)
        start = time.monotonic()
        kill_at = start + phases.warm_s + phases.steady_s
        stop_at = kill_at + phases.after_s

        def watch() -> None:
            """Kill zone a's hosts at `kill_at`, then note when the table's split leaves zone a."""
            time.sleep(max(0.0, kill_at - time.monotonic()))
            for proc in doomed:
                proc.kill()
            while time.monotonic() < stop_at and outcome.split_moved_s is None:
                if left_zone(routers[FAILED_ZONE].table):
                    outcome.split_moved_s = time.monotonic() - kill_at
                time.sleep(0.02)

        async def drive() -> None:
            watcher = asyncio.get_running_loop().run_in_executor(None, watch)
            await asyncio.gather(
                *(
                    caller(r, zone, random.Random(rng.random()), kill_at, stop_at, outcome.answers)
                    for zone, r in routers.items()
                )
            )
            await watcher

        asyncio.run(drive())
        outcome.answers = [a for a in outcome.answers if a.sent_s >= -phases.steady_s]
    return outcome


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def report(outcomes: Sequence[Outcome]) -> list[str]:
    lines = [
        "| variant | requests | cross-zone before | failed after kill | last failure after kill s "
        "| split left zone a s | P50 ms before | P99 ms before | P50 ms after | P99 ms after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for outcome in outcomes:
        if outcome.problem:
            lines.append(f"| {outcome.variant} | {outcome.problem} |")
            continue
        before = [a for a in outcome.answers if a.sent_s < 0 and a.served is not None]
        after = [a for a in outcome.answers if a.sent_s >= 0]
        failed = [a for a in after if a.served is None]
        crossed = sum(a.served != a.caller for a in before)
        last = max((a.sent_s for a in failed), default=None)
        ok_before = [a.latency_s for a in before]
        ok_after = [a.latency_s for a in after if a.served is not None]
        lines.append(
            f"| {outcome.variant} | {len(outcome.answers)} | {crossed / max(1, len(before)):.1%} | "
            f"{len(failed)} of {len(after)} | {'-' if last is None else f'{last:.2f}'} | "
            f"{'-' if outcome.split_moved_s is None else f'{outcome.split_moved_s:.2f}'} | "
            f"{ms(percentile(ok_before, 0.5))} | {ms(percentile(ok_before, 0.99))} | "
            f"{ms(percentile(ok_after, 0.5))} | {ms(percentile(ok_after, 0.99))} |"
        )
    return lines


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> list[Outcome]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one engine per zone, shorter phases")
    parser.add_argument("--model", type=Path, default=None, help="a trained failover student: adds its variant")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.model is not None and not args.model.is_file():
        parser.error(f"--model {args.model}: no such file (make one with prism train failover --out FILE)")
    phases = QUICK if args.quick else FULL
    variants = ["rule", "zone-blind", *(["student"] if args.model is not None else [])]
    outcomes = []
    with signals_interrupt(), tempfile.TemporaryDirectory(prefix="prism-zone-failover-") as tmp:
        for variant in variants:
            outcomes.append(run(variant, phases, args.model, args.seed, Path(tmp) / variant))
    out(
        f"zone outage on loopback: {phases.engines} A100 engine(s) per zone, zones {', '.join(ZONES)}, "
        f"{RATE:g} req/s from each zone's router, zone {FAILED_ZONE} killed after {phases.warm_s + phases.steady_s:g} s"
    )
    for line in report(outcomes):
        out(line)
    return outcomes


if __name__ == "__main__":
    sys.exit(0 if all(o.problem is None for o in main()) else 1)
