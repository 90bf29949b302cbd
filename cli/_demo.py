"""`prism demo`: a brain, three agents and an in-process router on loopback, narrated.

Half-way through, one agent is killed; the demo shows that only that node's keys move. Ends by itself."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import IO

from prometheus_client.parser import text_string_to_metric_families

from prismlb.router import Router
from prismlb.wire import BrainAddress, RoutingTable, Slice, TableNode

SAMPLE_KEYS = tuple(f"session-{i:02d}" for i in range(16))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run brain + 3 agents + a router on loopback and show routing")
    p.add_argument("--duration", type=float, default=30.0, help="seconds to run (10..55, default 30)")
    p.add_argument("--no-ebpf", action="store_true", help="run the agents without the eBPF probe")
    p.set_defaults(func=_run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pump(name: str, stream: IO[str]) -> None:
    for line in stream:
        print(f"  [{name}] {line.rstrip()}", flush=True)


def spawn(name: str, args: Sequence[str]) -> subprocess.Popen[str]:
    """Start `prism <args>` as a child process whose log lines are echoed with a `[name]` prefix."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prismlb.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    threading.Thread(target=_pump, args=(name, proc.stdout), daemon=True).start()
    return proc


def placement(table: RoutingTable) -> dict[str, str]:
    """Where the sample keys go on exactly this table (the live router may swap tables meanwhile)."""
    fixed = Router.from_table(table)
    return {key: fixed.route(key).node_id for key in SAMPLE_KEYS}


def connect_counts(metrics_port: int) -> dict[str, int]:
    """Each node's eBPF connect() count as the brain last heard it, from the brain's /metrics."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1).read().decode()
    except OSError:
        return {}
    return {
        sample.labels["node"]: int(sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "prism_brain_node_metric"
        for sample in family.samples
        if sample.labels.get("metric") == "connect_calls_total"
    }


def llm_nodes(table: RoutingTable) -> list[TableNode]:
    """The text slice's nodes: the demo's agents carry no GPU labels, so they serve text only."""
    return next((s.nodes for s in table.slices if s.name == Slice.LLM), [])


def _show(table: RoutingTable, where: dict[str, str], counts: dict[str, int]) -> None:
    nodes = llm_nodes(table)
    print(f"\n== routing table {table.epoch}.{table.version}: {len(nodes)} node(s)")
    for node in nodes:
        keys = [k for k, n in where.items() if n == node.node_id]
        print(f"   {node.node_id:<24} weight {node.weight:.2f}  {node.endpoint:<24} keys: {' '.join(keys)}")
    if counts:
        seen = ", ".join(f"{node}={count}" for node, count in sorted(counts.items()))
        print(f"   connect() calls on this host counted by each agent's eBPF probe: {seen}")
    else:
        print("   no eBPF connect() counts (probe off: see the agents' log lines)")


def _run(args: argparse.Namespace) -> int:
    duration = min(55.0, max(10.0, args.duration))
    ingest, updates, snapshot = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    metrics_port = free_port()
    host = socket.gethostname()
    node_ids = [host, f"{host}-2", f"{host}-3"]
    print(f"prism demo: brain + {len(node_ids)} agents + router on loopback for {duration:.0f} s")
    brain_args = ["brain", "--ingest", ingest, "--updates", updates, "--snapshot", snapshot]
    procs = [spawn("brain", [*brain_args, "--metrics-port", str(metrics_port)])]
    for i, node_id in enumerate(node_ids):
        agent_args = ["agent", "--brain", ingest, "--endpoint", f"http://127.0.0.1:{8001 + i}"]
        agent_args += ["--otlp-grpc-port", "0", "--otlp-http-port", "0"]
        if i:
            agent_args += ["--node-id", node_id]
        if args.no_ebpf:
            agent_args.append("--no-ebpf")
        procs.append(spawn(node_ids[i], agent_args))
    victim = procs[-1]
    start = time.monotonic()
    before: tuple[RoutingTable, dict[str, str]] | None = None
    killed = False
    try:
        with Router.connect(BrainAddress(updates=updates, snapshot=snapshot)) as router:
            seen = (-1, -1)
            while time.monotonic() - start < duration:
                table = router.table
                if table is not None and table.order != seen and llm_nodes(table):
                    seen = table.order
                    where = placement(table)
                    _show(table, where, connect_counts(metrics_port))
                    live = {n.node_id for n in llm_nodes(table)}
                    if not killed and live == set(node_ids):
                        before = (table, where)
                    if killed and before is not None and node_ids[-1] not in live:
                        _report_moves(*before, table, where, node_ids[-1])
                        before = None
                if not killed and time.monotonic() - start >= duration / 2:
                    print(f"\n== killing agent {node_ids[-1]} (SIGKILL); the brain drops it after 3 missed periods")
                    victim.send_signal(signal.SIGKILL)
                    killed = True
                time.sleep(0.1)
            table = router.table
            print(
                f"\n== done: last table {table.epoch}.{table.version}, table age {router.table_age_s:.1f} s"
                if table is not None
                else "\n== done: no routing table arrived (is the brain running?)"
            )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


def _report_moves(
    before: RoutingTable, placed: dict[str, str], after: RoutingTable, now: dict[str, str], victim: str
) -> None:
    weight = {n.node_id: n.weight for n in llm_nodes(before)}
    reweighted = {n.node_id for n in llm_nodes(after) if n.weight != weight.get(n.node_id)}
    moved = [k for k in SAMPLE_KEYS if placed[k] != now[k]]
    from_victim = [k for k in moved if placed[k] == victim]
    by_weight = [k for k in moved if placed[k] != victim and {placed[k], now[k]} & reweighted]
    unexplained = len(moved) - len(from_victim) - len(by_weight)
    print(
        f"\n== {len(moved)} of {len(SAMPLE_KEYS)} sample keys moved: {len(from_victim)} from {victim}"
        + (f", {len(by_weight)} because {', '.join(sorted(reweighted))} changed weight" if by_weight else "")
        + f"; keys that moved between surviving nodes without a weight change: {unexplained}"
    )
