"""Routing tables at fleet scale: bytes and apply time per update, per-slice deltas against whole tables.

Run: .venv/bin/python bench/tables.py [--nodes 1000 10000 20000] [--repeat 3]

A fleet of N eight-GPU hosts with realistic labels (long host names, URLs with paths, zones, model versions):
the text, image and retrieval slices hold one entry per host, the audio/video slice (topology-aware) one per
GPU, so 20,000 hosts make a 160,000-entry slice. For each size, in one run:

- baseline: the whole `RoutingTable` as one message (what the brain sent before per-slice deltas): its
  bytes, whether it fits the 16 MiB frame limit, and a router's apply (decode + rebuild every ring);
- Prism: `TableEncoder` (brain) → `TableAssembler` + `Router.apply` (router), for a cold start (snapshot),
  an update where 1% of the hosts' text-slice weights changed, and one where one host's load changed;
  and a router that subscribes to the text slice alone.

Wall-clock times on this machine; bytes are exact.
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec

from prismlb.router import Router
from prismlb.router._ring import _LAYOUTS, _points
from prismlb.wire import (
    MAX_TABLE_BYTES,
    RoutingTable,
    SliceTable,
    SliceUpdate,
    TableAssembler,
    TableEncoder,
    TableHead,
    TableNode,
    decode,
    encode,
)


def fleet(hosts: int) -> RoutingTable:
    """Four slices over `hosts` eight-GPU hosts, names as long as real fleets' are."""
    whole: list[TableNode] = []
    gpus: list[TableNode] = []
    for i in range(hosts):
        zone = f"us-east-1{'abc'[i % 3]}"
        node_id = f"gpu-node-{zone}-rack{i // 40:04d}-host{i:06d}.inference.prod.example.com"
        endpoint = f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000/v1"
        common = {"node_id": node_id, "endpoint": endpoint, "zone": zone, "model_version": "llama-3.1-70b-fp8-2024-12"}
        whole.append(TableNode(weight=0.8, load=3.0, predicted_p99_ms=412.5, **common))
        gpus.extend(
            TableNode(weight=0.8, load=0.375, predicted_p99_ms=412.5, gpu=g, numa_node=g // 4, **common)
            for g in range(8)
        )
    return RoutingTable(
        epoch=1,
        version=1,
        issued_unix_s=time.time(),
        brain_id="brain-a",
        slices=[
            SliceTable(name="llm", nodes=whole),
            SliceTable(name="vlm", nodes=whole[: hosts // 2]),
            SliceTable(name="av", nodes=gpus),
            SliceTable(name="rag", nodes=whole[: hosts // 10]),
        ],
    )


def changed(table: RoutingTable, version: int, weights_share: float, load_hosts: int) -> RoutingTable:
    """The next table: `weights_share` of the text slice's hosts reweighed, `load_hosts` hosts' load moved."""
    llm = list(table.slices[0].nodes)
    step = max(1, round(1 / weights_share)) if weights_share else 0
    for i in range(0, len(llm), step) if step else ():
        llm[i] = msgspec.structs.replace(llm[i], weight=0.5 if llm[i].weight != 0.5 else 0.8)
    for i in range(load_hosts):
        llm[i] = msgspec.structs.replace(llm[i], load=(llm[i].load or 0) + 1)
    slices = [SliceTable(name="llm", nodes=llm), *table.slices[1:]]
    return msgspec.structs.replace(table, version=version, slices=slices)


def deliver(messages: list[list[bytes]], assembler: TableAssembler, router: Router) -> tuple[int, float]:
    """Bytes and seconds for a router to take `messages`: decode, assemble, apply."""
    size = sum(len(f) for m in messages for f in m)
    started = time.perf_counter()
    table = None
    for frames in messages:
        msg = decode(frames, (SliceUpdate, TableHead), MAX_TABLE_BYTES)
        if isinstance(msg, SliceUpdate):
            assembler.slice_update(msg)
        else:
            table = assembler.head(msg)
    assert table is not None, "the messages complete a table"
    assert router.apply(table, replace=True)
    return size, time.perf_counter() - started


def whole(table: RoutingTable, router: Router) -> tuple[int, float, bool]:
    frames = encode(table)
    size = len(frames[2])
    started = time.perf_counter()
    decoded = msgspec.msgpack.decode(frames[2], type=RoutingTable)
    assert router.apply(decoded, replace=True)
    return size, time.perf_counter() - started, size <= MAX_TABLE_BYTES


def cold() -> None:
    """Forget the ring points and layouts a process keeps, so each cold start pays for its own."""
    _points.cache_clear()
    _LAYOUTS.clear()


def run(hosts: int, repeat: int) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    first = fleet(hosts)
    entries = sum(len(s.nodes) for s in first.slices)
    base_router = Router()
    cold()
    size, seconds, fits = whole(first, base_router)
    rows.append((f"{hosts:,} hosts ({entries:,} entries)", "whole table, cold", f"{size / 2**20:.1f} MiB", f"{seconds * 1e3:.0f} ms"))
    if not fits:
        rows[-1] = (*rows[-1][:2], f"{size / 2**20:.1f} MiB (over the 16 MiB limit)", rows[-1][3])
    small = changed(first, 2, 0.01, 0)
    size, seconds, _ = whole(small, base_router)
    rows.append(("", "whole table, 1% weights", f"{size / 2**20:.1f} MiB", f"{seconds * 1e3:.0f} ms"))

    encoder = TableEncoder()
    encoder.update(first)
    snapshot = encoder.snapshot(None)
    router, assembler = Router(), TableAssembler()
    cold()
    size, seconds = deliver(snapshot, assembler, router)
    rows.append(("", "Prism snapshot, cold", f"{size / 2**20:.1f} MiB in {len(snapshot)} msgs", f"{seconds * 1e3:.0f} ms"))
    text_router, text_assembler = Router(), TableAssembler(wanted=["llm"])
    size, seconds = deliver(encoder.snapshot(["llm"]), text_assembler, text_router)
    rows.append(("", "Prism snapshot, llm slice only", f"{size / 2**20:.2f} MiB", f"{seconds * 1e3:.0f} ms"))

    table, version = first, 1
    for label, share, loads in (("1% weights", 0.01, 0), ("one host's load", 0.0, 1)):
        sizes, times, encode_times = [], [], []
        for _ in range(repeat):
            version += 1
            table = changed(table, version, share, loads)
            started = time.perf_counter()
            messages = encoder.update(table)
            encode_times.append(time.perf_counter() - started)
            size, seconds = deliver(messages, assembler, router)
            sizes.append(size)
            times.append(seconds)
        rows.append(
            (
                "",
                f"Prism delta, {label}",
                f"{statistics.median(sizes) / 1024:.1f} KiB",
                f"{statistics.median(times) * 1e3:.0f} ms (brain encode {statistics.median(encode_times) * 1e3:.0f} ms)",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000, 20000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    header = ("fleet", "update", "bytes on the wire", "router apply (decode, assemble, rings)")
    rows = [row for hosts in args.nodes for row in run(hosts, args.repeat)]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
