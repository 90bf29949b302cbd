"""The prefix index's propagation: an engine's KV change → visible in the index of every one of N routers.

Run: .venv/bin/python bench/kv_propagation.py [--routers 100] [--changes 200]   (under a minute)

One process plays the node and the brain: a stand-in for the engine's KV-event subscriber (`take_changes` over a
set this bench changes), the agent's `KvStream` (polling it every 20 ms, its own PUSH socket) and a real `Brain`
service (its loop relays each `KvBlocks` as a `KvDelta` at once). The main process holds N `Router.connect`
routers, each recording `time.monotonic_ns()` when its `apply_kv` first puts a watched hash in its index (one
clock for both processes: CLOCK_MONOTONIC is system-wide). A change is one new block stored every 50 ms, stamped
just before the engine stand-in takes it; its latency is from that stamp to each router having applied it, so it
includes the agent's poll interval (0 to 20 ms, 10 on average). Loopback TCP, this machine's CPUs.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import threading
import time
from collections.abc import Sequence

import zmq
from prometheus_client import CollectorRegistry

from prismlb.agent._kv_events import KvChanges
from prismlb.agent._kv_stream import KvStream
from prismlb.brain import Brain, BrainConfig
from prismlb.demo import free_port
from prismlb.router import Router
from prismlb.semantics import quantile
from prismlb.wire import BrainAddress, NodeMetrics, NodeVector, VectorSender

BUDGET_P99_MS = 100.0
CHANGE_EVERY_S = 0.05
FIRST_HASH = 1 << 40


class _Engine:
    """`KvEventSubscriber.take_changes` over a set the bench changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._stored: list[int] = []
        self._reset = True

    def store(self, block: int) -> None:
        with self._lock:
            self._held.add(block)
            self._stored.append(block)

    def take_changes(self, full: bool = False) -> KvChanges:
        with self._lock:
            reset, self._reset = self._reset or full, False
            stored, self._stored = (tuple(self._held) if reset else tuple(self._stored)), []
            return KvChanges(reset, stored, (), 16)


def _node_and_brain(
    config: BrainConfig, changes: int, go: multiprocessing.Queue[int], out: multiprocessing.Queue
) -> None:
    """The brain service, an agent's vectors (so that there is a table) and its KV stream; on "go", `changes` new
    blocks, their (hash, stamp ns) sent back."""
    logging.disable(logging.WARNING)  # the brain's start-up notes (no state folder) are expected here
    stop = threading.Event()
    brain = Brain(config, CollectorRegistry())
    brain_thread = threading.Thread(target=brain.run, args=(stop,), daemon=True)
    brain_thread.start()
    ctx = zmq.Context()
    engine = _Engine()
    stream = KvStream(engine, "node-1", [config.ingest], context=ctx)
    stream.start()

    def report() -> None:
        sender = VectorSender(ctx, config.ingest)
        seq = 0
        try:
            while not stop.is_set():
                sender.send(
                    NodeVector(
                        node_id="node-1",
                        host="h",
                        endpoint="http://127.0.0.1:8000",
                        seq=seq,
                        sample_time_unix_s=time.time(),
                        period_s=1.0,
                        metrics=NodeMetrics(cpu_util_ratio=0.1, requests_running=0, requests_waiting=0),
                    )
                )
                seq += 1
                stop.wait(0.5)
        finally:
            sender.close()

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        go.get(timeout=120)
        stamps = []
        for i in range(changes):
            block = FIRST_HASH + i
            stamps.append((block, time.monotonic_ns()))
            engine.store(block)
            time.sleep(CHANGE_EVERY_S)
        out.put(stamps)
        go.get(timeout=120)  # the parent has collected: stop
    finally:
        stop.set()
        reporter.join(timeout=5)
        stream.close()
        brain_thread.join(timeout=20)
        ctx.term()


class _StampedRouter(Router):
    """A Router that records when each watched block first enters its index from the KV stream."""

    seen: dict[int, int]

    def apply_kv(
        self, node_id: str, reset: bool, stored: Sequence[int], removed: Sequence[int], block_size: int | None = None
    ) -> None:
        super().apply_kv(node_id, reset, stored, removed, block_size)
        now = time.monotonic_ns()
        for block in stored:
            if block >= FIRST_HASH and block not in self.seen:
                self.seen[block] = now


def run(routers: int, changes: int) -> tuple[float, float, float, int, int]:
    """p50, p99 and max ms from an engine change to each router's index, and (seen, expected) counts."""
    config = BrainConfig(
        ingest=f"tcp://127.0.0.1:{free_port()}",
        updates=f"tcp://127.0.0.1:{free_port()}",
        snapshot=f"tcp://127.0.0.1:{free_port()}",
        train_budget_s=0.0,
        admin_port=0,
    )
    mp = multiprocessing.get_context("spawn")
    go: multiprocessing.Queue[int] = mp.Queue()
    out: multiprocessing.Queue = mp.Queue()
    node = mp.Process(target=_node_and_brain, args=(config, changes, go, out))
    node.start()
    fleet: list[_StampedRouter] = []
    try:
        for _ in range(routers):
            router = _StampedRouter.connect(BrainAddress(config.updates, config.snapshot))
            router.seen = {}
            fleet.append(router)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_synced(r) for r in fleet):
            time.sleep(0.05)
        go.put(1)
        stamps: list[tuple[int, int]] = out.get(timeout=120)
        time.sleep(1.0)
        go.put(1)
    finally:
        for router in fleet:
            router.close()
        node.join(timeout=60)
    latencies = [(r.seen[b] - t) / 1e6 for r in fleet for b, t in stamps if b in r.seen]
    return (
        quantile(latencies, 0.5),
        quantile(latencies, 0.99),
        max(latencies),
        len(latencies),
        len(stamps) * routers,
    )


def _synced(router: Router) -> bool:
    """The router follows the brain and has taken its KV snapshot."""
    subscriber = router._subscriber
    return subscriber is not None and subscriber.kv is not None and subscriber.kv.stats.snapshots > 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--changes", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"\n## KV propagation: engine change → router index on loopback ({args.changes} changes, 1 every 50 ms)\n")
    print("| routers | p50 ms | p99 ms | max ms | budget p99 ms | within | delivered |")
    print("|---|---|---|---|---|---|---|")
    for routers in args.routers:
        p50, p99, worst, seen, expected = run(routers, args.changes)
        within = "yes" if p99 <= BUDGET_P99_MS else "NO"
        budget = f"≤ {BUDGET_P99_MS:.0f}"
        print(f"| {routers} | {p50:.1f} | {p99:.1f} | {worst:.1f} | {budget} | {within} | {seen}/{expected} |")


if __name__ == "__main__":
    main()
