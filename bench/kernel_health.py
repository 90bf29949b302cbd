"""Live ablation of the kernel health signal: does down-weighting a lossy node earn its keep in client latency?

Run: .venv/bin/python bench/kernel_health.py   (about 2.2 minutes; root, bcc, iproute2 and nftables)

The cluster, for real: N nodes (`--nodes`, 3), each in its own network namespace joined to this one by a veth
pair (`tests/_netns.py`, as tests/test_kernel_health.py), each serving the repo's emulated engine
(`sim/_engine.py`: an OpenAI-compatible server whose timing follows an A100 model; it generates placeholder
tokens, no GPU is involved) on port 8000, and each measured by its own `prism agent` process (the eBPF
connection tracer on the engine's port 8000 and pid; the engine's `/metrics` scraped every `--period` on a
second port of the same engine, 8001, since on a real host the agent scrapes its engine locally, where no link
loss reaches). The brain runs in this process, so that the ablation can be a `Brain` subclass, and publishes its
tables over ZeroMQ; the client is an httpx client through `AsyncPrismTransport` on a real `Router.connect`, in
this namespace, with the library's default settings. It sends `--rate` non-streamed chat completions a second
at fixed intervals (open loop), each prompt distinct (no prefix shared: placement is the router's expected time
to first token, in which a weight w stretches a node's expected time by 1/w; `--placement ring` turns the prefix
index off so that requests take the weighted ring by their keys), and times each to the end of its response.
Non-streamed, because the emulated engine closes a streamed response's connection, while a router's pool keeps
its connections to a real engine alive.

Phases of each run: `--warmup` healthy seconds, then nftables drops `--drop` percent of the packets on one side
of node-1's link for `--loss` seconds, then `--recovery` healthy seconds. `--direction to-node` (the default, as
in the test): in node-1's namespace, what arrives at its port 8000 (requests, handshakes, the client's ACKs);
`from-node`: in this namespace, what arrives from its port 8000 (responses). Either way the loss is in what
arrives, as on a bad link (a drop on a host's own output is not a retransmission to its TCP, see the test).

Variants, one run each on the same nodes and agents, with the same request schedule (seeded), each with a fresh
brain and router: `full` (the library's `Brain`: weights of health alone), `no-health` (`sim._ablations.NoHealthBrain`:
every node weighed as perfectly healthy, so every weight is 1.0 as `flat`'s, since the library weighs no latency
unless `BrainConfig.latency_weights`) and, when `--variants` names them, `no-stall`
(`NoStallBrain`: no network stall published, so the router adds none to the lossy node's expected time),
`no-client-stall` (the library's brain, and the router with `Settings(client_stall=False)`: it adds no stall of its
own connections' retransmits, which is all that sees the loss toward a node) and `flat` (`FlatWeightsBrain`: every
weight 1.0). `--rounds` repeats the sequence, the variants alternating.

Printed: per run, for the requests sent in the loss window, client latency p50/p99/max/mean, how many took over
`--slow-ms` (or failed), node-1's share of them, its published weight (lowest, and at the window's end), the
highest network stall published for it and the highest its router's own connections forecast, its retransmits per
connection as the brain saw them (and how many of its vectors raised that alarm) and the packets
the rule dropped; the warm-up's p50/p99 and share for reference; the ratios between variants (every round
pooled); node-1's weight and share every 5 s of the window. Every namespace, nftables table and process is
removed on every exit path: an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import logging
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from prismlb.brain import Brain, BrainConfig
from prismlb.demo import free_port, percentile, signals_interrupt, spawn, stop
from prismlb.router import AsyncPrismTransport, Router, Settings
from prismlb.semantics import Slice
from prismlb.sim._ablations import FlatWeightsBrain, NoHealthBrain, NoStallBrain
from prismlb.wire import BrainAddress, RoutingTable, TableNode

PORT = 8000
METRICS_PORT = 8001
"""The same engine's second port, which its agent scrapes: on a real host the agent scrapes its engine locally,
so the loss on the link to the client must not reach the scrapes."""
NFT_TABLE = "prism_kernel_health_bench"
REQUEST_TIMEOUT_S = 10.0
STARTUP_LIMIT_S = 120.0
"""The agents' first vectors with TCP health, and the first table with every node (bcc compiles each agent's
program at its start: tens of seconds on a busy 2-core machine)."""
TABLE_LIMIT_S = 20.0
DRAIN_LIMIT_S = 10.0
SAMPLE_S = 0.5
STEP_S = 5.0
"""The timeline's step: the lossy node's weight and share every this many seconds of the loss window."""
RETRANSMIT_ALARM = "tcp_retransmits_per_conn"


@dataclass(frozen=True)
class Variant:
    """What a variant changes: the brain's class, and whether the router adds its own connections' stall."""

    brain: type[Brain]
    client_stall: bool = True
    """`Settings.client_stall`: the stall forecast by the segments the router's connections to a node retransmitted
    (the caller's `TCP_INFO`), the loss toward the node that its agent does not see."""


VARIANTS: dict[str, Variant] = {
    "full": Variant(Brain),
    "no-health": Variant(NoHealthBrain),
    "no-stall": Variant(NoStallBrain),
    "no-client-stall": Variant(Brain, client_stall=False),
    "flat": Variant(FlatWeightsBrain),
}
_WORDS = (
    "the model cache token prefix route node weight batch decode prefill latency tail span trace agent brain "
    "kernel table ring slice key block memory queue stream answer question context system user assistant"
).split()

_ENGINE = """
import signal, sys, threading
from http.server import ThreadingHTTPServer
from prismlb.sim._engine import EmulatedEngine

stopped = threading.Event()
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stopped.set())
engine = EmulatedEngine(sys.argv[3], host=sys.argv[1], port=int(sys.argv[2]), time_scale=float(sys.argv[4]))
engine.start()
# The same engine on a second port, for its agent's scrapes (a private attribute: the engine has one server).
metrics = ThreadingHTTPServer((sys.argv[1], int(sys.argv[5])), engine._server.RequestHandlerClass)
metrics.daemon_threads = True
threading.Thread(target=metrics.serve_forever, daemon=True).start()
print(f"emulated {sys.argv[3]} engine on {engine.url}, its metrics also on port {sys.argv[5]}", flush=True)
stopped.wait()
engine.close()
"""


@functools.cache
def _netns() -> ModuleType:
    """tests/_netns.py, the namespaces and veth pairs of the kernel health test (a file, not a package)."""
    path = Path(__file__).resolve().parent.parent / "tests" / "_netns.py"
    spec = importlib.util.spec_from_file_location("prism_bench_netns", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DIRECTIONS = ("to-node", "from-node")


def loss_table(drop_percent: float, direction: str, node_address: str) -> tuple[str, str]:
    """(name, nftables text) of the table that drops `drop_percent` of the packets on one side of the link between
    a node's server port and the client: "to-node", in the node's namespace, what arrives at that port; "from-node",
    in this namespace, what arrives from it. Either way the loss is in what arrives, as on a bad link."""
    if direction == "to-node":
        name, match = NFT_TABLE, f"tcp dport {PORT}"
    else:
        name, match = f"{NFT_TABLE}_{os.getpid()}", f"ip saddr {node_address} tcp sport {PORT}"
    share = round(drop_percent * 100)
    if share < 10_000:
        match += f" numgen random mod 10000 < {share}"
    text = f"""
table inet {name} {{
    chain input {{
        type filter hook input priority 0; policy accept;
        {match} counter drop
    }}
}}
"""
    return name, text


def missing_tools() -> str | None:
    """Why this machine cannot run the bench, or None."""
    if os.geteuid() != 0:
        return f"root is needed (namespaces, nftables, eBPF); running as uid {os.geteuid()}"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, nftables)"
    try:
        importlib.import_module("bcc")
    except (ImportError, OSError) as exc:
        return f"bcc is not importable ({exc}); apt-get install python3-bpfcc"
    if not os.path.exists("/sys/kernel/tracing/events/syscalls/sys_enter_connect"):
        return "tracefs is not mounted (make test's set-up mounts it as root)"
    return None


# --- the workload -----------------------------------------------------------------------------------------


def schedule(rate: float, duration_s: float, prompt_tokens: int, seed: int) -> list[tuple[float, str]]:
    """(send offset in seconds, prompt) at fixed intervals; each prompt distinct from its first words on, the same
    for the same arguments (every variant gets the same requests)."""
    rng = random.Random(seed)
    out = []
    for i in range(int(rate * duration_s)):
        words = [f"request {seed}-{i}:"]
        size = len(words[0])
        while size < prompt_tokens * 4:  # the emulated tokenizer: 4 characters a token
            words.append(rng.choice(_WORDS))
            size += len(words[-1]) + 1
        out.append((i / rate, " ".join(words)))
    return out


@dataclass
class Result:
    sent_s: float
    """Seconds from the run's start."""
    end_s: float
    node: str | None = None
    error: str | None = None

    @property
    def latency_ms(self) -> float:
        return (self.end_s - self.sent_s) * 1000


@dataclass
class Sample:
    """What the bench saw at one time of a run: the router's weights, and the lossy node's latest vector."""

    at_s: float
    weights: dict[str, float]
    stalls: dict[str, float] = field(default_factory=dict)
    """Each node's network stall in the router's table, ms (absent: none published)."""
    retransmits_per_conn: float | None = None
    alarms: tuple[str, ...] = ()
    seq: int = -1
    client_stalls: dict[str, float] = field(default_factory=dict)
    """Each node's network stall from the router's own connections' retransmits, ms (`EndpointStatus.stall_s`)."""


@dataclass
class Run:
    variant: str
    round: int
    lossy: str
    results: list[Result] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    loss_start_s: float = math.nan
    loss_end_s: float = math.nan
    unfinished: int = 0
    dropped: int | None = None
    """Packets the loss rule dropped."""
    problem: str | None = None

    def sent_in(self, start_s: float, end_s: float) -> list[Result]:
        return [r for r in self.results if start_s <= r.sent_s < end_s]

    def loss_window(self) -> list[Result]:
        return self.sent_in(self.loss_start_s, self.loss_end_s)

    def warmup(self) -> list[Result]:
        return self.sent_in(0.0, self.loss_start_s)

    def weight_at(self, at_s: float) -> float | None:
        """The lossy node's weight in the router's last table sampled at or before `at_s`."""
        before = [s for s in self.samples if s.at_s <= at_s and self.lossy in s.weights]
        return before[-1].weights[self.lossy] if before else None

    def lossy_vectors(self, start_s: float, end_s: float) -> list[Sample]:
        """One sample per vector of the lossy node's received in [start_s, end_s)."""
        seen: set[int] = set()
        out = []
        for s in self.samples:
            if start_s <= s.at_s < end_s and s.seq >= 0 and s.seq not in seen:
                seen.add(s.seq)
                out.append(s)
        return out


@dataclass(frozen=True)
class Stats:
    count: int
    errors: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    mean_ms: float | None
    lossy_share: float | None
    slow: int
    """Requests answered in more than the `slow_ms` given, or not at all."""
    slow_lossy: int
    """Of those, the ones placed on the lossy node."""


def stats(results: Sequence[Result], lossy: str, slow_ms: float = math.inf) -> Stats:
    ok = [r.latency_ms for r in results if r.error is None]
    slow = [r for r in results if r.error is not None or r.latency_ms > slow_ms]
    placed = [r for r in results if r.node is not None]
    share = sum(r.node == lossy for r in placed) / len(placed) if placed else None
    return Stats(
        len(results),
        len(results) - len(ok),
        percentile(ok, 0.5),
        percentile(ok, 0.99),
        max(ok) if ok else None,
        statistics.fmean(ok) if ok else None,
        share,
        len(slow),
        sum(r.node == lossy for r in slow),
    )


# --- the cluster ------------------------------------------------------------------------------------------


@dataclass
class Node:
    name: str
    ns: Any  # tests/_netns.Namespace
    engine: subprocess.Popen[bytes]
    agent: subprocess.Popen[bytes] | None = None


class _Tagging(httpx.AsyncBaseTransport):
    """The transport under the router's: notes which node (by address) each forwarded request went to."""

    def __init__(self, inner: httpx.AsyncBaseTransport, by_host: dict[str, str]) -> None:
        self._inner = inner
        self._by_host = by_host

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        response.extensions["prism_bench_node"] = self._by_host.get(request.url.host)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _die_with_parent() -> None:
    """In the child: SIGTERM when this process dies, however it dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def start_engines(stack: contextlib.ExitStack, count: int, gpu: str, time_scale: float, logs: Path) -> list[Node]:
    """`count` namespaces, each with an emulated engine serving on PORT and METRICS_PORT; the engines are killed
    and the namespaces (with any nftables table in them) deleted when `stack` closes."""
    netns = _netns()
    nodes = []
    for i in range(count):
        ns = stack.enter_context(netns.host_veth())
        with (logs / f"engine-{i + 1}.log").open("wb") as out:
            engine = ns.popen(
                [sys.executable, "-c", _ENGINE, ns.address, str(PORT), gpu, repr(time_scale), str(METRICS_PORT)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches this process only, which stops the children
                preexec_fn=_die_with_parent,
            )
        nodes.append(Node(f"node-{i + 1}", ns, engine))
    for node in nodes:
        netns.wait_listening(node.ns.address, PORT, 30.0, node.engine)
    return nodes


def start_agents(stack: contextlib.ExitStack, nodes: Sequence[Node], ingest: str, period_s: float, logs: Path) -> None:
    """A `prism agent` process per node in this namespace (as the kernel health test runs them: the eBPF program
    sees every namespace), tracing the engine's PORT and pid and reporting to `ingest`; stopped when `stack`
    closes (before the engines, when they were started on the same stack before)."""
    agents: list[subprocess.Popen[bytes]] = []
    stack.callback(stop, agents)
    for node in nodes:
        url = f"http://{node.ns.address}:{PORT}"
        argv = [
            "-m", "prismlb.cli", "agent", "--node-id", node.name, "--host", node.name, "--endpoint", url,
            "--engine-url", f"http://{node.ns.address}:{METRICS_PORT}/metrics",
            "--brain", ingest, "--period", repr(period_s),
            "--otlp-grpc-port", "0", "--otlp-http-port", "0",
            "--trace-port", str(PORT), "--trace-pid", str(node.engine.pid),
        ]  # fmt: skip
        node.agent = spawn(argv, logs / f"agent-{node.name}.log")
        agents.append(node.agent)


class Loss:
    """The loss rule on one side of a node's link (`loss_table`): `apply`, `remove` (idempotent, also after a
    failure); `dropped` is the rule's packet counter, read before its removal."""

    def __init__(self, node: Node, drop_percent: float, direction: str) -> None:
        self.name, self.text = loss_table(drop_percent, direction, node.ns.address)
        self.run = node.ns.run if direction == "to-node" else _netns()._run
        self.applied = False
        self.dropped: int | None = None

    def apply(self) -> None:
        self.applied = True
        self.run(["nft", "-f", "-"], stdin=self.text)

    def remove(self) -> None:
        if self.applied:
            self.applied = False
            with contextlib.suppress(RuntimeError, ValueError):
                listed = self.run(["nft", "list", "table", "inet", self.name])
                self.dropped = int(listed.split("counter packets ")[1].split()[0])
            with contextlib.suppress(RuntimeError):
                self.run(["nft", "delete", "table", "inet", self.name])


# --- one run ----------------------------------------------------------------------------------------------


def _llm_nodes(table: RoutingTable | None) -> list[TableNode]:
    if table is None:
        return []
    return next((slice_.nodes for slice_ in table.slices if slice_.name == Slice.LLM.value), [])


def _llm_weights(table: RoutingTable | None) -> dict[str, float]:
    return {node.node_id: node.weight for node in _llm_nodes(table)}


def _llm_stalls(table: RoutingTable | None) -> dict[str, float]:
    return {node.node_id: node.stall_ms for node in _llm_nodes(table) if node.stall_ms is not None}


def _lossy_vector(brain: Brain, lossy: str) -> tuple[float | None, tuple[str, ...], int]:
    """The lossy node's latest vector in the brain: retransmits per connection, the brain's alarms on it, seq (-1
    if none)."""
    state = brain.registry.nodes.get(lossy)
    if state is None:
        return None, (), -1
    vector = state.vector
    return vector.metrics.tcp_retransmits_per_conn, state.health.alarms, vector.seq


def _tcp_measured(brain: Brain, node: str) -> bool:
    """Whether the node's latest vector has the kernel's TCP rates (absent without eBPF, never 0)."""
    state = brain.registry.nodes.get(node)
    return state is not None and state.vector.metrics.tcp_resets_per_s is not None


@dataclass(frozen=True)
class Plan:
    warmup_s: float
    loss_s: float
    recovery_s: float
    drop_percent: float
    direction: str
    requests: list[tuple[float, str]]
    max_tokens: int
    settings: Settings


async def _one(client: httpx.AsyncClient, run: Run, start: float, prompt: str, max_tokens: int) -> None:
    payload = {
        "model": "prism-emulated-8b",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
    }
    sent = time.monotonic() - start
    result = Result(sent, sent)
    try:
        response = await client.post("/v1/chat/completions", json=payload)
        result.node = response.extensions.get("prism_bench_node")
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}")
    except asyncio.CancelledError:
        result.error = "unfinished at the time bound"
        raise
    except Exception as exc:  # httpx errors, HTTP status, NoRouteError: all are the request's result
        result.error = type(exc).__name__
    finally:
        result.end_s = time.monotonic() - start
        run.results.append(result)


async def _watch(run: Run, router: Router, brain: Brain, start: float) -> None:
    while True:
        retransmits, alarms, seq = _lossy_vector(brain, run.lossy)
        table = router.table
        own = {label: 1000 * status.stall_s for label, status in router.status().items()}
        stalls = _llm_stalls(table)
        run.samples.append(Sample(time.monotonic() - start, _llm_weights(table), stalls, retransmits, alarms, seq, own))
        await asyncio.sleep(SAMPLE_S)


async def _phases(run: Run, loss: Loss, plan: Plan, start: float) -> None:
    await asyncio.sleep(max(0.0, start + plan.warmup_s - time.monotonic()))
    run.loss_start_s = time.monotonic() - start
    await asyncio.to_thread(loss.apply)
    await asyncio.sleep(max(0.0, start + plan.warmup_s + plan.loss_s - time.monotonic()))
    run.loss_end_s = time.monotonic() - start
    await asyncio.to_thread(loss.remove)


async def _drive(run: Run, router: Router, brain: Brain, nodes: Sequence[Node], loss: Loss, plan: Plan) -> None:
    """The plan's requests at their times through the router, while the phases switch the loss on and off."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    inner = _Tagging(httpx.AsyncHTTPTransport(limits=limits), {n.ns.address: n.name for n in nodes})
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=3.0)
    transport = AsyncPrismTransport(router, transport=inner)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://prism", timeout=timeout) as client:
        start = time.monotonic()
        watch = asyncio.create_task(_watch(run, router, brain, start))
        phases = asyncio.create_task(_phases(run, loss, plan, start))
        tasks: set[asyncio.Task[None]] = set()
        try:
            for offset, prompt in plan.requests:
                delay = start + offset - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(_one(client, run, start, prompt, plan.max_tokens))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await phases
            if tasks:
                _, pending = await asyncio.wait(set(tasks), timeout=DRAIN_LIMIT_S)
                run.unfinished = len(pending)
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=2.0)
            await asyncio.sleep(SAMPLE_S)  # one more sample of the weights after the recovery
        finally:
            for task in (watch, phases, *tasks):
                task.cancel()
            await asyncio.gather(watch, phases, *tasks, return_exceptions=True)


def run_variant(
    variant: str, round_: int, nodes: Sequence[Node], ingest: str, plan: Plan, limit_s: float, log: logging.Logger
) -> Run:
    """One run with a fresh brain of the variant's class (bound to the agents' `ingest`) and a fresh router;
    the brain, the router and the loss rule are gone when it returns."""
    lossy = nodes[0]
    run = Run(variant, round_, lossy.name)
    config = BrainConfig(
        ingest=ingest,
        updates=f"tcp://127.0.0.1:{free_port()}",
        snapshot=f"tcp://127.0.0.1:{free_port()}",
        holddown_s=0.0,
        train_budget_s=0.0,
        admin_port=0,
    )
    brain = VARIANTS[variant].brain(config, CollectorRegistry())
    settings = replace(plan.settings, client_stall=VARIANTS[variant].client_stall)
    stopped = threading.Event()
    thread = threading.Thread(target=brain.run, args=(stopped,), name=f"brain-{variant}", daemon=True)
    loss = Loss(lossy, plan.drop_percent, plan.direction)
    thread.start()
    try:
        with Router.connect(BrainAddress(config.updates, config.snapshot), settings=settings) as router:
            wanted = {n.name for n in nodes}
            deadline = time.monotonic() + limit_s
            while set(_llm_weights(router.table)) != wanted:
                failed = [n.name for n in nodes if n.agent is not None and n.agent.poll() is not None]
                if failed or time.monotonic() > deadline:
                    run.problem = (
                        f"no table with every node ({'agents exited: ' + ', '.join(failed) if failed else 'timed out'})"
                    )
                    return run
                time.sleep(0.1)
            while not all(_tcp_measured(brain, n.name) for n in nodes):  # eBPF loaded in every agent
                if time.monotonic() > deadline:
                    run.problem = "the agents report no TCP health: eBPF did not load (see the agent logs)"
                    return run
                time.sleep(0.1)
            log.info("%s round %d: table with %s; load for %.0f s", variant, round_, ", ".join(sorted(wanted)),
                     plan.warmup_s + plan.loss_s + plan.recovery_s)  # fmt: skip
            asyncio.run(_drive(run, router, brain, nodes, loss, plan))
    finally:
        loss.remove()
        run.dropped = loss.dropped
        stopped.set()
        thread.join(timeout=20)
    return run


# --- the tables -------------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def table(runs: Sequence[Run], slow_ms: float) -> list[str]:
    """One Markdown row per run: the loss window's requests, then the healthy warm-up's for reference."""
    lines = [
        f"| brain | round | requests | errors | p50 ms | p99 ms | max ms | mean ms | over {slow_ms:.0f} ms (on the "
        "lossy node) | "
        "lossy node's share | "
        "its weight: lowest / at end | its stall ms: highest | the router's own stall ms: highest | "
        "its retransmits/conn (vectors alarming) | "
        "packets dropped | warm-up p50 / p99 ms | warm-up share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        if run.problem is not None and not run.results:
            lines.append(f"| {run.variant} | {run.round} | did not run: {run.problem} |")
            continue
        s, w = stats(run.loss_window(), run.lossy, slow_ms), stats(run.warmup(), run.lossy)
        window = [t for t in run.samples if run.loss_start_s <= t.at_s <= run.loss_end_s]
        lowest = min((x for t in window if (x := run.weight_at(t.at_s)) is not None), default=None)
        at_end = run.weight_at(run.loss_end_s)
        weight = "-" if lowest is None or at_end is None else f"{lowest:.2f} / {at_end:.2f}"
        stall = f"{max(t.stalls.get(run.lossy, 0.0) for t in window):.0f}" if window else "-"
        own_stall = f"{max(t.client_stalls.get(run.lossy, 0.0) for t in window):.0f}" if window else "-"
        vectors = run.lossy_vectors(run.loss_start_s, run.loss_end_s + 1.0)
        measured = [v.retransmits_per_conn for v in vectors if v.retransmits_per_conn is not None]
        alarming = sum(RETRANSMIT_ALARM in v.alarms for v in vectors)
        retransmits = f"{statistics.fmean(measured):.2f} ({alarming}/{len(vectors)})" if measured else "-"
        lines.append(
            f"| {run.variant} | {run.round} | {s.count} | {s.errors} | {_ms(s.p50_ms)} | {_ms(s.p99_ms)} | "
            f"{_ms(s.max_ms)} | {_ms(s.mean_ms)} | {s.slow} ({s.slow_lossy}) | {_share(s.lossy_share)} | {weight} | "
            f"{stall} | {own_stall} | {retransmits} | {'-' if run.dropped is None else run.dropped} | "
            f"{_ms(w.p50_ms)} / {_ms(w.p99_ms)} | {_share(w.lossy_share)} |"
        )
    return lines


def ratios(runs: Sequence[Run], slow_ms: float) -> list[str]:
    """Each variant over each later one in the loss window (full / no-health first), every round's requests pooled
    per variant: below 1 for the latencies, the first is faster."""
    variants = list(dict.fromkeys(run.variant for run in runs))
    lossy = runs[0].lossy if runs else ""
    pooled = {
        v: stats([r for run in runs if run.variant == v for r in run.loss_window()], lossy, slow_ms) for v in variants
    }
    lines = []
    for i, first in enumerate(variants):
        for second in variants[i + 1 :]:
            a, b = pooled[first], pooled[second]
            if a.count and b.count:
                lines.append(
                    f"| {first} / {second} | {_ratio(a.p50_ms, b.p50_ms)} | {_ratio(a.p99_ms, b.p99_ms)} | "
                    f"{_ratio(a.max_ms, b.max_ms)} | {_ratio(a.mean_ms, b.mean_ms)} | {_ratio(a.slow, b.slow)} | "
                    f"{_ratio(a.lossy_share, b.lossy_share)} |"
                )
    if not lines:
        return []
    head = f"| loss window | p50 | p99 | max | mean | over {slow_ms:.0f} ms | lossy node's share |"
    return [head, "|---|---|---|---|---|---|---|", *lines]


def timeline(run: Run) -> str:
    """The lossy node's weight when the loss began and at each STEP_S of the loss window after, and its share of
    the requests sent in each step."""
    if math.isnan(run.loss_start_s) or math.isnan(run.loss_end_s):
        return f"{run.variant} round {run.round}: no loss window"
    start = run.weight_at(run.loss_start_s)
    weights, shares = ["-" if start is None else f"{start:.2f} |"], []
    t = run.loss_start_s
    while t < run.loss_end_s - STEP_S / 2:  # a last step of less than half a step joins the one before
        end = run.loss_end_s if t + 1.5 * STEP_S > run.loss_end_s else t + STEP_S
        weight = run.weight_at(end)
        weights.append("-" if weight is None else f"{weight:.2f}")
        share = stats(run.sent_in(t, end), run.lossy).lossy_share
        shares.append("-" if share is None else f"{share:.0%}")
        t = end
    return (
        f"{run.variant} round {run.round}: {run.lossy} weight at the loss start | every {STEP_S:.0f} s after "
        f"{' '.join(weights)}; its share {' '.join(shares)}"
    )


# --- main -------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rate", type=float, default=20.0, help="requests a second (open loop)")
    parser.add_argument("--warmup", type=float, default=15.0, help="healthy seconds before the loss")
    parser.add_argument("--loss", type=float, default=40.0, help="seconds of loss")
    parser.add_argument("--recovery", type=float, default=5.0, help="healthy seconds after the loss")
    parser.add_argument(
        "--drop", type=float, default=10.0, help="percent of the client's packets to the lossy node dropped"
    )
    parser.add_argument(
        "--direction", choices=DIRECTIONS, default="to-node",
        help="to-node: drop what arrives at the lossy node's server port; from-node: what arrives from it",
    )  # fmt: skip
    parser.add_argument("--variants", default="full,no-health", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=1, help="times the variants run, alternating")
    parser.add_argument("--period", type=float, default=1.0, help="the agents' reporting period, seconds")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--gpu", default="a100", help="the emulated engines' GPU class")
    parser.add_argument("--time-scale", type=float, default=1.0, help="the emulated engines' time scale")
    parser.add_argument(
        "--placement", choices=("ttft", "ring"), default="ttft",
        help="ttft: the router's default (requests with block hashes by expected TTFT); ring: prefix index off",
    )  # fmt: skip
    parser.add_argument(
        "--slow-ms", type=float, default=300.0, help="a request slower than this counts as slow (a healthy one "
        "takes about 150 ms, a retransmission timeout 200 ms at least)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants or args.nodes < 2 or not 0 < args.drop < 100:
        parser.error(f"variants of {', '.join(VARIANTS)} (not {unknown}); --nodes at least 2; --drop within (0, 100)")
    problem = missing_tools()
    if problem is not None:
        print(f"kernel health bench: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("prism.brain").setLevel(logging.ERROR)  # each run's brain notes its missing state folder
    log = logging.getLogger("kernel_health_bench")
    log.setLevel(logging.INFO)
    duration = args.warmup + args.loss + args.recovery
    plan = Plan(
        args.warmup,
        args.loss,
        args.recovery,
        args.drop,
        args.direction,
        schedule(args.rate, duration, args.prompt_tokens, args.seed),
        args.max_tokens,
        Settings(prefix_index=args.placement == "ttft"),
    )
    logs = Path(tempfile.mkdtemp(prefix="prism-kernel-health-"))
    print(
        f"kernel health bench: {args.nodes} emulated {args.gpu} engines (sim/_engine.py, no GPU) in their own "
        f"network namespaces, a `prism agent` each (period {args.period:g} s); {args.rate:g} requests/s of "
        f"{args.prompt_tokens} prompt and {args.max_tokens} output tokens, non-streamed, placement "
        f"{args.placement}; {args.warmup:g} s healthy, {args.loss:g} s with {args.drop:g}% of the client's packets "
        f"{args.direction.replace('-', ' ')}-1 dropped, {args.recovery:g} s healthy; variants "
        f"{', '.join(variants)} x {args.rounds}; logs {logs}",
        flush=True,
    )
    started = time.monotonic()
    runs: list[Run] = []
    status = 0
    with signals_interrupt():
        try:
            with contextlib.ExitStack() as stack:
                ingest = f"tcp://127.0.0.1:{free_port()}"
                nodes = start_engines(stack, args.nodes, args.gpu, args.time_scale, logs)
                start_agents(stack, nodes, ingest, args.period, logs)
                limit = STARTUP_LIMIT_S
                for round_ in range(1, args.rounds + 1):
                    for variant in variants:
                        run = run_variant(variant, round_, nodes, ingest, plan, limit, log)
                        limit = TABLE_LIMIT_S
                        runs.append(run)
                        if run.problem is not None:
                            print(f"   {variant} round {round_}: {run.problem}", flush=True)
                            raise SystemExit(1)
        except KeyboardInterrupt:
            print("kernel health bench: interrupted; namespaces, nftables tables and processes removed", flush=True)
            status = 130
        except SystemExit as exc:
            status = int(exc.code or 1)
    print()
    for line in table(runs, args.slow_ms):
        print(line)
    lines = ratios(runs, args.slow_ms)
    if lines:
        print()
        for line in lines:
            print(line)
    print()
    for run in runs:
        print(timeline(run))
    print(f"   total wall clock {time.monotonic() - started:.0f} s; logs in {logs}")
    return status


if __name__ == "__main__":
    sys.exit(main())
