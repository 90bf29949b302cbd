"""The process helpers the demo and the benches share: waiting for a child to serve, and its logs' tails."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from prismlb.demo import Cluster, log_tails, wait_healthy

from ._helpers_http import QuietHandler
from .conftest import free_port


class _Health(QuietHandler):
    """`/health` answers 200 once the server's `healthy` is set, 503 before."""

    server: _Server

    def do_GET(self) -> None:
        self.reply(200 if self.path == "/health" and self.server.healthy.is_set() else 503, b"")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Health)
        self.healthy = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}/health"


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    threading.Thread(target=s.serve_forever, args=(0.02,), daemon=True).start()
    yield s
    s.shutdown()
    s.server_close()


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
