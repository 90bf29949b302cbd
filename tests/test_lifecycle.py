"""Services own what they open: a start that fails part way closes what it had opened, and one close that
fails does not keep the others from running (agent, brain, the replay's Prism policy)."""

from __future__ import annotations

import dataclasses
import errno
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import prismlb.agent._agent as agent_module
from prismlb.agent import Agent, AgentConfig
from prismlb.agent._ebpf import ConnectCounter
from prismlb.brain import Brain, BrainConfig
from prismlb.sim._prism import PrismPolicy
from prismlb.wire import ConfigError

from .conftest import free_port, require_ebpf, wait_for

_OTEL_VARIABLES = [
    f"OTEL_EXPORTER_OTLP_{signal}{setting}"
    for signal in ("", "TRACES_", "METRICS_", "LOGS_")
    for setting in ("ENDPOINT", "PROTOCOL")
]


def bound(port: int) -> bool:
    """Whether a socket holds 127.0.0.1:`port` (listening or not): binding it without SO_REUSEADDR fails then."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return True
    return False


@pytest.fixture
def left_running() -> Callable[[], list[str]]:
    """The `prism-*` threads started since the test began that are still running once given 10 s to end."""
    before = set(threading.enumerate())

    def names() -> list[str]:
        return [t.name for t in threading.enumerate() if t not in before and t.name.startswith("prism-")]

    def left() -> list[str]:
        wait_for(lambda: not names())
        return names()

    return left


@pytest.fixture
def no_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in _OTEL_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def agent_config(**overrides: object) -> AgentConfig:
    settings: dict[str, object] = {
        "node_id": "gpu-1",
        "host": "gpu-1.local",
        "endpoint": "http://gpu-1.local:8000",
        "brain": f"tcp://127.0.0.1:{free_port()}",
        "period_s": 0.2,
        "metrics_port": free_port(),
        "metrics_addr": "127.0.0.1",
        "otlp_host": "127.0.0.1",
        "otlp_grpc_port": free_port(),
        "otlp_http_port": free_port(),
    }
    return AgentConfig(**(settings | overrides))  # type: ignore[arg-type]


def test_agent_start_failing_after_ebpf_and_otlp_closes_them_all(
    monkeypatch: pytest.MonkeyPatch, no_upstream: None, left_running: Callable[[], list[str]]
) -> None:
    """/metrics served, the eBPF program attached, the OTLP/HTTP receiver bound and the span join and forwarder
    running; then the metrics upstream turns out to be the agent's own receiver: every one of them is closed."""
    require_ebpf()
    config = agent_config(otlp_grpc_port=0)  # gRPC off: a gRPC server never started keeps its port listening
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{config.otlp_http_port}/v1/metrics")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
    closed: list[ConnectCounter] = []
    real_close = ConnectCounter.close

    def close(counter: ConnectCounter) -> None:
        closed.append(counter)
        real_close(counter)

    monkeypatch.setattr(ConnectCounter, "close", close)
    registry = CollectorRegistry()
    agent = Agent(config, registry)
    with pytest.raises(ConfigError, match="own OTLP receiver"):
        agent.run(threading.Event())
    assert len(closed) == 1, "the eBPF counter was closed"
    assert registry.get_sample_value("prism_agent_ebpf_up") == 0
    for port in (config.metrics_port, config.otlp_http_port):
        assert not bound(port), f"port {port} still open"
    assert left_running() == []  # the span join and the span forwarder


def test_agent_start_failing_right_after_metrics_frees_the_metrics_port(
    monkeypatch: pytest.MonkeyPatch, no_upstream: None, left_running: Callable[[], list[str]]
) -> None:
    def failing_probe(*_args: object) -> tuple[ConnectCounter | None, str]:
        raise OSError("bpf(BPF_PROG_LOAD): cannot allocate memory")

    monkeypatch.setattr(agent_module, "probe_ebpf", failing_probe)
    config = agent_config()
    with pytest.raises(OSError, match="cannot allocate memory"):
        Agent(config, CollectorRegistry()).run(threading.Event())
    assert not bound(config.metrics_port)
    assert left_running() == []


def brain_config(tmp_path: Path, **overrides: object) -> BrainConfig:
    settings: dict[str, object] = {
        "ingest": f"tcp://127.0.0.1:{free_port()}",
        "updates": f"tcp://127.0.0.1:{free_port()}",
        "snapshot": f"tcp://127.0.0.1:{free_port()}",
        "state_dir": tmp_path,
        "metrics_port": free_port(),
        "metrics_addr": "127.0.0.1",
        "admin_port": free_port(),
        "train_budget_s": 0.0,
        "scale_hook": "true",  # the guardian's hook thread: the brain's own, closed by `Brain.close`
    }
    return BrainConfig(**(settings | overrides))  # type: ignore[arg-type]


def brain_ports(config: BrainConfig) -> list[int]:
    return [int(endpoint.rsplit(":", 1)[1]) for endpoint in (config.ingest, config.updates, config.snapshot)]


def test_brain_start_failing_at_metrics_closes_its_sockets_and_itself(
    tmp_path: Path, left_running: Callable[[], list[str]]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = brain_config(tmp_path, metrics_port=taken.getsockname()[1])
        brain = Brain(config, CollectorRegistry())
        assert "prism-scale-hook" in {t.name for t in threading.enumerate()}
        with pytest.raises(OSError):
            brain.run(threading.Event())
    for port in [*brain_ports(config), config.admin_port]:
        assert not bound(port), f"port {port} still open"
    assert left_running() == []  # the scale-out hook's thread


def test_brain_closing_goes_on_past_a_close_that_fails(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    left_running: Callable[[], list[str]],
) -> None:
    config = brain_config(tmp_path)
    brain = Brain(config, CollectorRegistry())

    def failing_close() -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(brain.history, "close", failing_close)
    stop = threading.Event()
    stop.set()  # up, then straight down
    with caplog.at_level("INFO", logger="prism.brain"), pytest.raises(OSError, match="no space left"):
        brain.run(stop)
    for port in [*brain_ports(config), config.metrics_port, config.admin_port]:
        assert not bound(port), f"port {port} still open"
    assert left_running() == []
    assert "brain stopped at table version" in caplog.text, "the steps after the failing one ran"


def test_prism_policy_close_closes_its_brain(left_running: Callable[[], list[str]]) -> None:
    def hooked(config: BrainConfig) -> Brain:
        return Brain(dataclasses.replace(config, scale_hook="true"))

    policy = PrismPolicy(block_tokens=16, brain=hooked)
    assert "prism-scale-hook" in {t.name for t in threading.enumerate()}
    policy.close()
    assert left_running() == []
