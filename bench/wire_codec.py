"""Node-vector and routing-table codec speed: Prism's validated msgpack codec against stdlib json.

Run: .venv/bin/python bench/wire_codec.py
Baseline (same run): `json.dumps`/`json.loads` of the same data as plain dicts, without validation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import msgspec

from prismlb.wire import (
    MAX_TABLE_BYTES,
    MAX_VECTOR_BYTES,
    NodeMetrics,
    NodeVector,
    RoutingTable,
    SliceTable,
    TableNode,
    decode,
    encode,
)


def per_op_us(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6


def main() -> None:
    vector = NodeVector(
        node_id="gpu-host-017",
        host="gpu-host-017",
        endpoint="http://10.0.3.17:8000",
        zone="zone-a",
        labels={"gpu": "h100", "nvlink": "yes"},
        seq=123456,
        sample_time_unix_s=time.time(),
        period_s=1.0,
        metrics=NodeMetrics(cpu_util_ratio=0.42, mem_used_bytes=7 << 30, mem_total_bytes=64 << 30, connect_calls_total=99),
    )
    table = RoutingTable(
        epoch=1,
        version=42,
        issued_unix_s=time.time(),
        slices=[
            SliceTable(
                name="default",
                nodes=[TableNode(node_id=f"n{i}", endpoint=f"http://10.0.{i // 250}.{i % 250}:8000", weight=0.75) for i in range(1000)],
            )
        ],
    )
    rows = []
    for name, msg, cls, limit, repeat in (
        ("node vector", vector, NodeVector, MAX_VECTOR_BYTES, 20000),
        ("table, 1,000 nodes", table, RoutingTable, MAX_TABLE_BYTES, 50),
    ):
        frames = encode(msg)
        as_dict = msgspec.to_builtins(msg)
        text = json.dumps(as_dict)
        prism_enc = per_op_us(lambda: encode(msg), repeat)
        prism_dec = per_op_us(lambda: decode(frames, (cls,), limit), repeat)
        json_enc = per_op_us(lambda: json.dumps(as_dict), repeat)
        json_dec = per_op_us(lambda: json.loads(text), repeat)
        rows.append((name, len(frames[2]), len(text), prism_enc, json_enc, prism_dec, json_dec))
    print(f"{'message':<20} {'bytes':>7} {'json B':>7} {'enc µs':>8} {'json enc':>9} {'ratio':>6} {'dec µs':>8} {'json dec':>9} {'ratio':>6}")
    for name, size, jsize, pe, je, pd, jd in rows:
        print(f"{name:<20} {size:>7} {jsize:>7} {pe:>8.2f} {je:>9.2f} {je / pe:>5.1f}x {pd:>8.2f} {jd:>9.2f} {jd / pd:>5.1f}x")
    print("decode validates types, ranges and finiteness; the json baseline validates nothing")


if __name__ == "__main__":
    main()
