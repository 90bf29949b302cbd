"""Brain ingest at fleet scale: 1,000 / 5,000 / 20,000 simulated agents at one vector per second each.

Run: .venv/bin/python bench/ingest.py [--nodes 1000 5000 20000] [--seconds 6] [--senders 3] [--workers 2]
Senders are separate processes (`--senders`), each playing an equal share of the node ids through one real ZeroMQ
PUSH socket (HWM: one period of its nodes' vectors, non-blocking sends, a full queue drops and counts), each node
sending once per second, evenly spread, in a new order every second. Vectors are realistic: 8 GPUs with NVLink
peers, latency for two slices, labels (about 2.5 KB of msgpack). A sender encodes each node's vector once and
patches `seq` and the sample time into the bytes, so the senders' CPU stays small next to the brain's. The brain
side is this process: the real receiver and `Brain.ingest` (decode and validation, registry with health, history),
polled like the brain's loop.

Rows, same run and same senders:
  before   the path per vector as it was: `registry.update`, `Counter.inc` and `History.append` per vector,
           the garbage collector's default thresholds;
  batched  `Brain.ingest` (one history append, counter and clock reading per drained batch), and the
           collector tuned as the brain's service tunes it (`tune_gc_for_ingest`);
  sharded  `--ingest-workers N`: a ZeroMQ proxy fans the PULL out to N worker processes that decode and
           validate; the brain builds the vectors from their batches without validating again.
Measured over `--seconds` after a warm-up period: vectors/s offered and accepted; CPU seconds per 1,000 accepted
vectors of the brain's process, of the proxy and worker processes, and of the senders (on a 2-core machine they all
share the same cores); what the brain's process could take on one core of its own (1,000 / its CPU per 1,000); over
the whole run, sender-side drops and brain-side counted loss (sequence gaps: a node's loss is counted at its next
vector that gets through, so it trails the drops while the brain is overloaded); the longest run of full drains
(backlog).
"""

from __future__ import annotations

import argparse
import gc
import logging
import multiprocessing
import os
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import TYPE_CHECKING

import zmq
from agent_ebpf import cpu_s  # bench/agent_ebpf.py: this script's directory is the first entry of sys.path
from prometheus_client import CollectorRegistry

from prismlb.brain import BrainConfig
from prismlb.brain._shards import ShardedReceiver, tune_gc_for_ingest
from prismlb.wire import GpuState, ModalityLatency, NodeMetrics, NodeVector, VectorReceiver, encode

if TYPE_CHECKING:
    from prismlb.brain import Brain

WARMUP_S = 2.0  # every node has joined and the queues have settled before the measured window
DEFAULT_GC = gc.get_threshold()
SEQ_BASE = 1 << 16  # from here msgpack writes `seq` as 4 bytes, so a sender can patch it in place


def node_vector(i: int, rng: random.Random) -> NodeVector:
    return NodeVector(
        node_id=f"node-{i:05d}",
        host=f"host-{i:05d}",
        endpoint=f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000",
        zone=f"zone-{i % 3}",
        labels={"gpu": "h100", "nvlink": "yes", "pool": f"pool-{i % 7}", "vectordb": "yes" if i % 10 == 0 else "no"},
        seq=SEQ_BASE,
        sample_time_unix_s=time.time(),
        period_s=1.0,
        started_unix_s=1_700_000_000.0,
        metrics=NodeMetrics(
            cpu_util_ratio=rng.random(),
            mem_used_bytes=80 << 30,
            mem_total_bytes=512 << 30,
            gpu_mem_frag_ratio=rng.random() * 0.5,
            kv_cache_miss_ratio=rng.random() * 0.3,
            cpu_preproc_p95_ms=rng.random() * 100,
            nvlink_util_ratio=rng.random(),
            gpu_count=8,
            gpu_mem_used_bytes=320 << 30,
            gpu_mem_total_bytes=640 << 30,
            gpu_util_ratio=rng.random(),
            pcie_util_ratio=rng.random(),
            kv_cache_usage_ratio=rng.random(),
            requests_running=rng.randrange(64),
            requests_waiting=rng.randrange(16),
            requests_per_s=rng.random() * 20,
        ),
        latency={
            name: ModalityLatency(
                requests=50,
                errors=1,
                ttft_p50_ms=100 + rng.random() * 100,
                ttft_p95_ms=250 + rng.random() * 200,
                ttft_p99_ms=400 + rng.random() * 400,
                e2e_p50_ms=1_000 + rng.random() * 500,
                e2e_p95_ms=2_000 + rng.random() * 800,
                e2e_p99_ms=3_000 + rng.random() * 1_000,
            )
            for name in ("llm", "vision")
        },
        gpus=[
            GpuState(
                index=g,
                uuid=f"GPU-{i:05d}-{g}",
                name="NVIDIA H100 80GB HBM3",
                mem_used_bytes=40 << 30,
                mem_total_bytes=80 << 30,
                util_ratio=rng.random(),
                nvlink_util_ratio=rng.random(),
                pcie_util_ratio=rng.random(),
                numa_node=g // 4,
                nvlink_peers=[p for p in range(8) if p != g],
            )
            for g in range(8)
        ],
    )


def send(endpoint: str, first: int, step: int, nodes: int, ready: Queue, plan: Queue, out: Queue) -> None:
    """One sender process: nodes first, first+step, ... below `nodes`, each once per second. Says it is ready
    on `ready`, takes the start and the measured window (wall clock) from `plan`, and puts (sent, dropped)
    counted inside the window, the drops of the whole run and its CPU seconds inside the window on `out`."""
    rng = random.Random(first)
    mine = range(first, nodes, step)
    frames = [encode(node_vector(i, rng)) for i in mine]
    seq_at = [f[2].index(b"\xa3seq\xce") + 5 for f in frames]
    time_at = [f[2].index(b"\xb2sample_time_unix_s\xcb") + 20 for f in frames]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.sndhwm = len(mine)  # one period of this sender's vectors
    push.connect(endpoint)
    seqs = [SEQ_BASE] * len(mine)
    order = list(range(len(mine)))
    sent = dropped = dropped_total = 0
    cpu_at_start = cpu_at_end = 0.0
    spacing = 1.0 / len(mine)
    ready.put(os.getpid())
    start, window_start, window_end = plan.get()
    k = 0
    while True:
        due = start + k * spacing
        now = time.time()
        if due > window_end:
            break
        if due > now:
            time.sleep(max(due - now, 0.005))  # then every vector due: 200 wake-ups a second, not one per vector
            continue
        if now - due > 0.1:  # behind (a stall): skip the missed slots, as an agent does
            k = int((now - start) / spacing)
            continue
        if k % len(mine) == 0:  # each round in a new order: agents' phases drift, none is always first
            rng.shuffle(order)
        j = order[k % len(mine)]
        payload = bytearray(frames[j][2])
        struct.pack_into(">I", payload, seq_at[j], seqs[j])
        struct.pack_into(">d", payload, time_at[j], now)
        seqs[j] += 1  # like an agent, a dropped vector still uses its number
        k += 1
        inside = window_start <= now < window_end
        if inside and not cpu_at_start:
            cpu_at_start = time.process_time()
        if not inside and cpu_at_start and not cpu_at_end:
            cpu_at_end = time.process_time()
        try:
            push.send_multipart([frames[j][0], frames[j][1], payload], flags=zmq.NOBLOCK)
            sent += inside
        except zmq.Again:
            dropped += inside
            dropped_total += 1
    out.put((sent, dropped, dropped_total, (cpu_at_end or time.process_time()) - cpu_at_start))
    out.close()
    out.join_thread()
    push.close(linger=-1)  # deliver what is queued
    ctx.term()


def per_vector_ingest(brain: Brain) -> Callable[[list[NodeVector], float], None]:
    """The ingest as it was before batching: per vector a registry update, a counter increment and a history
    append (one lock and one clock reading each)."""
    counter = brain._vectors

    def ingest(vectors: list[NodeVector], now: float) -> None:
        for vector in vectors:
            if brain.registry.update(vector, now):
                counter.inc()
                brain.history.append(vector)

    return ingest


@dataclass
class Result:
    accepted_per_s: float
    brain_cpu_per_1k: float
    worker_cpu_per_1k: float
    offered: int
    """Vectors the senders offered inside the window."""
    sender_dropped: int
    """Over the whole run, like `lost`."""
    sender_cpu_per_1k: float
    lost: int
    backlog_max: int


def run(nodes: int, path: str, seconds: float, senders: int, workers: int) -> Result:
    from prismlb.brain import Brain  # torch: in this process only, not in the senders

    logging.getLogger("prism").setLevel(logging.ERROR)  # 20,000 "node joined" lines are not the bench
    brain = Brain(BrainConfig(admin_port=0, train_budget_s=0.0, stale_periods=1e6), CollectorRegistry())
    ctx = zmq.Context()
    receiver: VectorReceiver | ShardedReceiver
    if path == "sharded":
        receiver = ShardedReceiver(ctx, "tcp://127.0.0.1:0", brain.rejects, workers)
        endpoint = receiver.endpoint
        pids = [p.pid for p in receiver._processes]
    else:
        receiver = VectorReceiver(ctx, "tcp://127.0.0.1:0", brain.rejects)
        endpoint = receiver.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        pids = []
    if path == "before":
        ingest = per_vector_ingest(brain)
        gc.unfreeze()
        gc.set_threshold(*DEFAULT_GC)
    else:
        ingest = brain.ingest
        tune_gc_for_ingest()  # as the brain's service does
    spawn = multiprocessing.get_context("spawn")
    ready: Queue = spawn.Queue()
    plans: list[Queue] = [spawn.Queue() for _ in range(senders)]
    results: Queue = spawn.Queue()
    procs = [
        spawn.Process(target=send, args=(endpoint, k, senders, nodes, ready, plans[k], results)) for k in range(senders)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    start = time.time() + 0.2
    window = (start + WARMUP_S, start + WARMUP_S + seconds)
    for plan in plans:
        plan.put((start, *window))

    def counters() -> tuple[float, float, float, float]:
        accepted = brain.metrics.get_sample_value("prism_brain_vectors_total") or 0.0
        return time.time(), accepted, time.process_time(), sum(cpu_s(pid) for pid in pids)

    before = after = None
    backlog_max = 0
    poller = zmq.Poller()
    poller.register(receiver.socket, zmq.POLLIN)
    while after is None:
        now = time.time()
        if before is None and now >= window[0]:
            before = counters()
        elif before is not None and now >= window[1]:
            after = counters()
        poller.poll(timeout=50)
        ingest(receiver.drain(), time.monotonic())
        if before is not None:
            backlog_max = max(backlog_max, receiver.backlog)
    # The senders deliver what they still queue before they exit, and the brain takes it all: a loss is
    # counted at the node's next vector, so the count needs the whole run.
    while any(p.is_alive() for p in procs) or receiver.socket.poll(1000):
        if receiver.socket.poll(100):
            ingest(receiver.drain(), time.monotonic())
    counts = [results.get(timeout=10) for _ in procs]
    lost = brain.metrics.get_sample_value("prism_brain_vectors_lost_total") or 0.0
    receiver.close()
    brain.history.close()
    ctx.destroy(linger=0)
    elapsed = after[0] - before[0]
    accepted = after[1] - before[1]
    per_1k = 1000 / accepted if accepted else float("nan")
    return Result(
        accepted_per_s=accepted / elapsed,
        brain_cpu_per_1k=(after[2] - before[2]) * per_1k,
        worker_cpu_per_1k=(after[3] - before[3]) * per_1k,
        offered=sum(c[0] + c[1] for c in counts),
        sender_dropped=sum(c[2] for c in counts),
        sender_cpu_per_1k=sum(c[3] for c in counts) * per_1k,
        lost=int(lost),
        backlog_max=backlog_max,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000, 20000])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured window per row")
    parser.add_argument("--senders", type=int, default=3, help="sender processes")
    parser.add_argument("--workers", type=int, default=2, help="ingest workers of the sharded row")
    parser.add_argument("--paths", nargs="+", default=["before", "batched", "sharded"])
    args = parser.parse_args()
    print(
        f"{'nodes':>6} {'path':>10} {'offered/s':>10} {'accepted/s':>11} {'brain CPU s/1k':>15} "
        f"{'proxy+workers s/1k':>19} {'senders s/1k':>13} {'brain max/s':>12} {'vs before':>10} {'sender drops':>13} "
        f"{'brain lost':>11} {'backlog':>8}"
    )
    for nodes in args.nodes:
        base = None
        for path in args.paths:
            r = run(nodes, path, args.seconds, args.senders, args.workers)
            if path == "before":
                base = r.brain_cpu_per_1k
            ratio = f"{base / r.brain_cpu_per_1k:>9.2f}x" if base else f"{'-':>10}"
            label = f"sharded {args.workers}" if path == "sharded" else path
            lost = "-" if path == "before" else f"{r.lost:,}"  # the path before did not count losses
            print(
                f"{nodes:>6} {label:>10} {r.offered / args.seconds:>10,.0f} "
                f"{r.accepted_per_s:>11,.0f} {r.brain_cpu_per_1k:>15.3f} {r.worker_cpu_per_1k:>19.3f} "
                f"{r.sender_cpu_per_1k:>13.3f} "
                f"{1000 / r.brain_cpu_per_1k:>12,.0f} {ratio} {r.sender_dropped:>13,} {lost:>11} "
                f"{r.backlog_max:>8}",
                flush=True,
            )


if __name__ == "__main__":
    main()
