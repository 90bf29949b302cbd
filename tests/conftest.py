"""Shared fixtures: free loopback ports and a zmq context."""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Iterator

import pytest
import zmq


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
