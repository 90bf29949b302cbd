"""The process helpers the demo and the benches share: waiting for a child to serve, and its logs' tails."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prismlb.demo import Cluster, log_tails, wait_healthy

from ._helpers_http import LoopbackServer, QuietHandler, serving_http
from .conftest import free_port


class _Health(QuietHandler):
    """`/health` answers 200 once the server's `healthy` is set, 503 before."""

    server: _Server

    def do_GET(self) -> None:
        self.reply(200 if self.path == "/health" and self.server.healthy.is_set() else 503, b"")


class _Server(LoopbackServer):
    def __init__(self) -> None:
        super().__init__(_Health)
        self.healthy = threading.Event()
        self.url = f"{self.address}/health"


@pytest.fixture
def server() -> Iterator[_Server]:
    with serving_http(_Server(), poll_s=0.02) as (s,):
        yield s


def test_a_child_that_answers_200_is_healthy(server: _Server) -> None:
    server.healthy.set()
    assert wait_healthy(server.url, None, time.monotonic() + 10)


def test_a_child_that_keeps_answering_503_is_not_healthy_by_the_deadline(server: _Server) -> None:
    deadline = time.monotonic() + 0.3
    assert not wait_healthy(server.url, None, deadline)
    assert time.monotonic() >= deadline


def test_a_child_turning_healthy_while_waited_for_is_healthy(server: _Server) -> None:
    threading.Timer(0.2, server.healthy.set).start()
    assert wait_healthy(server.url, None, time.monotonic() + 10)


def test_a_child_that_exited_is_not_waited_for() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    deadline = time.monotonic() + 60
    assert not wait_healthy(f"http://127.0.0.1:{free_port()}/health", child, deadline)
    assert time.monotonic() < deadline


def test_log_tails_show_each_logs_last_lines_under_its_name(tmp_path: Path) -> None:
    (tmp_path / "engine-a.log").write_text("".join(f"line {i}\n" for i in range(10)))
    (tmp_path / "brain.log").write_bytes(b"started\n\xffbad byte\n")
    (tmp_path / "notes.txt").write_text("not a log\n")
    assert log_tails(tmp_path, 2) == "--- brain.log\nstarted\n\ufffdbad byte\n--- engine-a.log\nline 8\nline 9"
    assert (
        Cluster(["h100"], 1.0, tmp_path, ebpf=False).log_tail(1)
        == "--- brain.log\n\ufffdbad byte\n--- engine-a.log\nline 9"
    )
    assert log_tails(tmp_path / "empty") == ""


def test_free_ports_come_from_below_the_ephemeral_range_once_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port bind(0) or an outgoing connection could take before the child binds it is never handed out: ports
    come from below the kernel's ephemeral range, a held one is passed over, none twice; without room, bind(0)."""
    from prismlb.demo import _processes

    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("30000\t60999\n")
    monkeypatch.setattr(_processes, "EPHEMERAL_RANGE", ranges)
    monkeypatch.setattr(_processes, "_handed", set())
    monkeypatch.setattr(_processes, "_draw", random.Random(7))
    first = random.Random(7).randrange(30000 - 16384, 30000)
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))
        ports = [free_port() for _ in range(64)]
    assert first not in ports
    assert all(30000 - 16384 <= port < 30000 for port in ports)
    assert len(set(ports)) == len(ports)
    ranges.write_text("1100\t60999\n")  # no room below: the kernel's choice
    assert free_port() >= 1100
