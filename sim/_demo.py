"""`prism demo`: a whole Prism cluster on loopback, loaded by a replayed trace, watched live.

Processes: one brain (`prism brain`), per node an emulated engine (`python -m prismlb.sim._demo engine`, an
`EmulatedEngine` of a GPU class) and its agent (`prism agent`: scrapes the engine's `/metrics`, subscribes to
its KV events, receives its OTLP spans, eBPF when this host allows it). In this process: a router
(`Router.connect`) behind the httpx transport, and a load generator that replays the first requests of the
Mooncake conversation trace, time-compressed, as streamed OpenAI chat completions.

Requests are the trace's requests shrunk `TOKEN_SCALE` times (prompt and output): a 512-token prefix block
of the trace becomes 32 tokens of text, the same text for the same `hash_ids` entry, so the trace's prefix
reuse reaches the engines' prefix caches. Arrivals are compressed so the replay lasts `duration_s`, and the
engines' `time_scale` is set so that the offered prefill work is `load` of the cluster's prefill capacity.

Half-way through one node (engine and agent) is killed with SIGKILL: the brain drops it after three missed
periods, and the demo counts which of the prefix keys seen so far moved. Every child is stopped on exit,
on Ctrl-C and on SIGTERM (and gets SIGTERM from the kernel if this process dies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from prismlb.router import AFFINITY_HEADER, Ring, Router, Settings, prefix_key
from prismlb.wire import MODALITY_HEADER, BrainAddress, RoutingTable, Slice, TableNode, quantile

from ._engine import CHARS_PER_TOKEN
from ._model import KV_BLOCK_TOKENS, PROFILES
from ._traces import traces_dir

TRACE = Path("mooncake") / "conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512
TOKEN_SCALE = 16
"""Each replayed request is its trace request shrunk this many times, prompt and output."""
BLOCK_CHARS = TRACE_BLOCK_TOKENS // TOKEN_SCALE * CHARS_PER_TOKEN
KEY_PREFIX_TOKENS = 4 * TRACE_BLOCK_TOKENS // TOKEN_SCALE
"""Prefix keys cover the first four trace blocks: every Mooncake request shares the first one (a system
prompt), and a conversation's later turns keep its first blocks."""
DEFAULT_NODES = ("h100", "a100", "a100", "l40s")
DEFAULT_REQUESTS = 1800
DEFAULT_DURATION_S = 60.0
DEFAULT_LOAD = 0.6
MAX_WALL_S = 115.0
"""Everything, set-up and tear-down included, ends within this (the demo's promise is two minutes)."""
STARTUP_LIMIT_S = 30.0
DRAIN_LIMIT_S = 10.0
TIME_SCALE_RANGE = (0.25, 4.0)
AGENT_PERIOD_S = 1.0
SLOW_S = 0.3
"""The design article's slow first token for the breaker (the library's default is longer, for long prompts):
the demo's prompts are short and interactive, what the article's 300 ms is meant for."""
UNFINISHED = "unfinished at the time bound"
_WORDS = (
    "the model cache token prefix route node weight batch decode prefill latency tail span trace agent brain "
    "kernel table ring slice key block memory queue stream answer question context system user assistant "
    "vision audio video text retrieval vector index shard replica cluster request response"
).split()


# --- the workload -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DemoRequest:
    index: int
    at_s: float
    """Arrival in trace seconds from the first request."""
    text: str
    max_tokens: int
    key: str
    """The affinity key: `prefix_key(text=...)` over the first KEY_PREFIX_TOKENS tokens, as a string."""
    blocks: tuple[int, ...] = ()
    """The trace's `hash_ids`."""


def _block_text(block_id: int, cache: dict[int, str]) -> str:
    """BLOCK_CHARS characters of words, the same for the same trace block id."""
    text = cache.get(block_id)
    if text is None:
        rng = random.Random(block_id)
        words: list[str] = []
        size = 0
        while size < BLOCK_CHARS:
            word = rng.choice(_WORDS)
            words.append(word)
            size += len(word) + 1
        text = cache[block_id] = " ".join(words)[: BLOCK_CHARS - 1] + " "
    return text


def load_requests(count: int, path: Path | None = None) -> list[DemoRequest]:
    """The first `count` requests of the Mooncake conversation trace, shrunk TOKEN_SCALE times."""
    path = path if path is not None else traces_dir() / TRACE
    if not path.is_file():
        raise FileNotFoundError(f"the Mooncake trace is not at {path} (set PRISM_TRACES to the traces folder)")
    cache: dict[int, str] = {}
    requests: list[DemoRequest] = []
    with path.open() as f:
        for line in f:
            if len(requests) >= count:
                break
            row = json.loads(line)
            tokens = max(1, math.ceil(row["input_length"] / TOKEN_SCALE))
            text = "".join(_block_text(b, cache) for b in row["hash_ids"])[: tokens * CHARS_PER_TOKEN]
            key = prefix_key(text=text, prefix_tokens=KEY_PREFIX_TOKENS)
            max_tokens = max(2, round(row["output_length"] / TOKEN_SCALE))
            at_s = row["timestamp"] / 1000
            requests.append(DemoRequest(len(requests), at_s, text, max_tokens, f"{key:016x}", (*row["hash_ids"],)))
    if not requests:
        raise ValueError(f"{path} has no requests")
    return requests


def prefix_cache_bound(requests: Sequence[DemoRequest]) -> float:
    """The prompt-token hit rate of one infinite prefix cache that saw every request in order: each request's
    leading run of trace blocks seen before, in whole engine blocks (the most any placement reaches)."""
    seen: set[int] = set()
    hits = total = 0
    block_tokens = TRACE_BLOCK_TOKENS // TOKEN_SCALE
    for r in requests:
        tokens = len(r.text) // CHARS_PER_TOKEN
        run = 0
        while run < len(r.blocks) and r.blocks[run] in seen:
            run += 1
        hits += min(tokens // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS, run * block_tokens)
        total += tokens
        seen.update(r.blocks)
    return hits / total if total else 0.0


def prefill_work_s(requests: Sequence[DemoRequest], gpus: Sequence[str]) -> float:
    """Seconds of prefill the requests need on the cluster (no cache reuse), in model time."""
    capacity = sum(PROFILES[g].prefill_tokens_per_s for g in gpus)  # type: ignore[index]
    return sum(len(r.text) / CHARS_PER_TOKEN for r in requests) / capacity


# --- processes --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child: SIGTERM when the demo process dies, however it dies (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def spawn(args: Sequence[str], log: Path, executable: str = sys.executable) -> subprocess.Popen[bytes]:
    """A child process in its own session (Ctrl-C reaches only the demo, which stops it), output to `log`;
    `executable` runs `args` (this Python by default; another program for a router under comparison)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [executable, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )


def stop(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 5.0) -> None:
    """SIGTERM each live process, wait up to `timeout_s` for all, then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Node:
    node_id: str
    gpu: str
    engine_port: int
    kv_port: int
    otlp_port: int
    metrics_port: int
    engine: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    killed_at: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"


class Cluster:
    """The brain, and per node an emulated engine and its agent, as child processes logging into `logs`."""

    def __init__(self, gpus: Sequence[str], time_scale: float, logs: Path, ebpf: bool) -> None:
        self.logs = logs
        self.time_scale = time_scale
        self.ingest = f"tcp://127.0.0.1:{free_port()}"
        self.address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
        self.brain_metrics_port = free_port()
        self.admin_port = free_port()
        self.ebpf = ebpf
        self.nodes = [
            Node(f"{gpu}-{i + 1}", gpu, free_port(), free_port(), free_port(), free_port())
            for i, gpu in enumerate(gpus)
        ]
        self.brain: subprocess.Popen[bytes] | None = None

    def procs(self) -> list[subprocess.Popen[bytes]]:
        """Every child, agents first (they report to the brain), then engines, then the brain."""
        agents = [n.agent for n in self.nodes if n.agent is not None]
        engines = [n.engine for n in self.nodes if n.engine is not None]
        return [*agents, *engines, *([self.brain] if self.brain is not None else [])]

    def start(self, prism: bool = True) -> None:
        """Start the children. Without `prism` only the engines start (no brain, no agents, no OTLP export):
        a cluster for another router to balance."""
        if prism:
            self.brain = spawn(
                [
                    "-m",
                    "prismlb.cli",
                    "brain",
                    "--ingest",
                    self.ingest,
                    "--updates",
                    self.address.updates,
                    "--snapshot",
                    self.address.snapshot,
                    "--metrics-port",
                    str(self.brain_metrics_port),
                    "--admin-port",
                    str(self.admin_port),
                    "--state-dir",
                    str(self.logs / "brain-state"),
                ],
                self.logs / "brain.log",
            )
        for node in self.nodes:
            node.engine = spawn(
                [
                    "-m",
                    "prismlb.sim._demo",
                    "engine",
                    "--gpu",
                    node.gpu,
                    "--port",
                    str(node.engine_port),
                    "--kv-events",
                    f"tcp://127.0.0.1:{node.kv_port}",
                    "--time-scale",
                    repr(self.time_scale),
                    *(["--otlp", f"http://127.0.0.1:{node.otlp_port}"] if prism else []),
                ],
                self.logs / f"engine-{node.node_id}.log",
            )
        if not prism:
            return
        for node in self.nodes:
            args = [
                "-m",
                "prismlb.cli",
                "agent",
                "--node-id",
                node.node_id,
                "--brain",
                self.ingest,
                "--endpoint",
                node.url,
                "--engine-url",
                f"{node.url}/metrics",
                "--kv-events",
                f"tcp://127.0.0.1:{node.kv_port}",
                "--otlp-grpc-port",
                str(node.otlp_port),
                "--otlp-http-port",
                "0",
                "--metrics-port",
                str(node.metrics_port),
                "--period",
                str(AGENT_PERIOD_S),
                "--trace-port",
                str(node.engine_port),
            ]
            if not self.ebpf:
                args.append("--no-ebpf")
            node.agent = spawn(args, self.logs / f"agent-{node.node_id}.log")

    def failed(self) -> str | None:
        """A description of a child that exited (other than a killed node), or None."""
        for name, proc in [("brain", self.brain)] + [
            (f"{kind} {n.node_id}", p)
            for n in self.nodes
            if n.killed_at is None
            for kind, p in (("engine", n.engine), ("agent", n.agent))
        ]:
            if proc is not None and proc.poll() is not None:
                return f"{name} exited with status {proc.returncode}"
        return None

    def kill(self, node: Node) -> None:
        """SIGKILL a node's engine and agent: the machine is gone."""
        for proc in (node.engine, node.agent):
            if proc is not None and proc.poll() is None:
                proc.kill()
        node.killed_at = time.monotonic()

    def close(self) -> None:
        stop(self.procs())

    def log_tail(self, lines: int = 8) -> str:
        out = []
        for path in sorted(self.logs.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)


def metric(text: str, name: str) -> float | None:
    """The sum of a metric's samples in Prometheus text (None when absent)."""
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values) if values else None


# --- the load generator -----------------------------------------------------------------------------------


@dataclass
class Result:
    index: int
    key: str
    node: str | None
    sent_s: float
    end_s: float
    ttft_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class NodeStats:
    ok: int = 0
    errors: int = 0
    inflight: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    kv_usage: float | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The project's `quantile` (q in 0..1) for the view, which shows None as "-"; None for no values."""
    return quantile(values, q) if values else None


class _NodeTagging:
    """The httpx transport under the router's: notes which node a forwarded request went to."""

    def __init__(self, inner: Any, by_port: dict[int, str]) -> None:
        self._inner = inner
        self._by_port = by_port

    async def handle_async_request(self, request: Any) -> Any:
        response = await self._inner.handle_async_request(request)
        response.extensions["prism_demo_node"] = self._by_port.get(request.url.port)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass
class KillReport:
    victim: str
    at_s: float
    removed_at_s: float | None = None
    table_before: str = ""
    table_after: str = ""
    keys: int = 0
    moved: int = 0
    from_victim: int = 0
    by_weight: int = 0
    unexplained: int = 0
    reweighted: tuple[str, ...] = ()


def llm_nodes(table: RoutingTable | None) -> list[TableNode]:
    """The text slice's nodes (the demo's agents report no GPU labels, so every node serves text)."""
    if table is None:
        return []
    return next((s.nodes for s in table.slices if s.name == Slice.LLM), [])


def moved_keys(before: RoutingTable, after: RoutingTable, keys: Sequence[str], victim: str) -> KillReport:
    """Which ring node owns each of `keys` on each table's text slice (ownership only: the router's bounded
    load may still send a key elsewhere): what moved, and why."""
    ring_before, ring_after = Ring.build(llm_nodes(before)), Ring.build(llm_nodes(after))
    placed = {k: ring_before.lookup(k).node_id for k in keys}
    now = {k: ring_after.lookup(k).node_id for k in keys}
    weight = {n.node_id: n.weight for n in llm_nodes(before)}
    reweighted = tuple(sorted(n.node_id for n in llm_nodes(after) if n.weight != weight.get(n.node_id)))
    moved = [k for k in keys if placed[k] != now[k]]
    from_victim = [k for k in moved if placed[k] == victim]
    by_weight = [k for k in moved if placed[k] != victim and {placed[k], now[k]} & set(reweighted)]
    return KillReport(
        victim,
        0.0,
        table_before=f"{before.epoch}.{before.version}",
        table_after=f"{after.epoch}.{after.version}",
        keys=len(keys),
        moved=len(moved),
        from_victim=len(from_victim),
        by_weight=len(by_weight),
        unexplained=len(moved) - len(from_victim) - len(by_weight),
        reweighted=reweighted,
    )


def describe_moves(report: KillReport) -> str:
    weight = ""
    if report.by_weight:
        weight = f", {report.by_weight} with the weight change of {', '.join(report.reweighted)}"
    return (
        f"{report.moved} of {report.keys} prefix keys seen moved: {report.from_victim} from {report.victim}{weight}; "
        f"between surviving nodes without a weight change: {report.unexplained}"
    )


class Demo:
    """Runs the replay against a started cluster and keeps what the view and the summary show. With no
    `router` the replay goes through the client given to `run` (another router's endpoint)."""

    def __init__(
        self,
        cluster: Cluster,
        router: Router | None,
        requests: Sequence[DemoRequest],
        duration_s: float,
        victim: Node | None,
        out: IO[str],
        live: bool,
        deadline: float,
    ) -> None:
        self.cluster = cluster
        self.router = router
        self.requests = requests
        self.duration_s = duration_s
        self.speedup = requests[-1].at_s / duration_s if requests[-1].at_s > 0 else 1.0
        self.victim = victim
        self.out = out
        self.live = live
        self.deadline = deadline
        self.stats = {n.node_id: NodeStats() for n in cluster.nodes}
        self.results: list[Result] = []
        self.sent = 0
        self.not_sent = 0
        self.unfinished = 0
        self.kill: KillReport | None = None
        self.events: list[str] = []
        self.tables: set[tuple[int, int]] = set()
        self.first_table: RoutingTable | None = None
        self.start = 0.0
        self.replay_end = 0.0
        self.agent_counts: dict[str, dict[str, float | None]] = {}
        self._drawn = 0
        self._last_weights: dict[str, float] = {}

    def now(self) -> float:
        return time.monotonic() - self.start

    @property
    def table(self) -> RoutingTable | None:
        """Prism's current routing table; None when another router carries the load."""
        return self.router.table if self.router is not None else None

    def event(self, text: str) -> None:
        line = f"[{self.now():5.1f}s] {text}"
        self.events.append(line)
        if not self.live:
            print(line, file=self.out, flush=True)

    # --- requests ---

    async def _one(self, client: Any, req: DemoRequest) -> None:
        payload = {
            "model": "prism-emulated-8b",
            "messages": [{"role": "user", "content": req.text}],
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {MODALITY_HEADER: "text", AFFINITY_HEADER: req.key}
        sent = self.now()
        result = Result(req.index, req.key, None, sent, sent)
        stats: NodeStats | None = None
        try:
            async with client.stream("POST", "/v1/chat/completions", json=payload, headers=headers) as response:
                result.node = response.extensions.get("prism_demo_node")
                stats = self.stats.get(result.node or "")
                if stats is not None:
                    stats.inflight += 1
                if response.status_code != 200:
                    await response.aread()
                    raise RuntimeError(f"HTTP {response.status_code}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if result.ttft_ms is None:
                        result.ttft_ms = (self.now() - sent) * 1000
                    if line == "data: [DONE]":
                        break
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        result.prompt_tokens = usage["prompt_tokens"]
                        result.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                else:
                    raise RuntimeError("stream ended before [DONE]")
        except asyncio.CancelledError:
            result.error = UNFINISHED
            raise
        except Exception as exc:  # httpx errors, HTTP status, NoRouteError, ShedError: all are the request's result
            result.error = type(exc).__name__
        finally:
            result.end_s = self.now()
            if stats is not None:
                stats.inflight -= 1
            self.results.append(result)
            node_stats = self.stats.get(result.node or "")
            if node_stats is not None:
                if result.error is None:
                    node_stats.ok += 1
                    node_stats.prompt_tokens += result.prompt_tokens
                    node_stats.cached_tokens += result.cached_tokens
                    if result.ttft_ms is not None:
                        node_stats.ttft_ms.append(result.ttft_ms)
                elif result.error != UNFINISHED:
                    node_stats.errors += 1

    async def _replay(self, client: Any) -> None:
        tasks: set[asyncio.Task[None]] = set()
        loop_start = self.now()
        replay_cap = self.deadline - DRAIN_LIMIT_S
        for req in self.requests:
            at = loop_start + req.at_s / self.speedup
            if self.start + at > replay_cap:
                self.not_sent = len(self.requests) - self.sent
                self.event(f"time bound: {self.not_sent} requests not sent")
                break
            delay = at - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._one(client, req))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            self.sent += 1
        self.replay_end = self.now()
        if tasks:
            _, pending = await asyncio.wait(
                set(tasks), timeout=max(0.5, min(DRAIN_LIMIT_S, self.deadline - time.monotonic()))
            )
            for task in pending:
                task.cancel()
            self.unfinished = len(pending)
            if pending:
                await asyncio.wait(pending, timeout=2)

    async def _killer(self) -> None:
        victim = self.victim
        if victim is None:
            return
        await asyncio.sleep(max(0.0, self.duration_s / 2 - self.now()))
        before = self.table
        keys = sorted({r.key for r in self.results} | {req.key for req in self.requests[: self.sent]})
        self.cluster.kill(victim)
        self.kill = KillReport(victim.node_id, self.now())
        self.event(f"killed {victim.node_id} (engine and agent, SIGKILL); the brain drops it after 3 silent periods")
        while time.monotonic() < self.deadline:
            table = self.table
            if table is not None and victim.node_id not in {n.node_id for n in llm_nodes(table)}:
                if before is not None:
                    report = moved_keys(before, table, keys, victim.node_id)
                    report.at_s, report.removed_at_s = self.kill.at_s, self.now()
                    self.kill = report
                    detail = describe_moves(report)
                else:
                    self.kill.removed_at_s = self.now()
                    detail = "no table before the kill to compare with"
                self.event(f"table {table.epoch}.{table.version} without {victim.node_id}: {detail}")
                return
            await asyncio.sleep(0.1)

    async def _watch(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=0.5) as plain:
            while True:
                await self._scrape(plain)
                self._note_table()
                self.draw()
                failed = self.cluster.failed()
                if failed:
                    self.event(f"child process failed: {failed}")
                    raise RuntimeError(failed)
                await asyncio.sleep(1.0)

    async def _scrape(self, plain: Any) -> None:
        async def one(node: Node) -> None:
            stats = self.stats[node.node_id]
            if node.killed_at is not None:
                stats.kv_usage = None
                return
            try:
                text = (await plain.get(f"{node.url}/metrics")).text
            except Exception:
                return
            stats.kv_usage = metric(text, "vllm:kv_cache_usage_perc")

        await asyncio.gather(*(one(n) for n in self.cluster.nodes))

    def _note_table(self) -> None:
        table = self.table
        if table is None or table.order in self.tables:
            return
        self.tables.add(table.order)
        if self.first_table is None:
            self.first_table = table
        weights = {n.node_id: n.weight for n in llm_nodes(table)}
        if weights != self._last_weights:
            shown = ", ".join(f"{k} {v:.2f}" for k, v in sorted(weights.items()))
            self.event(f"table {table.epoch}.{table.version}: {shown}")
            self._last_weights = weights

    async def run(self, client: Any = None) -> None:
        """The replay through Prism's router, or through `client` (an `httpx.AsyncClient` whose base URL is
        another router) when one is given."""
        import httpx

        from prismlb.router import AsyncPrismTransport

        if client is None:
            assert self.router is not None
            by_port = {n.engine_port: n.node_id for n in self.cluster.nodes}
            inner = _NodeTagging(httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=4096)), by_port)
            transport = AsyncPrismTransport(self.router, transport=inner)  # type: ignore[arg-type]
            timeout = httpx.Timeout(60.0, connect=2.0)
            client = httpx.AsyncClient(transport=transport, base_url="http://prism", timeout=timeout)
        async with client:
            watch = asyncio.create_task(self._watch())
            killer = asyncio.create_task(self._killer())
            try:
                replay = asyncio.create_task(self._replay(client))
                done, _ = await asyncio.wait({replay, watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch in done:
                    replay.cancel()
                    watch.result()
                replay.result()
            finally:
                for task in (watch, killer):
                    task.cancel()
                await asyncio.gather(watch, killer, return_exceptions=True)
        self._note_table()
        self.draw(final=True)

    # --- view ---

    def rows(self) -> list[str]:
        table = self.table
        weights = {n.node_id: n.weight for n in llm_nodes(table)}
        done = len(self.results)
        errors = sum(1 for r in self.results if r.error)
        version = f"{table.epoch}.{table.version}" if table is not None else "none"
        lines = [
            f"prism demo {self.now():5.1f}s  trace {min(self.now() * self.speedup, self.requests[-1].at_s):4.0f} s"
            f"  sent {self.sent}/{len(self.requests)}  done {done}  errors {errors}"
            f"  in flight {self.sent - done}  table {version}",
            f"{'node':<8} {'gpu':<5} {'weight':>6} {'in flight':>9} {'KV use':>7} {'cache hit':>9} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'done':>5} {'err':>4}",
        ]
        for node in self.cluster.nodes:
            s = self.stats[node.node_id]
            weight = weights.get(node.node_id)
            p50, p99 = percentile(s.ttft_ms, 0.5), percentile(s.ttft_ms, 0.99)
            state = "killed" if node.killed_at is not None else ""
            lines.append(
                f"{node.node_id:<8} {node.gpu:<5} {_num(weight, '{:.2f}'):>6} {s.inflight:>9} "
                f"{_num(s.kv_usage, '{:.1%}'):>7} {_ratio(s.cached_tokens, s.prompt_tokens):>9} "
                f"{_num(p50, '{:.0f} ms'):>9} {_num(p99, '{:.0f} ms'):>9} {s.ok:>5} {s.errors:>4} {state}"
            )
        return lines

    def draw(self, final: bool = False) -> None:
        if self.live:
            width = shutil.get_terminal_size((120, 40)).columns
            lines = [*self.rows(), "", *self.events[-6:]]
            frame = ("\x1b[%dF\x1b[J" % self._drawn if self._drawn else "") + "\n".join(line[:width] for line in lines)
            self.out.write(frame + "\n")
            self.out.flush()
            self._drawn = len(lines)
            if final:
                self._drawn = 0
            return
        weights = {n.node_id: n.weight for n in llm_nodes(self.table)}
        nodes = " | ".join(
            f"{n.node_id} w {_num(weights.get(n.node_id), '{:.2f}')} if {self.stats[n.node_id].inflight}"
            f" p99 {_num(percentile(self.stats[n.node_id].ttft_ms, 0.99), '{:.0f}ms')}"
            for n in self.cluster.nodes
        )
        print(f"{self.rows()[0]} || {nodes}", file=self.out, flush=True)

    async def collect_agents(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=1.0) as plain:
            for node in self.cluster.nodes:
                if node.killed_at is not None:
                    continue
                try:
                    text = (await plain.get(f"http://127.0.0.1:{node.metrics_port}/metrics")).text
                except Exception:
                    continue
                self.agent_counts[node.node_id] = {
                    name: metric(text, metric_name)
                    for name, metric_name in (
                        ("spans", "prism_agent_otlp_spans_received_total"),
                        ("server_spans", "prism_agent_join_server_spans_total"),
                        ("joined", "prism_agent_join_server_spans_joined_total"),
                        ("kv_events", "prism_agent_kv_events_total"),
                        ("ebpf", "prism_agent_ebpf_up"),
                    )
                }


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _ratio(part: int, whole: int) -> str:
    return "-" if not whole else f"{part / whole:.1%}"


def summary(demo: Demo, wall_s: float, time_scale: float, load: float) -> list[str]:
    """The closing report: requests, errors, TTFT and cache hits per node, the kill, the brain, the agents."""
    finished = [r for r in demo.results if r.error != UNFINISHED]
    ok = [r for r in finished if r.error is None]
    errors = [r for r in finished if r.error is not None]
    kill = demo.kill
    around = (kill.at_s, (kill.removed_at_s or kill.at_s) + 2 * AGENT_PERIOD_S) if kill is not None else None
    at_kill = [
        r
        for r in errors
        if kill is not None
        and around is not None
        and r.end_s >= around[0]
        and (r.node == kill.victim or r.end_s <= around[1])
    ]
    other = [r for r in errors if r not in at_kill]
    span = demo.requests[-1].at_s
    lines = [
        "",
        f"== summary: {len(demo.requests)} Mooncake conversation requests, trace 0–{span:.0f} s replayed "
        f"×{demo.speedup:.1f} in {demo.replay_end:.0f} s, each 1/{TOKEN_SCALE} of its size; engines at time_scale "
        f"{time_scale:.2f} for {load:.0%} offered prefill load; demo wall time {wall_s:.1f} s",
        f"   requests: {len(ok)} answered, {len(errors)} errors ({len(at_kill)} around the kill, other errors: "
        f"{len(other)}), {demo.not_sent} not sent and {demo.unfinished} unfinished at the time bound",
    ]
    if other:
        kinds: dict[str, int] = {}
        for r in other:
            kinds[r.error or "?"] = kinds.get(r.error or "?", 0) + 1
        lines.append("   other errors by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    header = f"{'node':<8} {'gpu':<5} {'answered':>8} {'errors':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'cache hit':>9}"
    lines.append("   " + header)

    def row(name: str, gpu: str, answered: int, failed: int, ttft: list[float], cached: int, prompt: int) -> str:
        p50 = _num(percentile(ttft, 0.5), "{:.0f} ms")
        p99 = _num(percentile(ttft, 0.99), "{:.0f} ms")
        return f"   {name:<8} {gpu:<5} {answered:>8} {failed:>6} {p50:>9} {p99:>9} {_ratio(cached, prompt):>9}"

    for node in demo.cluster.nodes:
        s = demo.stats[node.node_id]
        killed = "  (killed)" if node.killed_at is not None else ""
        lines.append(row(node.node_id, node.gpu, s.ok, s.errors, s.ttft_ms, s.cached_tokens, s.prompt_tokens) + killed)
    prompt = sum(s.prompt_tokens for s in demo.stats.values())
    cached = sum(s.cached_tokens for s in demo.stats.values())
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    lines.append(row("total", "", len(ok), len(errors), ttft, cached, prompt))
    lines.append(
        f"   prefix-cache hit rate: {_ratio(cached, prompt)} of {prompt} prompt tokens (engines' "
        f"usage.cached_tokens); one infinite prefix cache would reach {prefix_cache_bound(demo.requests):.1%}"
    )
    lines.append("   TTFT: measured by the load generator, wall clock, to the first streamed chunk")
    if kill is not None:
        if kill.removed_at_s is not None and kill.table_before:
            lines.append(
                f"   kill: {kill.victim} at {kill.at_s:.1f} s, out of the table at {kill.removed_at_s:.1f} s "
                f"(table {kill.table_before} → {kill.table_after}); keys moved at the kill: {describe_moves(kill)}"
            )
        else:
            lines.append(f"   kill: {kill.victim} at {kill.at_s:.1f} s; the brain had not dropped it by the end")
    first, last = demo.first_table, demo.table
    if first is not None and last is not None:
        lines.append(
            f"   brain: routing tables {first.epoch}.{first.version} to {last.epoch}.{last.version} "
            f"({len(demo.tables)} distinct seen by the router)"
        )
    for node_id, counts in sorted(demo.agent_counts.items()):
        server, joined = counts.get("server_spans"), counts.get("joined")
        join = ""
        if counts.get("ebpf") and server and joined is not None:
            join = f", {int(joined)}/{int(server)} server spans joined to kernel connections"
        lines.append(
            f"   agent {node_id}: {int(counts.get('spans') or 0)} spans received over OTLP, "
            f"{int(counts.get('kv_events') or 0)} KV events ({'eBPF on' if counts.get('ebpf') else 'eBPF off'}{join})"
        )
    return lines


@dataclass(frozen=True)
class Options:
    requests: int = DEFAULT_REQUESTS
    duration_s: float = DEFAULT_DURATION_S
    load: float = DEFAULT_LOAD
    gpus: tuple[str, ...] = DEFAULT_NODES
    kill: bool = True
    ebpf: bool = True
    cpus: int = 2
    live: bool | None = None
    keep_logs: bool = False


def _pin(cpus: int, out: IO[str]) -> None:
    if cpus <= 0 or not hasattr(os, "sched_setaffinity"):
        return
    available = sorted(os.sched_getaffinity(0))
    if len(available) > cpus:
        os.sched_setaffinity(0, available[:cpus])
        print(f"   pinned to CPUs {available[:cpus]} of {len(available)} (--cpus 0 to use all)", file=out)


def run(options: Options, out: IO[str] = sys.stdout) -> int:
    """The demo; returns the exit status (0 done, 1 a child failed or no table came, 2 bad input, 130 Ctrl-C)."""
    started = time.monotonic()
    deadline = started + MAX_WALL_S
    if not options.gpus:
        print("prism demo: --nodes names no GPU class", file=out)
        return 2
    for gpu in options.gpus:
        if gpu not in PROFILES:
            print(f"prism demo: unknown GPU class {gpu!r} (known: {', '.join(sorted(PROFILES))})", file=out)
            return 2
    try:
        requests = load_requests(options.requests)
    except (OSError, ValueError) as exc:
        print(f"prism demo: {exc}", file=out)
        return 2
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("prism demo: the load generator needs httpx (pip install 'prism-lb[test]')", file=out)
        return 2
    work = prefill_work_s(requests, options.gpus)
    low, high = TIME_SCALE_RANGE
    time_scale = min(high, max(low, options.load * options.duration_s / work))
    offered = time_scale * work / options.duration_s  # the load asked for, unless time_scale hit its bounds
    live = out.isatty() if options.live is None else options.live
    logs = Path(tempfile.mkdtemp(prefix="prism-demo-"))
    cluster = Cluster(options.gpus, time_scale, logs, options.ebpf)
    victim = None
    if options.kill and len(cluster.nodes) > 1:
        same = [n for n in cluster.nodes if n.gpu == "a100"]
        victim = same[-1] if len(same) > 1 else cluster.nodes[-1]
    print(
        f"prism demo: brain + {len(cluster.nodes)} agents + {len(cluster.nodes)} emulated engines "
        f"({', '.join(options.gpus)}) + router on loopback; {len(requests)} Mooncake requests in "
        f"{options.duration_s:.0f} s; logs in {logs}",
        file=out,
        flush=True,
    )
    _pin(options.cpus, out)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    status = 0
    demo: Demo | None = None
    try:
        cluster.start()
        print(
            f"   waiting for a routing table with all {len(cluster.nodes)} nodes "
            f"(watch the brain with: prism top --admin http://127.0.0.1:{cluster.admin_port})",
            file=out,
            flush=True,
        )
        with Router.connect(cluster.address, settings=Settings(slow_s=SLOW_S * time_scale)) as router:
            wanted = {n.node_id for n in cluster.nodes}
            ready_by = min(deadline, time.monotonic() + STARTUP_LIMIT_S)
            while {n.node_id for n in llm_nodes(router.table)} != wanted:
                failed = cluster.failed()
                if failed or time.monotonic() > ready_by:
                    print(f"prism demo: {failed or 'no routing table with every node in time'}", file=out)
                    print(cluster.log_tail(), file=out)
                    return 1
                time.sleep(0.1)
            print(f"   cluster up in {time.monotonic() - started:.1f} s; replaying", file=out, flush=True)
            demo = Demo(cluster, router, requests, options.duration_s, victim, out, live, deadline)
            demo.start = time.monotonic()
            try:
                asyncio.run(_main(demo))
            except RuntimeError as exc:
                print(f"prism demo: {exc}", file=out)
                print(cluster.log_tail(), file=out)
                status = 1
    except KeyboardInterrupt:
        print("\nprism demo: interrupted; stopping every process", file=out, flush=True)
        status = 130
    finally:
        cluster.close()
        signal.signal(signal.SIGTERM, previous)
        if live:
            out.write("\x1b[?25h")
    if demo is not None:
        for line in summary(demo, time.monotonic() - started, time_scale, offered):
            print(line, file=out)
    if status in (0, 130) and not options.keep_logs:
        shutil.rmtree(logs, ignore_errors=True)
    else:
        print(f"   logs kept in {logs}", file=out)
    out.flush()
    return status


async def _main(demo: Demo) -> None:
    if demo.live:
        demo.out.write("\x1b[?25l")
    await demo.run()
    await asyncio.sleep(1.0)  # the last spans: the engines export every 0.5 s, the agents join after 0.25 s
    await demo.collect_agents()


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block, so that a script stops through its own clean-up.
    SIGINT is set explicitly: a shell without job control starts a background command with SIGINT ignored, and
    Python then leaves it ignored."""
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# --- one engine per process -------------------------------------------------------------------------------


def engine_main(argv: Sequence[str]) -> int:
    """`python -m prismlb.sim._demo engine ...`: serve one EmulatedEngine until SIGTERM or SIGINT."""
    from ._engine import EmulatedEngine

    parser = argparse.ArgumentParser(prog="python -m prismlb.sim._demo engine")
    parser.add_argument("--gpu", choices=sorted(PROFILES), default="a100")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kv-events")
    parser.add_argument("--otlp")
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    engine = EmulatedEngine(
        args.gpu, port=args.port, kv_events_endpoint=args.kv_events, time_scale=args.time_scale, otlp_endpoint=args.otlp
    )
    engine.start()
    print(f"emulated {args.gpu} engine on {engine.url} (time_scale {args.time_scale:g})", flush=True)
    stopped.wait()
    engine.close()
    print("emulated engine stopped", flush=True)
    return 0


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["engine"]:
        return engine_main(argv[1:])
    print("usage: python -m prismlb.sim._demo engine [--gpu ...]; the demo itself is `prism demo`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
