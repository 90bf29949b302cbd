"""The agent end to end over a real ZeroMQ socket, its settings, and its CLI entry."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from prometheus_client import CollectorRegistry

from prismlb.agent import Agent, AgentConfig, add_parser, check, resolve_config
from prismlb.wire import (
    MAX_VECTOR_BYTES,
    ClientCurve,
    ConfigError,
    NodeVector,
    ServerCurve,
    decode,
    generate_keypair,
    start_authenticator,
)

from .conftest import require_ebpf, wait_for

PERIOD_S = 0.2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prism")
    add_parser(parser.add_subparsers(required=True))
    return parser


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["agent", *argv])


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


class _Running:
    """An Agent's run() in a thread, with the error it raised, if any."""

    def __init__(self, agent: Agent) -> None:
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(agent,), daemon=True)
        self._thread.start()

    def _run(self, agent: Agent) -> None:
        try:
            agent.run(self.stop)
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    def end(self) -> float:
        """Set stop and return how long run() took to return."""
        started = time.monotonic()
        self.stop.set()
        self._thread.join(timeout=5)
        assert not self._thread.is_alive(), "run() did not return after stop"
        if self.error is not None:
            raise self.error
        return time.monotonic() - started


def _receive(pull: zmq.Socket, count: int) -> list[tuple[NodeVector, bytes]]:
    """`count` vectors, each with its raw payload; fails after 5 s."""
    pull.rcvtimeo = 5000
    out = []
    for _ in range(count):
        frames = pull.recv_multipart()
        out.append((decode(frames, (NodeVector,), MAX_VECTOR_BYTES), frames[2]))
    return out


def _pull(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    return pull, f"tcp://127.0.0.1:{port}"


def _config(brain: str, **overrides: object) -> AgentConfig:
    settings: dict[str, object] = {
        "node_id": "gpu-7",
        "host": "gpu-7.local",
        "endpoint": "http://gpu-7.local:8000",
        "brain": brain,
        "zone": "eu-1a",
        "labels": {"pool": "h100"},
        "period_s": PERIOD_S,
        "otlp_grpc_port": 0,
        "otlp_http_port": 0,
    }
    settings.update(overrides)
    return AgentConfig(**settings)  # type: ignore[arg-type]


def _assert_stream(vectors: list[NodeVector]) -> None:
    seqs = [v.seq for v in vectors]
    assert seqs == sorted(set(seqs)), seqs
    assert seqs[0] == 0
    for vector in vectors:
        assert (vector.node_id, vector.host, vector.endpoint) == ("gpu-7", "gpu-7.local", "http://gpu-7.local:8000")
        assert (vector.zone, vector.labels, vector.period_s) == ("eu-1a", {"pool": "h100"}, PERIOD_S)
        assert abs(vector.sample_time_unix_s - time.time()) < 30
        metrics = vector.metrics
        assert metrics.cpu_util_ratio is not None and 0.0 <= metrics.cpu_util_ratio <= 1.0
        assert metrics.mem_total_bytes is not None and metrics.mem_total_bytes > 0
        assert metrics.mem_used_bytes is not None and 0 < metrics.mem_used_bytes <= metrics.mem_total_bytes


def test_vectors_carry_connect_calls_and_tcp_health_with_ebpf(ctx: zmq.Context) -> None:
    require_ebpf()
    pull, brain = _pull(ctx)
    registry = CollectorRegistry()
    running = _Running(Agent(_config(brain), registry=registry))
    received = _receive(pull, 2)
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.socket() as closed:
        for _ in range(5):
            socket.create_connection(listener.getsockname(), timeout=2).close()
        closed.bind(("127.0.0.1", 0))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(closed.getsockname(), timeout=2)
    connects_done = time.time()
    # the handshakes reach the window through the tracer's polling thread: a vector or two later
    while received[-1][0].sample_time_unix_s <= connects_done + 2 * PERIOD_S:
        received += _receive(pull, 1)
    assert running.end() < 2.0
    vectors = [v for v, _ in received]
    _assert_stream(vectors)
    calls = [v.metrics.connect_calls_total for v in vectors]
    assert all(c is not None for c in calls), calls
    assert calls[-1] - calls[1] >= 6  # type: ignore[operator]
    # every window is measured (rates of 0 included); handshakes and the refused connect show up in some
    assert all(v.metrics.tcp_resets_per_s is not None and v.metrics.tcp_refused_per_s is not None for v in vectors)
    assert any(v.metrics.tcp_handshake_p95_ms is not None for v in vectors[2:])
    assert any((v.metrics.tcp_refused_per_s or 0.0) > 0.0 for v in vectors[2:])
    assert registry.get_sample_value("prism_agent_ebpf_up") == 0  # detached at exit
    sent = registry.get_sample_value("prism_agent_vectors_sent_total")
    assert sent is not None and sent >= len(vectors)


def test_without_ebpf_connect_calls_and_tcp_health_are_absent(ctx: zmq.Context) -> None:
    pull, brain = _pull(ctx)
    registry = CollectorRegistry()
    running = _Running(Agent(_config(brain, ebpf=False), registry=registry))
    received = _receive(pull, 3)
    assert running.end() < 2.0
    _assert_stream([v for v, _ in received])
    for vector, payload in received:
        assert vector.metrics.connect_calls_total is None
        assert b"connect_calls_total" not in payload and b"tcp_" not in payload  # not measured, so absent
        # no GPU on this machine: every GPU dimension is absent from the wire, never 0
        assert vector.gpus == [] and vector.metrics.gpu_count is None
        assert b"gpu_" not in payload and b"nvlink" not in payload
        assert vector.started_unix_s is not None
        assert b"health" not in payload and b"alarms" not in payload, "measurements only: the brain judges health"
    assert registry.get_sample_value("prism_agent_ebpf_up") == 0
    assert registry.get_sample_value("prism_agent_node_connect_calls_total") is None


def test_unloadable_ebpf_logs_one_line_and_keeps_reporting(
    ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    pull, brain = _pull(ctx)
    with caplog.at_level(logging.INFO, logger="prism.agent"):
        running = _Running(Agent(_config(brain)))
        received = _receive(pull, 3)
        running.end()
    assert all(v.metrics.connect_calls_total is None for v, _ in received)
    ebpf_lines = [r.getMessage() for r in caplog.records if "eBPF" in r.getMessage()]
    assert len(ebpf_lines) == 1 and "run as root" in ebpf_lines[0], ebpf_lines
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("started:") for m in messages)
    assert any(m.startswith("stopping:") for m in messages)


def test_agent_speaks_curve_when_configured(ctx: zmq.Context, tmp_path: Path) -> None:
    server_public, server_secret = generate_keypair(tmp_path / "server", "brain")
    _client_public, client_secret = generate_keypair(tmp_path / "clients", "agent")
    server = ServerCurve(secret_file=server_secret, authorized_dir=tmp_path / "clients")
    auth = start_authenticator(ctx, server)
    try:
        pull = ctx.socket(zmq.PULL)
        pull.linger = 0
        server.apply(pull)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        curve = ClientCurve(secret_file=client_secret, server_public_file=server_public)
        running = _Running(Agent(_config(f"tcp://127.0.0.1:{port}", ebpf=False, curve=curve)))
        received = _receive(pull, 2)
        running.end()
    finally:
        auth.stop()
    assert [v.seq for v, _ in received] == [0, 1]


def test_full_queue_counts_drops(ctx: zmq.Context) -> None:
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    brain = f"tcp://127.0.0.1:{port.getsockname()[1]}"
    port.close()  # nobody listens: the 64-slot queue fills, then vectors are dropped
    registry = CollectorRegistry()
    running = _Running(Agent(_config(brain, ebpf=False, period_s=0.001), registry=registry))
    wait_for(
        lambda: (registry.get_sample_value("prism_agent_vectors_dropped_total") or 0) > 0,
        5.0,
        "a drop counted with the brain away",
    )
    running.end()
    assert registry.get_sample_value("prism_agent_vectors_sent_total") == 64


@pytest.mark.parametrize(
    ("argv", "environ", "field", "expected"),
    [
        (["--node-id", "arg-node"], {"PRISM_NODE_ID": "env-node"}, "node_id", "arg-node"),
        ([], {"PRISM_NODE_ID": "env-node"}, "node_id", "env-node"),
        ([], {}, "node_id", socket.gethostname()),
        (["--endpoint", "http://a:1"], {"PRISM_ENDPOINT": "http://e:2"}, "endpoint", "http://a:1"),
        ([], {"PRISM_ENDPOINT": "https://e:2"}, "endpoint", "https://e:2"),
        ([], {}, "endpoint", f"http://{socket.gethostname()}:8000"),
        (["--brain", "tcp://b:1"], {"PRISM_BRAIN_INGEST": "tcp://e:2"}, "brain", "tcp://b:1"),
        ([], {"PRISM_BRAIN_INGEST": "ipc:///run/prism/ingest"}, "brain", "ipc:///run/prism/ingest"),
        ([], {}, "brain", "tcp://127.0.0.1:5555"),
        (["--zone", "a"], {"PRISM_ZONE": "e"}, "zone", "a"),
        ([], {"PRISM_ZONE": "e"}, "zone", "e"),
        ([], {}, "zone", ""),
        (["--label", "a=1", "--label", "b="], {"PRISM_LABELS": "c=3"}, "labels", {"a": "1", "b": ""}),
        ([], {"PRISM_LABELS": "c=3, d=x=y"}, "labels", {"c": "3", "d": "x=y"}),
        ([], {}, "labels", {}),
        (["--period", "0.5"], {"PRISM_PERIOD_S": "2"}, "period_s", 0.5),
        ([], {"PRISM_PERIOD_S": "2"}, "period_s", 2.0),
        ([], {}, "period_s", 1.0),
        (["--metrics-port", "9100"], {"PRISM_AGENT_METRICS_PORT": "9200"}, "metrics_port", 9100),
        ([], {"PRISM_AGENT_METRICS_PORT": "9200"}, "metrics_port", 9200),
        ([], {}, "metrics_port", 0),
        (["--no-ebpf"], {}, "ebpf", False),
        ([], {}, "ebpf", True),
        (["--metrics-addr", "0.0.0.0"], {}, "metrics_addr", "0.0.0.0"),
        ([], {}, "metrics_addr", "0.0.0.0"),
        (["--host", "h1"], {}, "host", "h1"),
        ([], {}, "host", socket.gethostname()),
    ],
)
def test_argument_beats_env_beats_default(
    argv: list[str], environ: dict[str, str], field: str, expected: object
) -> None:
    assert getattr(resolve_config(_args(*argv), environ), field) == expected


def test_curve_files_from_env_and_arguments(tmp_path: Path) -> None:
    public, secret = generate_keypair(tmp_path, "agent")
    config = resolve_config(_args("--curve-secret", str(secret)), {"PRISM_BRAIN_PUBLIC": str(public)})
    assert config.curve == ClientCurve(secret_file=secret, server_public_file=public)
    assert resolve_config(_args(), {}).curve is None


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--node-id=-leading-dash"], {}, "node id"),
        ([], {"PRISM_NODE_ID": "has space"}, "PRISM_NODE_ID"),
        (["--node-id", "n" * 129], {}, "node id"),
        (["--host", "h" * 300], {}, "--host"),
        (["--period", "0"], {}, "--period"),
        (["--period", "-1"], {}, "--period"),
        ([], {"PRISM_PERIOD_S": "nan"}, "PRISM_PERIOD_S"),
        ([], {"PRISM_PERIOD_S": "soon"}, "PRISM_PERIOD_S"),
        ([], {"PRISM_PERIOD_S": "7200"}, "PRISM_PERIOD_S"),
        (["--label", "novalue"], {}, "malformed label"),
        (["--label", "=v"], {}, "malformed label"),
        (["--label", "a=1", "--label", "a=2"], {}, "given twice"),
        ([], {"PRISM_LABELS": "a=1,b"}, "malformed label"),
        (["--label", "k" * 65 + "=v"], {}, "labels"),
        (["--endpoint", "gpu-7:8000"], {}, "--endpoint"),
        ([], {"PRISM_ENDPOINT": "ftp://gpu-7:8000"}, "PRISM_ENDPOINT"),
        (["--endpoint", "http://gpu-7:99999"], {}, "--endpoint"),
        (["--brain", "http://brain:5555"], {}, "--brain"),
        ([], {"PRISM_BRAIN_INGEST": "tcp://brain"}, "PRISM_BRAIN_INGEST"),
        (["--brain", "brain:5555"], {}, "--brain"),
        (["--metrics-port", "70000"], {}, "--metrics-port"),
        ([], {"PRISM_AGENT_METRICS_PORT": "ninety"}, "PRISM_AGENT_METRICS_PORT"),
        (["--metrics-addr", ""], {}, "--metrics-addr"),
        (["--curve-secret", "/etc/hostname"], {}, "--curve-secret given alone"),
        ([], {"PRISM_BRAIN_PUBLIC": "/etc/hostname"}, "PRISM_BRAIN_PUBLIC given alone"),
        (["--curve-secret", "/nonexistent/a", "--brain-public", "/etc/hostname"], {}, "does not exist"),
    ],
)
def test_invalid_settings_raise_config_error(argv: list[str], environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_config(_args(*argv), environ)


def test_cli_check_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["agent", "--check"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(check())
    assert all(line.split()[0] in ("ok", "no") for line in lines)


def test_cli_bad_setting_exits_two_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["agent", "--period", "0"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--period" in err
