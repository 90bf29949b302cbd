"""Ingest sharded over worker processes (`--ingest-workers N`), for fleets whose vectors one interpreter cannot
decode in time.

Agents still PUSH to one PULL endpoint. libzmq's steerable proxy, in a process of its own (so that receiving the
agents' TCP traffic costs the brain's process nothing), fans their messages out PULL → PUSH to N worker processes
over ipc; each worker decodes and fully validates its share (`wire.decode`), counts rejects, and forwards the valid
payloads (vectors, and the agents' `KvBlocks`) in batches of up to BATCH_VECTORS to the brain's PULL socket, one
message per batch; the brain decodes each batch with one call. What moves off the brain's process is the TCP
receive, one receive call per vector, the first validation and the reject handling; what stays is building the
vector objects, the registry (health) and history. The proxy and the workers end when the brain's process does (they
watch their parent), so a restarted brain can bind again.

Not with CURVE: the proxy forwards the frames without the connection's `User-Id` and `Peer-Address`, so the
identity policy could not run; the configuration refuses the combination. One node's consecutive vectors may be
handled by different workers, so while the brain lags (several vectors of a node queued at once) they can reach it
out of order: the registry drops the older one as a replay, and the sequence-gap count has already counted it as
lost (bench/ingest.py: a few hundred at 5,000 nodes with a backlog, none without one). A node's `KvBlocks` can be
reordered the same way; the KV relay puts them back in order (`_kv_relay`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import zmq

from prismlb.wire import (
    MAX_VECTOR_BYTES,
    KvBlocks,
    NodeVector,
    RejectCounter,
    VectorReceiver,
    WireError,
    decode,
)

_log = logging.getLogger("prism.brain.ingest")

BATCH_VECTORS = 256
"""Vectors per message from a worker to the brain: large enough that the per-message cost vanishes."""
BATCH_WAIT_S = 0.002
"""How long a worker waits for more vectors before sending a partial batch (latency added, at most)."""
_IDLE_S = 1.0
_MAX_FRAME = VectorReceiver.OVERSIZE_COUNTED * MAX_VECTOR_BYTES + 1024


class _Batch(msgspec.Struct):
    """A worker's message to the brain: rejects by kind, and the msgpack payloads of the valid vectors and of
    the valid `KvBlocks`."""

    rejects: dict[str, int]
    vectors: list[msgspec.Raw]
    kv: list[msgspec.Raw] = []


class _DecodedBatch(msgspec.Struct):
    """`_Batch` as the brain decodes it: the payloads become vectors and KV blocks in the same call (range checks
    run again, in C, cheaply; the node-id pattern and the rejects were the worker's)."""

    rejects: dict[str, int]
    vectors: list[NodeVector]
    kv: list[KvBlocks] = []


_BATCH = msgspec.msgpack.Decoder(_DecodedBatch)


GC_THRESHOLDS = (100_000, 50, 100)


def tune_gc_for_ingest() -> None:
    """Collect the youngest generation every 100,000 net allocations instead of every 700, and freeze what the
    process holds so far (modules, torch) out of later collections.

    Every vector is a tree of about 150 objects that all live until the node's next vector, so with the default
    thresholds the collector keeps traversing and promoting them, and its full passes walk the millions of
    objects of a large fleet several times a second: at 20,000 nodes 40% of the brain's ingest CPU. Nothing in
    a vector is part of a cycle, so collecting less often only delays freeing the rare cyclic garbage."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _proxy(endpoint: str, fan_out: str, hwm: int, parent: int) -> int:
    """The proxy process: libzmq's steerable proxy from the agents' PULL to the workers' PUSH. Prints the bound
    endpoint (or `error: ...`) on its first line; ends when the brain does, so the port is freed with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    front = ctx.socket(zmq.PULL)
    front.rcvhwm = hwm
    front.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
    back = ctx.socket(zmq.PUSH)
    back.sndhwm = hwm
    control = ctx.socket(zmq.PAIR)
    control.bind("inproc://control")
    try:
        front.bind(endpoint)
        back.bind(fan_out)
    except zmq.ZMQError as exc:
        print(f"error: {exc}", flush=True)
        return 1

    def watch() -> None:
        poke = ctx.socket(zmq.PAIR)
        poke.connect("inproc://control")
        while os.getppid() == parent:
            time.sleep(_IDLE_S)
        poke.send(b"TERMINATE")
        poke.close()

    threading.Thread(target=watch, daemon=True).start()
    print(front.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
    zmq.proxy_steerable(front, back, None, control)
    return 0


def _work(fan_out: str, collect: str, parent: int) -> None:
    """A worker process: decode and validate its share of the vectors, forward batches until the brain goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the brain stops its workers itself
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.rcvhwm = 4 * BATCH_VECTORS
    pull.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
    pull.connect(fan_out)
    push = ctx.socket(zmq.PUSH)
    push.sndhwm = 64
    push.connect(collect)
    encoder = msgspec.msgpack.Encoder()
    while True:
        if not pull.poll(_IDLE_S * 1000):
            if os.getppid() != parent:
                return
            continue
        rejects: dict[str, int] = {}
        payloads: list[msgspec.Raw] = []
        kv: list[msgspec.Raw] = []
        deadline = time.monotonic() + BATCH_WAIT_S
        while len(payloads) + len(kv) < BATCH_VECTORS:
            try:
                frames = pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0 or not pull.poll(left * 1000):
                    break
                continue
            try:
                message = decode(frames, (NodeVector, KvBlocks), MAX_VECTOR_BYTES)
            except WireError as exc:
                rejects[exc.kind] = rejects.get(exc.kind, 0) + 1
                continue
            (payloads if isinstance(message, NodeVector) else kv).append(msgspec.Raw(frames[2]))
        push.send(encoder.encode(_Batch(rejects=rejects, vectors=payloads, kv=kv)))  # blocks: back-pressure


class ShardedReceiver:
    """`VectorReceiver`'s interface (`socket` to poll, `drain`, `backlog`, `close`) over a proxy process and
    `workers` worker processes."""

    def __init__(
        self, ctx: zmq.Context, endpoint: str, rejects: RejectCounter, workers: int, *, hwm: int = 10_000
    ) -> None:
        if workers < 1:
            raise ValueError("at least one ingest worker is needed")
        self._rejects = rejects
        self.backlog = 0
        self._dir = Path(tempfile.mkdtemp(prefix="prism-ingest-"))
        fan_out, collect = f"ipc://{self._dir}/fan-out", f"ipc://{self._dir}/collect"
        self._processes: list[subprocess.Popen[bytes]] = []
        self.socket = ctx.socket(zmq.PULL)
        self.socket.linger = 0
        self.socket.rcvhwm = max(4, hwm // BATCH_VECTORS)
        try:
            self.socket.bind(collect)
            proxy = self._start("proxy", endpoint, fan_out, str(hwm), stdout=subprocess.PIPE)
            assert proxy.stdout is not None
            line = proxy.stdout.readline().decode().strip()
            if not line.startswith(("tcp://", "ipc://")):
                raise zmq.ZMQError(msg=f"the ingest proxy could not bind {endpoint}: {line or 'it ended'}")
            self.endpoint = line
            """The bound ingest endpoint (with port 0, the port chosen)."""
            for _ in range(workers):
                self._start("worker", fan_out, collect)
        except BaseException:
            self.close()
            raise
        _log.info("ingest on %s sharded over %d worker processes (%s)", self.endpoint, workers, self._dir)

    def _start(self, role: str, *args: str, stdout: int | None = None) -> subprocess.Popen[bytes]:
        """A fresh interpreter running `role`: a fork would copy the brain's threads and torch."""
        command = [sys.executable, "-m", __name__, role, *args, str(os.getpid())]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout)
        self._processes.append(process)
        return process

    def drain(self, limit: int = VectorReceiver.DRAIN_LIMIT, *, kv: list[KvBlocks] | None = None) -> list[NodeVector]:
        """Every vector the workers have forwarded, in whole batches, until at least `limit`; never blocks. The
        agents' `KvBlocks` go to `kv` (without it they are dropped, as `VectorReceiver.drain` counts them)."""
        out: list[NodeVector] = []
        while len(out) < limit:
            try:
                message = self.socket.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                self.backlog = 0
                return out
            batch = _BATCH.decode(message)
            for kind, count in batch.rejects.items():
                for _ in range(count):
                    self._rejects.count(kind, "a vector rejected by an ingest worker")
            out.extend(batch.vectors)
            if batch.kv:
                if kv is None:
                    for _ in batch.kv:
                        self._rejects.count("unknown_kind", "KV blocks where only vectors are taken")
                else:
                    kv.extend(batch.kv)
        self.backlog += 1
        return out

    def close(self) -> None:
        """Stop the proxy and the workers; the ipc files go with their folder."""
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self._processes = []
        self.socket.close()
        with contextlib.suppress(OSError):
            shutil.rmtree(self._dir)


if __name__ == "__main__":
    if sys.argv[1] == "proxy":
        sys.exit(_proxy(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
    _work(sys.argv[2], sys.argv[3], int(sys.argv[4]))
