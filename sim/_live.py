"""Live brains and their surroundings for tests, the soak and fault drills: real `prism brain` processes
on loopback, simulated agents that push real node vectors over ZeroMQ, and route probes on real routers.

Nothing here is a stand-in for a Prism part: the brains are the service as systemd runs it, the routers the
library callers embed; only the agents are simulated (they send what an agent sends, without a GPU host).
"""

from __future__ import annotations

import collections
import contextlib
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from prismlb.demo import free_port, spawn
from prismlb.router import Router
from prismlb.wire import (
    BrainAddress,
    ClientCurve,
    ModalityLatency,
    NodeMetrics,
    NodeVector,
    ServerCurve,
    VectorSender,
    generate_keypair,
)

PERIOD_S = 0.5


@dataclass(frozen=True)
class Keys:
    """A CURVE set-up as an operator files it: one key pair the brains of a group share, one key per node (in
    the agents' folder, with the endpoint host it may advertise) and one per router (in the routers' folder)."""

    root: Path

    @classmethod
    def create(cls, root: Path, nodes: Sequence[str], routers: int) -> Keys:
        keys = cls(root)
        generate_keypair(root, "brain")
        for node in nodes:
            generate_keypair(root / "agents", node)
            (root / "agents" / f"{node}.endpoints").write_text(f"{node}:8000\n")
        for i in range(routers):
            generate_keypair(root / "routers", f"router-{i}")
        return keys

    @property
    def server(self) -> ServerCurve:
        return ServerCurve(self.root / "brain.key_secret", self.root / "agents")

    def brain_args(self) -> list[str]:
        return [
            "--curve-secret", str(self.root / "brain.key_secret"),
            "--curve-clients", str(self.root / "agents"),
            "--curve-routers", str(self.root / "routers"),
        ]  # fmt: skip

    def agent(self, node: str) -> ClientCurve:
        return ClientCurve(self.root / "agents" / f"{node}.key_secret", self.root / "brain.key")

    def router(self, index: int) -> ClientCurve:
        return ClientCurve(self.root / "routers" / f"router-{index}.key_secret", self.root / "brain.key")


@dataclass
class LiveBrain:
    """One `prism brain` process on fixed loopback ports, restartable on the same ports and state folder."""

    name: str
    root: Path
    holddown_s: float = 8.0
    priority: int = 0
    extra: Sequence[str] = ()
    ports: list[int] = field(default_factory=lambda: [free_port() for _ in range(5)])
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def ingest(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[0]}"

    @property
    def address(self) -> BrainAddress:
        return BrainAddress(f"tcp://127.0.0.1:{self.ports[1]}", f"tcp://127.0.0.1:{self.ports[2]}")

    @property
    def admin_port(self) -> int:
        return self.ports[4]

    def start(self) -> None:
        self.starts += 1
        args = [
            "-m", "prismlb.cli", "brain",
            "--ingest", self.ingest,
            "--updates", self.address.updates,
            "--snapshot", self.address.snapshot,
            "--metrics-port", str(self.ports[3]),
            "--admin-port", str(self.admin_port),
            "--state-dir", str(self.root / self.name),
            "--train-budget-s", "0",
            "--brain-id", self.name,
            "--priority", str(self.priority),
            "--holddown-s", str(self.holddown_s),
            *self.extra,
        ]  # fmt: skip
        self.process = spawn(args, self.root / f"{self.name}-{self.starts}.log")

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, as when a host dies."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def metrics(self) -> str | None:
        """The brain's /metrics text, None when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[3]}/metrics", timeout=2) as reply:
                return str(reply.read().decode())
        except OSError:
            return None

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample of the brain's /metrics, None when absent."""
        text = self.metrics()
        return None if text is None else sample(text, name, labels or {})

    def stop(self) -> None:
        if self.alive():
            assert self.process is not None
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def sample(text: str, name: str, labels: dict[str, str]) -> float | None:
    """The sample of `name` with exactly `labels` in Prometheus text."""
    for match in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if found == labels:
            return float(match.group(2))
    return None


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of `name`, by its sorted labels."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for match in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        out[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")))] = float(match.group(2))
    return out


def vector(node: str, seq: int) -> NodeVector:
    """An honest agent's vector (simulated: no GPU host behind it)."""
    return NodeVector(
        node_id=node,
        host="h",
        endpoint=f"http://{node}:8000",
        labels={"gpu": "a100"},
        seq=seq,
        sample_time_unix_s=time.time(),
        period_s=PERIOD_S,
        metrics=NodeMetrics(cpu_util_ratio=0.1, requests_running=1),
        latency={"llm": ModalityLatency(requests=10, ttft_p99_ms=200.0)},
    )


class Agents:
    """Simulated agents: each node's vector to every brain twice a period; one brain can be cut off (a
    partition) or all paused (agents late after a restart); `inject`ed raw frames go out once, to every brain,
    on sockets of their own (with `keys`, under the key of `raw_as`, a node whose agent turned hostile)."""

    def __init__(
        self,
        ctx: zmq.Context,
        ingests: Sequence[str],
        nodes: Sequence[str],
        keys: Keys | None = None,
        raw_as: str | None = None,
    ) -> None:
        self.nodes = list(nodes)
        self.paused = threading.Event()
        self.cut: set[int] = set()  # indices of brains partitioned from every agent
        self._extra: collections.deque[list[bytes]] = collections.deque()
        self._stop = threading.Event()
        # With CURVE a node's vectors must come over its own key: one sender per node and brain.
        self._senders = [
            {n: VectorSender(ctx, ingest, curve=None if keys is None else keys.agent(n)) for n in nodes}
            for ingest in ingests
        ]
        self._raw: list[zmq.Socket] = []
        for ingest in ingests:
            sock = ctx.socket(zmq.PUSH)
            sock.linger, sock.sndhwm = 0, 100
            if keys is not None and raw_as is not None:
                keys.agent(raw_as).apply(sock)
            sock.connect(ingest)
            self._raw.append(sock)
        self._thread = threading.Thread(target=self._run, name="simulated-agents", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seq = 0
        while not self._stop.wait(PERIOD_S / 2):
            if self.paused.is_set():
                continue
            seq += 1
            extra = [self._extra.popleft() for _ in range(len(self._extra))]
            for index, senders in enumerate(self._senders):
                if index in self.cut:
                    continue
                for node in list(self.nodes):
                    senders[node].send(vector(node, seq))
                for frames in extra:
                    with contextlib.suppress(zmq.Again):
                        self._raw[index].send_multipart(frames, flags=zmq.NOBLOCK)

    def inject(self, frames: list[list[bytes]]) -> None:
        """Send `frames` once, to every brain not cut off, with the next period's vectors."""
        self._extra.extend(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for senders in self._senders:
            for sender in senders.values():
                sender.close()
        for sock in self._raw:
            sock.close()


class Routes:
    """Routes attempted on a thread every few milliseconds; failures kept, and the longest the brain the router
    followed went unheard while the router routed on its table (`max_stale_s`: how long a dead leader's table
    stays in use before the router goes over to another brain, or the brain comes back)."""

    def __init__(self, router: Router, interval_s: float = 0.002) -> None:
        self.router = router
        self.attempted = 0
        self.failed: list[str] = []
        self.seen: set[str] = set()
        self.endpoints: set[str] = set()
        self.max_stale_s = 0.0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="route-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(self._interval_s):
            i += 1
            self.attempted += 1
            try:
                endpoint = self.router.route(f"key-{i % 500}")
            except Exception as exc:
                self.failed.append(repr(exc))
            else:
                self.seen.add(endpoint.node_id)
                self.endpoints.add(endpoint.address)
            if i % 25 == 0:
                self._watch_staleness()

    def _watch_staleness(self) -> None:
        age = self.router.last_heard_age_s
        if age is not None and self.router.table is not None:
            self.max_stale_s = max(self.max_stale_s, age)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def poison(node: str, identity: bool) -> list[list[bytes]]:
    """Frames no honest agent sends, under `node`'s name: each wire bound broken, NaN, a sample time ten hours
    ahead, then junk; with `identity` (CURVE on, where the brain can tell) also another endpoint and another
    node's id."""
    honest = msgspec.to_builtins(vector(node, 10**9))
    cases: list[dict[str, object]] = [
        {"metrics": {"requests_running": 2 * 10**12}},
        {"latency": {"llm": {"requests": 1, "ttft_p99_ms": 1e200}}},
        {"latency": {"llm": {"requests": 1, "ttft_p99_ms": -5.0}}},
        {"metrics": {"cpu_util_ratio": float("nan")}},
        {"sample_time_unix_s": time.time() + 36_000},
    ]
    if identity:
        cases += [{"endpoint": "http://attacker:80"}, {"node_id": "n0", "endpoint": "http://attacker:80"}]
    frames = [[b"prism.node", b"1", msgspec.msgpack.encode({**honest, **case})] for case in cases]
    return [*frames, [b"prism.node"], [b"prism.node", b"1", b"\xc1junk"], [b"prism.nope", b"1", b""]]


def nodes_of(router: Router) -> set[str]:
    table = router.table
    return set() if table is None else {n.node_id for s in table.slices for n in s.nodes}
