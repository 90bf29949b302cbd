"""Shared fixtures: free loopback ports, a zmq context, a running brain, and waiting for a condition."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import socket
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

if TYPE_CHECKING:
    from prismlb.brain import Brain


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def wait_for(check: Callable[[], object], timeout_s: float = 10.0, what: str | None = None) -> bool:
    """Poll `check` every 5 ms until it holds or `timeout_s` passes; its last answer (assert on it), or with `what`
    an AssertionError naming what never came."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.005)
    if check():
        return True
    if what is not None:
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
    return False


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
    stop = threading.Event()
    thread = threading.Thread(target=brain.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield brain
    finally:
        stop.set()
        thread.join(timeout=20)
    assert not thread.is_alive()


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
