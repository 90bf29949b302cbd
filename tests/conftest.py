"""Shared fixtures: free loopback ports and a zmq context."""

from __future__ import annotations

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
