"""Shared fixtures: free loopback ports, a zmq context, a running brain or agent, an idle node's vector, a clock the
test moves, and waiting for a condition."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
import zmq
from prometheus_client import CollectorRegistry

from prismlb.demo import free_port
from prismlb.service import wait_until
from prismlb.wire import NodeMetrics, NodeVector

if TYPE_CHECKING:
    from prismlb.agent import Agent, AgentConfig
    from prismlb.brain import Brain

    from ._helpers_engines import Engine


class Clock:
    """A clock the test moves: called like `time.monotonic` or `time.time`, it reads `now`, which changes only
    when the test sets it, so that a test says how long something took instead of sleeping."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def prism(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`prism ARGS` (this checkout's CLI) as a subprocess, its output and errors written to `log`."""
    out = log.open("wb")
    return subprocess.Popen([sys.executable, "-m", "prismlb.cli", *args], stdout=out, stderr=subprocess.STDOUT)


def load_bench(stem: str) -> ModuleType:
    """`bench/<stem>.py` as a module (the benches are scripts, not a package), registered in `sys.modules` so
    that its dataclasses and pickled callables resolve."""
    path = Path(__file__).resolve().parent.parent / "bench" / f"{stem}.py"
    name = f"prism_bench_{stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def bench_with_variants(stem: str) -> Iterator[ModuleType]:
    """`load_bench(stem)` for a bench that registers policies of its own in the replay's `VARIANTS`: they are
    taken out again on exit, so that the other tests' ablation lists stay the library's."""
    from prismlb.sim._ablations import VARIANTS

    before = dict(VARIANTS)
    try:
        yield load_bench(stem)
    finally:
        VARIANTS.clear()
        VARIANTS.update(before)


def idle_vector(node_id: str, endpoint: str, seq: int = 0, host: str = "h") -> NodeVector:
    """A vector of a healthy node with nothing running: what a brain needs to put the node in its table."""
    return NodeVector(
        node_id=node_id,
        host=host,
        endpoint=endpoint,
        seq=seq,
        sample_time_unix_s=time.time(),
        period_s=1.0,
        metrics=NodeMetrics(cpu_util_ratio=0.1, requests_running=0, requests_waiting=0),
    )


def wait_for(check: Callable[[], object], timeout_s: float = 10.0, what: str | None = None) -> bool:
    """Poll `check` every 5 ms until it holds or `timeout_s` passes; its last answer (assert on it), or with `what`
    an AssertionError naming what never came."""
    if wait_until(check, timeout_s):
        return True
    if what is not None:
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
    return False


@contextlib.contextmanager
def serving(run: Callable[[threading.Event], object], join_timeout_s: float = 20.0) -> Iterator[threading.Thread]:
    """`run(stop)`, a service's main loop, in a thread; on the way out `stop` is set and the thread joined."""
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(timeout=join_timeout_s)


@contextlib.contextmanager
def running_brain(**config: Any) -> Iterator[Brain]:
    """The brain service in a thread on fresh loopback ports (no admin port, no training, 50 ms cycles unless
    `config` says otherwise), stopped on the way out, its thread checked to have ended."""
    from prismlb.brain import Brain, BrainConfig

    defaults: dict[str, Any] = {
        "ingest": f"tcp://127.0.0.1:{free_port()}",
        "updates": f"tcp://127.0.0.1:{free_port()}",
        "snapshot": f"tcp://127.0.0.1:{free_port()}",
        "train_budget_s": 0.0,
        "admin_port": 0,
        "cycle_s": 0.05,
    }
    brain = Brain(BrainConfig(**(defaults | config)), CollectorRegistry())
    with serving(brain.run) as thread:
        yield brain
    assert not thread.is_alive()


@contextlib.contextmanager
def running_agent(config: AgentConfig, registry: CollectorRegistry | None = None) -> Iterator[Agent]:
    """`config`'s agent service in a thread, stopped on the way out (its thread joined)."""
    from prismlb.agent import Agent

    agent = Agent(config, CollectorRegistry() if registry is None else registry)
    with serving(agent.run, join_timeout_s=15):
        yield agent


@contextlib.contextmanager
def reporting_agent(
    ctx: zmq.Context, registry: CollectorRegistry | None = None, **settings: Any
) -> Iterator[tuple[Agent, zmq.Socket]]:
    """An agent in a thread (`running_agent`) and the PULL socket its vectors reach, bound on a free loopback port
    as the brain's ingest: 0.25 s periods, no eBPF and no OTLP ports unless `settings` says otherwise. The agent
    is stopped, then the socket closed, on the way out."""
    from prismlb.agent import AgentConfig

    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    defaults: dict[str, Any] = {
        "node_id": "test-node",
        "brain": f"tcp://127.0.0.1:{port}",
        "period_s": 0.25,
        "ebpf": False,
        "otlp_grpc_port": 0,
        "otlp_http_port": 0,
    }
    try:
        with running_agent(AgentConfig(**(defaults | settings)), registry) as agent:
            yield agent, pull
    finally:
        pull.close(linger=0)


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def require_ebpf() -> None:
    """Skip, saying why, only where eBPF is truly unavailable: not root, no bcc, no tracefs. CI has all three."""
    if os.geteuid() != 0:
        pytest.skip(f"eBPF needs root; running as uid {os.geteuid()}")
    try:
        importlib.import_module("bcc")
    except (ImportError, OSError) as exc:
        pytest.skip(f"bcc is not importable ({exc}); apt-get install python3-bpfcc")
    if not os.path.exists("/sys/kernel/tracing/events/syscalls/sys_enter_connect"):
        pytest.skip("tracefs is not mounted (make test's set-up mounts it as root)")


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    """Two OpenAI-compatible engines on loopback (`tests/_helpers_engines.py`), gpu-a and gpu-b."""
    from ._helpers_engines import Engine
    from ._helpers_http import serving_http

    pair = (Engine("gpu-a"), Engine("gpu-b"))
    with serving_http(*pair):
        try:
            yield pair
        finally:
            for engine in pair:
                engine.gate.set()  # a request held at the gate ends, so its thread does not outlive the test
