"""Brain cycle at 1,000 and 10,000 simulated nodes: ingest rate, full cycle time, table bytes.

Run: .venv/bin/python bench/brain_cycle.py [--nodes 1000 10000]
Ingest goes through real ZeroMQ (PUSH → PULL on loopback) into the brain's own code (decode, registry,
history, predictor history). A cycle is: one batched LSTM-Attention inference for every node (16 steps × 8
features) → weights for four slices → table build → encode and publish on a real PUB socket. Baseline (same run): decoding the same vectors alone.
Goals (issue 5): ≤ 100 ms per cycle at 1,000 nodes, ≤ 1 s at 10,000.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import zmq
from prometheus_client import CollectorRegistry

from prismlb.brain import Brain, BrainConfig, TableBuilder
from prismlb.brain._features import node_features, series_p99_ms
from prismlb.wire import (
    MAX_VECTOR_BYTES,
    GpuState,
    ModalityLatency,
    NodeMetrics,
    NodeVector,
    RejectCounter,
    TablePublisher,
    VectorReceiver,
    VectorSender,
    decode,
    encode,
)

GPU_CLASSES = ("a100", "h100", "l40s", "h200")


def vectors(nodes: int, seq: int, rng: random.Random) -> list[NodeVector]:
    out = []
    for i in range(nodes):
        gpu = GPU_CLASSES[i % len(GPU_CLASSES)]
        labels = {
            "gpu": gpu,
            "nvlink": "yes" if gpu in ("h100", "h200") else "no",
            "av1": "yes" if gpu == "l40s" else "no",
        }
        if i % 10 == 0:
            labels["vectordb"] = "yes"
        gpus = [
            GpuState(
                index=g,
                uuid=f"GPU-{i}-{g}",
                mem_used_bytes=40 << 30,
                mem_total_bytes=80 << 30,
                numa_node=g // 4,
                pcie_util_ratio=rng.random(),
            )
            for g in range(8 if gpu == "l40s" else 0)
        ]
        out.append(
            NodeVector(
                node_id=f"node-{i:05d}",
                host=f"host-{i:05d}",
                endpoint=f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000",
                zone=f"zone-{i % 3}",
                labels=labels,
                seq=seq,
                sample_time_unix_s=time.time(),
                period_s=1.0,
                metrics=NodeMetrics(
                    cpu_util_ratio=rng.random(),
                    mem_used_bytes=8 << 30,
                    mem_total_bytes=64 << 30,
                    kv_cache_usage_ratio=rng.random(),
                    kv_cache_miss_ratio=rng.random() * 0.3,
                    requests_running=rng.randrange(64),
                    requests_waiting=rng.randrange(16),
                    requests_per_s=rng.random() * 20,
                ),
                latency={"llm": ModalityLatency(requests=50, ttft_p99_ms=200 + rng.random() * 600)},
                gpus=gpus,
            )
        )
    return out


def bench(nodes: int, windows: int) -> dict[str, float]:
    rng = random.Random(7)
    ctx = zmq.Context()
    # nodes must not expire while the bench runs (its ingest alone takes longer than 3 periods)
    brain = Brain(BrainConfig(admin_port=0, train_budget_s=0.0, stale_periods=1e6), CollectorRegistry())
    endpoint = "tcp://127.0.0.1:0"
    receiver_rejects = RejectCounter("bench", brain.rejects._log)
    receiver = VectorReceiver(ctx, endpoint, receiver_rejects)
    address = receiver.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    publisher = TablePublisher(
        ctx, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", RejectCounter("bench", brain.rejects._log)
    )
    batches = [vectors(nodes, seq, rng) for seq in range(windows)]
    frames = [encode(v) for batch in batches for v in batch]

    start = time.perf_counter()
    for f in frames:
        decode(f, (NodeVector,), MAX_VECTOR_BYTES)
    decode_only_s = time.perf_counter() - start

    drained = threading.Event()

    def push() -> None:
        with VectorSender(ctx, address, hwm=len(frames) + 10) as sender:
            for batch in batches:
                for v in batch:
                    while not sender.send(v):
                        time.sleep(0.001)
            drained.wait()  # the sender's socket drops what it still queues when it closes (linger 0)

    pusher = threading.Thread(target=push)
    received = 0
    start = time.perf_counter()
    pusher.start()
    while received + receiver_rejects.total < len(frames):
        if not receiver.socket.poll(10_000):
            drained.set()
            raise SystemExit(f"stalled: {received} received of {len(frames)}, rejects {receiver_rejects.counts()}")
        got = receiver.drain()
        received += len(got)
        brain.ingest(got, time.monotonic())
    ingest_s = time.perf_counter() - start
    drained.set()
    pusher.join()
    for batch in batches:  # one predictor time step per window, as the brain's control period does
        for v in batch:
            brain.predictor.observe(v.node_id, node_features(v), series_p99_ms(v))

    cycles = []
    table_bytes = 0
    for _ in range(5):
        brain.tables = TableBuilder(brain.tables.epoch)  # a fresh builder: the cycle always issues a table
        t0 = time.perf_counter()
        brain.predictor.predict(list(brain.registry.nodes), "lstm_attention")  # the model's cost, trained or not
        t1 = time.perf_counter()
        table = brain.cycle(time.monotonic())
        t2 = time.perf_counter()
        assert table is not None
        publisher.publish(table)
        t3 = time.perf_counter()
        table_bytes = len(encode(table)[2])
        cycles.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    receiver.close()
    publisher.close()
    brain.history.close()
    ctx.destroy(linger=0)
    best = min(cycles, key=lambda c: c[3])
    return {
        "vectors": len(frames),
        "ingest_per_s": len(frames) / ingest_s,
        "decode_only_per_s": len(frames) / decode_only_s,
        "predict_ms": best[0] * 1e3,
        "weights_table_ms": best[1] * 1e3,
        "publish_ms": best[2] * 1e3,
        "cycle_ms": best[3] * 1e3,
        "table_bytes": table_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--windows", type=int, default=20, help="vectors per node ingested before the cycles")
    args = parser.parse_args()
    print(
        f"{'nodes':>7} {'ingest vec/s':>13} {'decode-only vec/s':>18} {'ratio':>6} {'predict ms':>11} "
        f"{'weights+table ms':>17} {'publish ms':>11} {'cycle ms':>9} {'goal ms':>8} {'table KiB':>10}"
    )
    for nodes in args.nodes:
        r = bench(nodes, args.windows)
        goal = 100 if nodes <= 1000 else 1000
        print(
            f"{nodes:>7} {r['ingest_per_s']:>13,.0f} {r['decode_only_per_s']:>18,.0f} "
            f"{r['ingest_per_s'] / r['decode_only_per_s']:>5.2f}x {r['predict_ms']:>11.1f} {r['weights_table_ms']:>17.1f} "
            f"{r['publish_ms']:>11.1f} {r['cycle_ms']:>9.1f} {goal:>8} {r['table_bytes'] / 1024:>10.0f}"
        )


if __name__ == "__main__":
    main()
