"""The brain as a service: restart keeps history and the version order, admin API, drain, experiments."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from prometheus_client import CollectorRegistry

from prismlb.brain import Brain, BrainConfig
from prismlb.brain._admin import AdminAccess, load_token
from prismlb.brain._ctl import call, render
from prismlb.cli import main as prism
from prismlb.router import Router
from prismlb.wire import BrainAddress, ModalityLatency, NodeMetrics, NodeVector, RoutingTable, VectorSender

from .conftest import free_port, wait_for


class Running:
    def __init__(self, config: BrainConfig) -> None:
        self.brain = Brain(config, CollectorRegistry())
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.brain.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def end(self) -> None:
        self.stop.set()
        self.thread.join(timeout=20)
        assert not self.thread.is_alive()


def config(state: Path | None) -> BrainConfig:
    return BrainConfig(
        ingest=f"tcp://127.0.0.1:{free_port()}",
        updates=f"tcp://127.0.0.1:{free_port()}",
        snapshot=f"tcp://127.0.0.1:{free_port()}",
        state_dir=state,
        admin_port=free_port(),
        train_budget_s=0.0,
    )


def vector(node: str, seq: int, version: str = "v1") -> NodeVector:
    return NodeVector(
        node_id=node,
        host="h",
        endpoint=f"http://{node}:8000",
        labels={"gpu": "a100", "model_version": version},
        seq=seq,
        sample_time_unix_s=time.time(),
        period_s=0.5,
        metrics=NodeMetrics(cpu_util_ratio=0.1, requests_running=1, requests_waiting=0),
        latency={"llm": ModalityLatency(requests=10, ttft_p99_ms=200.0)},
    )


def feed(ctx: zmq.Context, cfg: BrainConfig, nodes: dict[str, str], until: threading.Event) -> threading.Thread:
    def run() -> None:
        with VectorSender(ctx, cfg.ingest) as sender:
            seq = 0
            while not until.is_set():
                for node, version in nodes.items():
                    sender.send(vector(node, seq, version))
                seq += 1
                until.wait(0.25)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def llm_nodes(table: RoutingTable | None) -> set[str]:
    if table is None:
        return set()
    return {n.node_id for s in table.slices if s.name == "llm" for n in s.nodes}


def test_restart_keeps_history_and_a_higher_table_order(ctx: zmq.Context, tmp_path: Path) -> None:
    cfg = config(tmp_path)
    first = Running(cfg)
    stop_feed = threading.Event()
    feeder = feed(ctx, cfg, {"a": "v1", "b": "v1"}, stop_feed)
    assert wait_for(lambda: len(first.brain.history) >= 10 and first.brain.current is not None)
    order_before = first.brain.current.order  # type: ignore[union-attr]
    stop_feed.set()
    feeder.join()
    first.end()
    rows = len(first.brain.history)
    second = Running(config(tmp_path))
    try:
        assert len(second.brain.history) == rows, "the restarted brain resumes with its history"
        assert second.brain.tables.epoch > order_before[0]
    finally:
        second.end()


def test_admin_drain_experiments_and_cli(ctx: zmq.Context, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "admin.token"
    token_file.write_text("brain-service-test-token\n")
    token_file.chmod(0o600)
    cfg = dataclasses.replace(config(tmp_path), admin_access=AdminAccess(token=load_token(token_file)))
    running = Running(cfg)
    stop_feed = threading.Event()
    feeder = feed(ctx, cfg, {"a": "v1", "b": "v2"}, stop_feed)
    admin = f"http://127.0.0.1:{cfg.admin_port}"
    try:
        with Router.connect(BrainAddress(cfg.updates, cfg.snapshot)) as router:
            assert wait_for(lambda: llm_nodes(router.table) == {"a", "b"})
            status = call(admin, "GET", "/v1/status", token="brain-service-test-token")
            assert {n["node_id"] for n in status["nodes"]} == {"a", "b"}
            assert "a" in render(status) and "LLM" in render(status)

            assert prism(["ctl", "--admin", admin, "drain", "b"]) == 1, "no token: refused"
            assert "b" not in running.brain.drained
            ctl = ["ctl", "--admin", admin, "--token-file", str(token_file)]
            assert prism([*ctl, "drain", "b"]) == 0
            assert wait_for(lambda: llm_nodes(router.table) == {"a"})
            assert prism([*ctl, "undrain", "b"]) == 0
            assert wait_for(lambda: llm_nodes(router.table) == {"a", "b"})

            before = router.table
            assert prism([*ctl, "experiment", "set", "canary", "--slice", "llm", "--arm", "v1=0.9", "--arm", "v2=0"]) == 0
            assert wait_for(lambda: router.table is not None and bool(router.table.experiments))
            table = router.table
            assert table is not None and before is not None and table.order > before.order
            (experiment,) = table.experiments
            assert experiment.slice == "llm"
            assert {a.model_version: a.fraction for a in experiment.arms}["v2"] >= 0.001, "fractions clamp to 0.001"

            capsys.readouterr()
            assert prism([*ctl, "table"]) == 0
            assert json.loads(capsys.readouterr().out)["experiments"][0]["name"] == "canary"
            assert prism([*ctl, "drain", "nope"]) == 1
            assert prism(["top", "--admin", admin, "--token-file", str(token_file), "--once"]) == 0
    finally:
        stop_feed.set()
        feeder.join()
        running.end()
    assert json.loads((tmp_path / "experiments.json").read_text()), "experiments persist in the state dir"


def test_top_shows_each_nodes_published_stall_and_wait_for_cache_room() -> None:
    lossy = {"node_id": "lossy", "health": 0.9, "stall_ms": 40.0, "admit_ms": 2000.0}
    status = {"nodes": [lossy, {"node_id": "sound", "health": 1.0}]}
    header, lossy_line, sound_line = render(status).splitlines()[2:]
    stall, admit = header.index("STALL"), header.index("ADMIT")
    assert lossy_line[stall : stall + 5].strip() == "40" and sound_line[stall : stall + 5].strip() == "-"
    assert lossy_line[admit : admit + 5].strip() == "2000" and sound_line[admit : admit + 5].strip() == "-"
