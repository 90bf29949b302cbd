"""The demo's child processes: the brain, and per node an emulated engine and its agent, on loopback ports.

Every child runs in its own session (Ctrl-C reaches only the demo, which stops them) and gets SIGTERM from the
kernel if the demo process dies, however it dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prismlb.wire import BrainAddress

from ._window import engine_batch_window

AGENT_PERIOD_S = 1.0


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_BELOW_EPHEMERAL = 16384  # ports handed out: this many below the ephemeral range
_handed: set[int] = set()
_draw = random.Random()


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback TCP port nothing holds now and this process has not handed out before, for a child to bind.

    It is drawn below the kernel's ephemeral range: a port from bind(0) lies inside it, where any process binding
    port 0 or connecting out may take it before the child it was meant for binds it (the brain imports torch for
    seconds first; the demo's agents bind their OTLP HTTP receivers to port 0 meanwhile). Without room below the
    range, bind(0)."""
    low = _ephemeral_low()
    first = max(1024, low - _BELOW_EPHEMERAL)
    for _ in range(256 if low - first >= 256 else 0):
        port = _draw.randrange(first, low)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In the child: SIGTERM when the demo process dies, however it dies (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def spawn(
    args: Sequence[str], log: Path, executable: str = sys.executable, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A child process in its own session (Ctrl-C reaches only the demo, which stops it), output to `log`;
    `executable` runs `args` (this Python by default; another program for a router under comparison), with `env`
    added to this process's environment."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [executable, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )


def stop(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 5.0) -> None:
    """SIGTERM each live process, wait up to `timeout_s` for all, then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, deadline: float) -> bool:
    """Whether GET `url` answers 200 before `deadline` (`time.monotonic()`): a child started is not a child
    serving. False as soon as `proc`, the child behind `url`, exits: waiting longer cannot help then."""
    import httpx  # the demo's and the benches' client; `prism` itself runs without it

    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return True
        time.sleep(0.1)
    return False


def log_tails(logs: Path, lines: int = 8) -> str:
    """The last `lines` lines of every child's log in `logs`, each under its file name: what to show when a
    child did not start or exited."""
    out = []
    for path in sorted(logs.glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(out)


def raise_interrupt(_signum: int, _frame: object) -> None:
    """A signal handler that stops the main thread as Ctrl-C does."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block, so that a script stops through its own clean-up.
    SIGINT is set explicitly: a shell without job control starts a background command with SIGINT ignored, and
    Python then leaves it ignored."""
    previous = {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class Node:
    node_id: str
    gpu: str
    engine_port: int
    kv_port: int
    otlp_port: int
    metrics_port: int
    engine: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    killed_at: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"


class Cluster:
    """The brain, and per node an emulated engine and its agent, as child processes logging into `logs`.

    `batch_window` is what every engine admits its batches through (`BATCH_WINDOWS`); `none` by default, so that
    the benches comparing routers on these engines keep engines that hand each request over on arrival."""

    def __init__(
        self, gpus: Sequence[str], time_scale: float, logs: Path, ebpf: bool, batch_window: str = "none"
    ) -> None:
        self.logs = logs
        self.time_scale = time_scale
        self.batch_window = batch_window
        self._engine_window = engine_batch_window(batch_window)
        self.ingest = f"tcp://127.0.0.1:{free_port()}"
        self.address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
        self.brain_metrics_port = free_port()
        self.admin_port = free_port()
        self.ebpf = ebpf
        self.nodes = [
            Node(f"{gpu}-{i + 1}", gpu, free_port(), free_port(), free_port(), free_port())
            for i, gpu in enumerate(gpus)
        ]
        self.brain: subprocess.Popen[bytes] | None = None

    def procs(self) -> list[subprocess.Popen[bytes]]:
        """Every child, agents first (they report to the brain), then engines, then the brain."""
        agents = [n.agent for n in self.nodes if n.agent is not None]
        engines = [n.engine for n in self.nodes if n.engine is not None]
        return [*agents, *engines, *([self.brain] if self.brain is not None else [])]

    def start(self, prism: bool = True) -> None:
        """Start the children. Without `prism` only the engines start (no brain, no agents, no OTLP export):
        a cluster for another router to balance."""
        if prism:
            self.brain = spawn(
                [
                    "-m",
                    "prismlb.cli",
                    "brain",
                    "--ingest",
                    self.ingest,
                    "--updates",
                    self.address.updates,
                    "--snapshot",
                    self.address.snapshot,
                    "--metrics-port",
                    str(self.brain_metrics_port),
                    "--admin-port",
                    str(self.admin_port),
                    "--state-dir",
                    str(self.logs / "brain-state"),
                ],
                self.logs / "brain.log",
            )
        for node in self.nodes:
            node.engine = spawn(
                [
                    "-m",
                    "prismlb.demo._engine",
                    "--gpu",
                    node.gpu,
                    "--port",
                    str(node.engine_port),
                    "--kv-events",
                    f"tcp://127.0.0.1:{node.kv_port}",
                    "--time-scale",
                    repr(self.time_scale),
                    "--batch-window",
                    self._engine_window,
                    *(["--otlp", f"http://127.0.0.1:{node.otlp_port}"] if prism else []),
                ],
                self.logs / f"engine-{node.node_id}.log",
            )
        if not prism:
            return
        for node in self.nodes:
            args = [
                "-m",
                "prismlb.cli",
                "agent",
                "--node-id",
                node.node_id,
                "--brain",
                self.ingest,
                "--endpoint",
                node.url,
                "--engine-url",
                f"{node.url}/metrics",
                "--kv-events",
                f"tcp://127.0.0.1:{node.kv_port}",
                "--otlp-grpc-port",
                str(node.otlp_port),
                "--otlp-http-port",
                "0",
                "--metrics-port",
                str(node.metrics_port),
                "--period",
                str(AGENT_PERIOD_S),
                "--trace-port",
                str(node.engine_port),
            ]
            if not self.ebpf:
                args.append("--no-ebpf")
            node.agent = spawn(args, self.logs / f"agent-{node.node_id}.log")

    def failed(self) -> str | None:
        """A description of a child that exited (other than a killed node), or None."""
        for name, proc in [("brain", self.brain)] + [
            (f"{kind} {n.node_id}", p)
            for n in self.nodes
            if n.killed_at is None
            for kind, p in (("engine", n.engine), ("agent", n.agent))
        ]:
            if proc is not None and proc.poll() is not None:
                return f"{name} exited with status {proc.returncode}"
        return None

    def kill(self, node: Node) -> None:
        """SIGKILL a node's engine and agent: the machine is gone."""
        for proc in (node.engine, node.agent):
            if proc is not None and proc.poll() is None:
                proc.kill()
        node.killed_at = time.monotonic()

    def close(self) -> None:
        stop(self.procs())

    def log_tail(self, lines: int = 8) -> str:
        return log_tails(self.logs, lines)


def metric(text: str, name: str) -> float | None:
    """The sum of a metric's samples in Prometheus text (None when absent)."""
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values) if values else None
