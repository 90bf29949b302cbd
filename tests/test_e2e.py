"""End to end on loopback: a brain and three agents as real subprocesses, an in-process router."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prismlb.demo import llm_nodes
from prismlb.router import Router
from prismlb.wire import BrainAddress, RoutingTable

from .conftest import free_port, prism, require_ebpf, wait_for

NODES = ("node-a", "node-b", "node-c")
KEYS = [f"prefix-{i}" for i in range(3000)]
CONNECTS = "prism_brain_node_connect_calls_total"


@dataclass
class Cluster:
    brain: subprocess.Popen[bytes]
    agents: dict[str, subprocess.Popen[bytes]]
    address: BrainAddress
    metrics_port: int
    logs: Path


def node_ids(table: RoutingTable | None) -> set[str]:
    return {n.node_id for n in llm_nodes(table)} if table is not None else set()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("e2e")
    ingest = f"tcp://127.0.0.1:{free_port()}"
    address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    metrics_port = free_port()
    brain = prism(
        [
            "brain",
            "--ingest",
            ingest,
            "--updates",
            address.updates,
            "--snapshot",
            address.snapshot,
            "--metrics-port",
            str(metrics_port),
            "--state-dir",
            str(logs / "state"),
        ],
        logs / "brain.log",
    )
    agents = {
        node: prism(
            [
                "agent",
                "--node-id",
                node,
                "--brain",
                ingest,
                "--period",
                "0.5",
                "--endpoint",
                f"http://127.0.0.1:{9000 + i}",
                "--otlp-grpc-port",
                "0",
                "--otlp-http-port",
                "0",
            ],
            logs / f"{node}.log",
        )
        for i, node in enumerate(NODES)
    }
    cluster = Cluster(brain, agents, address, metrics_port, logs)
    yield cluster
    for proc in [brain, *agents.values()]:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def brain_metric(port: int, node: str, sample: str) -> float | None:
    """The value of the brain's `sample` for `node` on its /metrics, None while it has none."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    for family in text_string_to_metric_families(text):
        for point in family.samples:
            if point.name == sample and point.labels.get("node") == node:
                return point.value
    return None


def test_router_gets_a_table_with_all_agents(cluster: Cluster) -> None:
    with Router.connect(cluster.address) as router:
        wait_for(lambda: node_ids(router.table) == set(NODES), 30, "a table with all three agents")
        owners = {router.route(k).node_id for k in KEYS}
        assert owners == set(NODES)
        assert router.route("prefix-1").address.startswith("http://127.0.0.1:90")


def test_ebpf_counter_sees_connections_the_test_makes(cluster: Cluster) -> None:
    require_ebpf()
    wait_for(lambda: brain_metric(cluster.metrics_port, "node-a", CONNECTS) is not None, 20, "eBPF counter")
    before = brain_metric(cluster.metrics_port, "node-a", CONNECTS)
    assert before is not None
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        for _ in range(40):
            with socket.create_connection(listener.getsockname()):
                pass
    wait_for(
        lambda: (brain_metric(cluster.metrics_port, "node-a", CONNECTS) or 0) >= before + 40,
        10,
        "the connect counter to count the test's 40 connections",
    )


def test_only_the_killed_nodes_keys_move(cluster: Cluster) -> None:
    with Router.connect(cluster.address) as router:
        wait_for(lambda: node_ids(router.table) == set(NODES), 30, "a table with all three agents")
        before_table = router.table
        assert before_table is not None
        before = {k: Router.from_table(before_table).route(k).node_id for k in KEYS}
        cluster.agents["node-c"].send_signal(signal.SIGKILL)
        wait_for(lambda: node_ids(router.table) == {"node-a", "node-b"}, 15, "node-c to leave the table")
        after_table = router.table
        assert after_table is not None and after_table.order > before_table.order
        after = {k: Router.from_table(after_table).route(k).node_id for k in KEYS}
    weight = {n.node_id: n.weight for n in llm_nodes(before_table)}
    reweighted = {n.node_id for n in llm_nodes(after_table) if n.weight != weight[n.node_id]}
    moved = {k for k in KEYS if before[k] != after[k]}
    on_c = {k for k in KEYS if before[k] == "node-c"}
    assert on_c and on_c <= moved, "every key of the killed node must move"
    unexplained = {k for k in moved - on_c if not {before[k], after[k]} & reweighted}
    assert not unexplained, f"{len(unexplained)} keys moved between surviving nodes"
    if not reweighted:
        assert moved == on_c


def test_router_keeps_last_table_when_brain_is_gone(cluster: Cluster) -> None:
    with Router.connect(cluster.address, brain_timeout_s=1.0) as router:
        wait_for(lambda: router.table is not None, 10, "a table")
        cluster.brain.send_signal(signal.SIGTERM)
        assert cluster.brain.wait(timeout=10) == 0, "the brain exits cleanly on SIGTERM"
        # A table the brain sent just before it stopped crosses loopback in well under 0.3 s.
        wait_for(lambda: (router.last_heard_age_s or 0) > 0.3, 10, "0.3 s without a message from the brain")
        table = router.table
        assert table is not None
        wait_for(
            lambda: not any(b["live"] for b in router.brains().values()), 10, "the router to find the brain silent"
        )
        assert router.table is table
        assert router.route("prefix-1").node_id in node_ids(table)
        age = router.last_heard_age_s
        assert age is not None and age > 1.0


def test_agents_exit_cleanly_on_sigterm(cluster: Cluster) -> None:
    for node in ("node-a", "node-b"):
        proc = cluster.agents[node]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    log = (cluster.logs / "brain.log").read_text()
    assert "node node-c stale" in log


def test_packages_live_only_under_prismlb(tmp_path: Path) -> None:
    def run(code: str) -> int:
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True).returncode

    for name in ("agent", "brain", "router", "wire", "cli"):
        assert run(f"import {name}") != 0, f"top-level module {name!r} must not be importable"
    assert run("import prismlb.router, prismlb.agent, prismlb.brain, prismlb.wire, prismlb.otel, prismlb.sim") == 0
