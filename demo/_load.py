"""The demo's load generator: replays the requests at their (compressed) arrival times as streamed OpenAI chat
completions through Prism's router (the httpx transport) or through another router's endpoint, kills a node
half-way, and keeps what the view and the summary show."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import IO, Any

from prismlb.router import AFFINITY_HEADER, Router
from prismlb.semantics import MODALITY_HEADER
from prismlb.sim._engine import MODEL_NAME
from prismlb.wire import RoutingTable

from ._processes import Cluster, Node, metric
from ._results import UNFINISHED, KillReport, NodeStats, Result, describe_moves, llm_nodes, moved_keys
from ._view import LiveView
from ._window import describe_transitions, read_window
from ._workload import DemoRequest

DRAIN_LIMIT_S = 10.0


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
        drain_s: float = DRAIN_LIMIT_S,
    ) -> None:
        self.cluster = cluster
        self.router = router
        self.requests = requests
        self.duration_s = duration_s
        self.speedup = requests[-1].at_s / duration_s if requests[-1].at_s > 0 else 1.0
        self.victim = victim
        self.view = LiveView(out, live)
        self.deadline = deadline
        self.drain_s = drain_s
        """How long requests still running when the replay ends may take to finish (at most; the deadline too)."""
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
        self.view.event(line)

    # --- requests ---

    async def _one(self, client: Any, req: DemoRequest) -> None:
        payload = {
            "model": MODEL_NAME,
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
        replay_cap = self.deadline - self.drain_s
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
                set(tasks), timeout=max(0.5, min(self.drain_s, self.deadline - time.monotonic()))
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
                self.view.draw(self)
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
            try:
                window = read_window(text)
            except ValueError:
                stats.unreadable_metrics += 1
                return
            before = stats.window.transitions if stats.window is not None else {}
            stats.window = window
            if window is not None and window.transitions != before:
                self.event(
                    f"{node.node_id} batch breaker now {window.state} (window {window.window_s * 1e3:.0f} ms); "
                    f"transitions so far: {describe_transitions(window.transitions)}"
                )

        await asyncio.gather(*(one(n) for n in self.cluster.nodes))

    async def collect_engines(self) -> None:
        """Each live engine's batch window after the replay, for the summary."""
        import httpx

        async with httpx.AsyncClient(timeout=1.0) as plain:
            await self._scrape(plain)

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
        self.view.draw(self, final=True)

    async def collect_agents(self) -> None:
        """Each live agent's counters (spans, joins, KV events, eBPF up) from its `/metrics`, for the summary."""
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
