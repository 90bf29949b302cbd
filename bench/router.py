"""The router: lookup speed, table apply time, propagation to 100 subscribers, and cache affinity on a real trace.

Run: .venv/bin/python bench/router.py   (about three minutes; --quick for a smaller run)
Baselines (same run): `uhashring` 2.5 ketama (`HashRing(hash_fn="ketama")`) lookups and ring builds on the same
nodes and weights; a Maglev table (Envoy's weighted population, built here) for the ring-or-Maglev choice;
first-block-only and random keys on the Mooncake conversation trace (FAST'25, kvcache-ai/Mooncake).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import importlib
import json
import logging
import multiprocessing
import random
import statistics
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from uhashring import HashRing  # type: ignore[import-untyped]

from prismlb.demo import free_port
from prismlb.router import Request, Ring, Router, Settings, prefix_key
from prismlb.semantics import quantile
from prismlb.sim import BLOCK_TOKENS, MOONCAKE_TRACE, mooncake_tokens, traces_dir
from prismlb.wire import (
    BrainAddress,
    RejectCounter,
    RoutingTable,
    SliceTable,
    TableNode,
    TablePublisher,
    TableSubscriber,
)

MOONCAKE = traces_dir() / MOONCAKE_TRACE
TRACE_BLOCK = BLOCK_TOKENS  # tokens per Mooncake hash id
WEIGHT_STEPS = [round(0.05 * k, 2) for k in range(1, 21)]  # the brain publishes weights in steps of 0.05


def cluster(count: int, seed: int, loads: bool = False, prefix: str = "gpu") -> list[TableNode]:
    """`count` nodes with brain-like weights; with `loads`, load estimates of about 8 requests per unit of
    weight, each node 0.5 to 1.5 times its share (so some are past the 1.25 bound). Node ids start with
    `prefix`, so that each section hashes its own points."""
    rng = random.Random(seed)
    weights = [rng.choice(WEIGHT_STEPS) for _ in range(count)]
    return [
        TableNode(
            node_id=f"{prefix}-{i:04d}",
            endpoint=f"http://10.{i // 250}.{i % 250}.1:8000",
            weight=w,
            load=round(8 * w * rng.uniform(0.5, 1.5), 1) if loads else None,
        )
        for i, w in enumerate(weights)
    ]


def table(nodes: Sequence[TableNode], version: int = 1) -> RoutingTable:
    return RoutingTable(
        epoch=1, version=version, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=list(nodes))]
    )


def ketama(nodes: Sequence[TableNode]) -> HashRing:
    """uhashring's ketama ring on the same nodes, with nginx-style integer weights (20 × table weight)."""
    spec = {
        n.node_id: {"hostname": n.node_id, "port": 8000, "weight": round(20 * n.weight), "instance": None}
        for n in nodes
    }
    return HashRing(nodes=spec, hash_fn="ketama")


def per_call_ns(fns: dict[str, Callable[[Any], object]], keys: Sequence[Any], rounds: int) -> dict[str, list[float]]:
    """Per-call times of each function over the same keys, interleaved in chunks, net of the timer's own cost."""
    clock = time.perf_counter_ns
    pairs = []
    for _ in range(20_000):
        t0 = clock()
        pairs.append(clock() - t0)
    timer = statistics.median(pairs)
    times: dict[str, list[float]] = {name: [] for name in fns}
    chunk = 1000
    for _ in range(rounds):
        for start in range(0, len(keys), chunk):
            part = keys[start : start + chunk]
            for name, fn in fns.items():
                out = times[name]
                for key in part:
                    t0 = clock()
                    fn(key)
                    out.append(clock() - t0 - timer)
    return times


def loop_ns(fn: Callable[[Any], object], keys: Sequence[Any], repeat: int = 5) -> float:
    """Mean ns per call over a tight loop (best of `repeat`)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for key in keys:
            fn(key)
        best = min(best, (time.perf_counter_ns() - t0) / len(keys))
    return best


def route_path() -> str:
    """Which path route()'s common case takes: the C extension's, or pure Python where it is not built."""
    try:
        importlib.import_module("prismlb.router._fastroute")
    except ImportError:
        return "pure Python (the C extension prismlb.router._fastroute is not built)"
    return "C (prismlb.router._fastroute)"


def lookup_section(quick: bool) -> None:
    nodes = cluster(100, seed=1, loads=True)
    router = Router.from_table(table(nodes))
    held = [router.request(f"held-{i}") for i in range(200)]  # requests in flight, as in a busy caller
    for lease in held:
        lease.begin()
    idle = Router.from_table(table(cluster(100, seed=1)))
    ring = ketama(nodes)
    count = 20_000 if quick else 100_000
    keys = [f"conversation-{i}" for i in range(count)]
    int_keys = [prefix_key(text=k) for k in keys]
    requests = [Request(key=k, modality="text") for k in int_keys]
    sessions = [Request(key=k, modality="text", session=f"user-{i % 5000}") for i, k in enumerate(int_keys)]
    same = sum(router.route(k).node_id == ring.get_node(k) for k in keys[:2000])
    print(f"\n## route() against uhashring ketama on the same {len(nodes)} nodes and weights\n")
    print(f"route()'s common case runs in {route_path()}.\n")
    rounds = 1 if quick else 3
    times = per_call_ns({"idle": idle.route, "busy": router.route, "ketama": ring.get_node}, keys, rounds=rounds)
    times["int"] = per_call_ns({"int": router.route}, int_keys, rounds=1)["int"]
    means = {
        "idle": loop_ns(idle.route, keys),
        "busy": loop_ns(router.route, keys),
        "int": loop_ns(router.route, int_keys),
        "ketama": loop_ns(ring.get_node, keys),
    }
    overflow = sum(router.route(k) != idle.route(k) for k in keys[:5000]) / 5000
    names = {
        "idle": "Prism route(str key), idle table",
        "busy": "Prism route(str key), busy: brain load estimates, 200 requests in flight",
        "int": "Prism route(prefix_key int), busy",
        "ketama": "uhashring ketama get_node(str key)",
    }
    print("| lookup | p50 ns | p99 ns | mean ns, tight loop | ketama p50 / this p50 | ketama mean / this mean |")
    print("|---|---|---|---|---|---|")
    k50 = quantile(times["ketama"], 0.5)
    for key, name in names.items():
        p50, p99 = quantile(times[key], 0.5), quantile(times[key], 0.99)
        print(
            f"| {name} | {p50:.0f} | {p99:.0f} | {means[key]:.0f} | {k50 / p50:.1f}× |"
            f" {means['ketama'] / means[key]:.1f}× |"
        )
    print(
        f"\nPer-call times are net of the timer's own cost (median back-to-back clock pair). When busy, {overflow:.0%} "
        f"of keys find their owner at its bound and walk the probe order. The two rings place {same / 20:.0f}% "
        "of keys alike (different hash functions)."
    )
    richer = [
        ("route(Request: key, modality)", lambda r: router.route(r), requests),
        ("route(Request: key, modality, session)", lambda r: router.route(r), sessions),
        ("with router.request(Request) (count in flight, report outcome)", _leased(router), requests),
    ]
    print("\n| richer call | p50 ns | p99 ns |")
    print("|---|---|---|")
    for name, fn, inputs in richer:
        values = per_call_ns({name: fn}, inputs[: count // 5], rounds=1)[name]
        print(f"| {name} | {quantile(values, 0.5):.0f} | {quantile(values, 0.99):.0f} |")
    for lease in held:
        lease.end()


def _leased(router: Router) -> Callable[[Request], object]:
    def run(request: Request) -> object:
        with router.request(request) as lease:
            return lease

    return run


@dataclass
class _MaglevEntry:
    node_id: str
    weight: float
    offset: int
    skip: int
    next: int = 0
    target: float = 0.0


class Maglev:
    """Maglev (Eisenbud et al., NSDI'16) with Envoy's weighted table population; lookups by the same key hash."""

    def __init__(self, nodes: Sequence[TableNode], size: int = 65537) -> None:
        self.size = size
        entries = []
        for n in sorted(nodes, key=lambda n: n.node_id):
            digest = hashlib.blake2b(n.node_id.encode(), digest_size=16).digest()
            offset = int.from_bytes(digest[:8], "big") % size
            skip = int.from_bytes(digest[8:], "big") % (size - 1) + 1
            entries.append(_MaglevEntry(n.node_id, n.weight, offset, skip))
        top = max(e.weight for e in entries)
        table: list[str | None] = [None] * size
        filled, iteration = 0, 1
        while filled < size:
            for entry in entries:
                if filled == size:
                    break
                if iteration * entry.weight < entry.target:
                    continue
                entry.target += top
                c = (entry.offset + entry.skip * entry.next) % size
                while table[c] is not None:
                    entry.next += 1
                    c = (entry.offset + entry.skip * entry.next) % size
                table[c] = entry.node_id
                entry.next += 1
                filled += 1
            iteration += 1
        self.table = table

    def lookup(self, key: str) -> str | None:
        return self.table[zlib.crc32(key.encode()) % self.size]


class IndexedRing:
    """The router's lookup structure alone: the ring and its bucket index, looked up by the same key hash."""

    def __init__(self, nodes: Sequence[TableNode]) -> None:
        self.ring = Ring.build(nodes)
        self.ids = [n.node_id for n in self.ring.entries]

    def lookup(self, key: str) -> str:
        pos = zlib.crc32(key.encode())
        index = self.ring.slots[pos >> self.ring.shift]
        return self.ids[self.ring.owner(pos) if index is None else index]


def ring_or_maglev_section(quick: bool) -> None:
    nodes = cluster(100, seed=2, prefix="cmp")
    keys = [f"conversation-{i}" for i in range(20_000 if quick else 100_000)]
    t0 = time.perf_counter()
    maglev = Maglev(nodes)
    maglev_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    ring = IndexedRing(nodes)
    ring_build = time.perf_counter() - t0
    gone = nodes[17].node_id
    rest = [n for n in nodes if n.node_id != gone]
    ring_after = IndexedRing(rest)
    maglev_after = Maglev(rest)
    ring_extra = sum(1 for k in keys if ring.lookup(k) not in (gone, ring_after.lookup(k)))
    maglev_extra = sum(1 for k in keys if maglev.lookup(k) not in (gone, maglev_after.lookup(k)))
    weight = {n.node_id: n.weight for n in nodes}

    def worst_share(owner: Callable[[str], object]) -> float:
        counts: dict[object, int] = {}
        for k in keys:
            o = owner(k)
            counts[o] = counts.get(o, 0) + 1
        total_weight = sum(weight.values())
        return max(counts.get(n, 0) / (len(keys) * w / total_weight) for n, w in weight.items())

    print("\n## Ring or Maglev: bare lookups by the same CRC-32 key hash (100 nodes; Maglev table 65,537 entries)\n")
    print(
        "| structure | lookup ns (tight loop) | build ms (100 nodes) | keys moved that were not on a removed node"
        " | worst node's share / its weight share |"
    )
    print("|---|---|---|---|---|")
    print(
        f"| Prism ring (128 points per unit weight) + bucket index | {loop_ns(ring.lookup, keys):.0f} | "
        f"{ring_build * 1e3:.1f} | {ring_extra / len(keys):.2%} | {worst_share(ring.lookup):.2f} |"
    )
    print(
        f"| Maglev | {loop_ns(maglev.lookup, keys):.0f} | {maglev_build * 1e3:.1f} | "
        f"{maglev_extra / len(keys):.2%} | {worst_share(maglev.lookup):.2f} |"
    )


def apply_section() -> None:
    print("\n## Table apply (build every ring, swap one reference)\n")
    print(
        "| nodes | Prism cold ms | Prism one weight changed ms | uhashring ketama build ms"
        " | ratio (ketama / Prism changed) |"
    )
    print("|---|---|---|---|---|")
    for count in (100, 1000):
        nodes = cluster(count, seed=10 + count, prefix=f"apply{count}")
        router = Router()
        t0 = time.perf_counter()
        router.apply(table(nodes, version=1))
        cold = time.perf_counter() - t0
        warm = []
        for version in range(2, 7):
            i = version * 7 % count
            nodes[i] = TableNode(
                node_id=nodes[i].node_id, endpoint=nodes[i].endpoint, weight=random.choice(WEIGHT_STEPS)
            )
            changed = table(nodes, version=version)
            t0 = time.perf_counter()
            router.apply(changed)
            warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ketama(nodes)
        baseline = time.perf_counter() - t0
        changed_ms = statistics.median(warm) * 1e3
        print(
            f"| {count:,} | {cold * 1e3:.1f} | {changed_ms:.1f} | {baseline * 1e3:.1f}"
            f" | {baseline * 1e3 / changed_ms:.1f}× |"
        )


def _subscriber_worker(
    address: BrainAddress, count: int, routers: bool, ready: multiprocessing.Queue[int], out: multiprocessing.Queue[Any]
) -> None:
    """`count` subscribers in one process: each records time.monotonic_ns() when it has a new table (decoded, or
    applied by a Router), sent back as (version, ns) pairs when the parent says stop."""
    logging.disable(logging.INFO)
    stamps: list[tuple[int, int]] = []
    lock = threading.Lock()

    def record(version: int) -> None:
        now = time.monotonic_ns()
        with lock:
            stamps.append((version, now))

    ctx = zmq.Context()
    closers: list[Callable[[], None]] = []
    for _ in range(count):
        if routers:
            router = _StampedRouter.connect(address)
            router.record = record
            closers.append(router.close)
        else:

            def on_table(t: RoutingTable) -> bool:
                record(t.version)
                return True

            subscriber = TableSubscriber(ctx, [address], on_table, RejectCounter("bench", logging.getLogger("bench")))
            subscriber.start()
            closers.append(subscriber.stop)
    ready.put(count)
    out.get()  # the parent's "stop"
    for close in closers:
        close()
    ctx.term()
    out.put(stamps)


class _StampedRouter(Router):
    """A Router that reports when it has applied each table."""

    record: Callable[[int], None]

    def apply(self, table: RoutingTable, *, replace: bool = False, guard: bool = False) -> bool:
        applied = super().apply(table, replace=replace, guard=guard)
        if applied:
            self.record(table.version)
        return applied


def propagation_section(
    routers: bool, tables: int, processes: int = 4, subscribers: int = 100
) -> tuple[float, float, float]:
    """p50, p99 and max ms from publish() to each of `subscribers` having the table."""
    ctx = zmq.Context()
    updates, snapshot = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    publisher = TablePublisher(ctx, updates, snapshot, RejectCounter("bench-brain", logging.getLogger("bench")))
    nodes = cluster(100, seed=4, prefix="prop")
    publisher.publish(table(nodes, version=1))
    address = BrainAddress(updates, snapshot)
    mp = multiprocessing.get_context("spawn")
    ready: multiprocessing.Queue[int] = mp.Queue()
    outs = [mp.Queue() for _ in range(processes)]
    workers = [
        mp.Process(target=_subscriber_worker, args=(address, subscribers // processes, routers, ready, out))
        for out in outs
    ]
    for worker in workers:
        worker.start()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            publisher.serve_snapshots()
            time.sleep(0.002)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    for _ in workers:
        ready.get(timeout=60)
    time.sleep(2.0)  # every subscriber has its snapshot and its subscription is live
    sent: dict[int, int] = {}
    rng = random.Random(5)
    for version in range(2, tables + 2):
        i = rng.randrange(len(nodes))  # a new table changes a weight, as the brain's do
        nodes[i] = TableNode(node_id=nodes[i].node_id, endpoint=nodes[i].endpoint, weight=rng.choice(WEIGHT_STEPS))
        message = table(nodes, version=version)
        sent[version] = time.monotonic_ns()
        publisher.publish(message)
        time.sleep(0.25)
    time.sleep(1.0)
    stop.set()
    server.join()
    latencies = []
    for out in outs:
        out.put("stop")
    for out, worker in zip(outs, workers, strict=True):
        for version, ns in out.get(timeout=60):
            if version in sent:
                latencies.append((ns - sent[version]) / 1e6)
        worker.join()
    publisher.close()
    ctx.term()
    expected = tables * (subscribers // processes) * processes
    if len(latencies) != expected:
        print(f"(only {len(latencies)} of {expected} deliveries arrived)")
    return quantile(latencies, 0.5), quantile(latencies, 0.99), max(latencies)


def propagation(quick: bool) -> None:
    tables = 10 if quick else 30
    print(
        f"\n## Propagation: brain publish() → subscribers on loopback"
        f" ({tables} tables of 100 nodes, one weight changed each)\n"
    )
    print("| subscribers | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|")
    rows = (
        (False, 1, 1, "1 TableSubscriber (received and decoded)"),
        (False, 4, 100, "100 TableSubscribers, 4 processes × 25 (received and decoded)"),
        (True, 1, 1, "1 Router.connect (applied: rings built and swapped)"),
        (True, 4, 100, "100 Router.connect, 4 processes × 25 (applied)"),
    )
    for routers, processes, subscribers, name in rows:
        p50, p99, worst = propagation_section(routers, tables, processes, subscribers)
        print(f"| {name} | {p50:.2f} | {p99:.2f} | {worst:.2f} |")


# --- Mooncake conversation trace: load and prefix-cache hits ------------------------------------------------


class LruBlocks:
    """One node's prefix cache: block ids, least recently used evicted past `capacity` (None: unbounded)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def hit_blocks(self, ids: Sequence[int]) -> int:
        """Leading blocks of a request already cached (prefix caching reuses only a leading run)."""
        hits = 0
        for block in ids:
            if block not in self.blocks:
                break
            hits += 1
        return hits

    def insert(self, ids: Sequence[int]) -> None:
        for block in ids:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        if self.capacity is not None:
            while len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)


PREFILL_TOKENS_PER_S = 20_000
DECODE_S_PER_TOKEN = 0.02


def replay(
    rows: list[dict[str, object]], keys: Sequence[int | None], balance: float, capacity: int | None
) -> tuple[float, float, float]:
    """(requests max/mean, peak in flight max/mean over time, token hit rate) of 8 equal nodes on the trace."""
    nodes = [TableNode(node_id=f"w{i}", endpoint=f"w{i}:8000", weight=1.0) for i in range(8)]
    router = Router.from_table(table(nodes), settings=Settings(balance=balance))
    caches = {n.node_id: LruBlocks(capacity) for n in nodes}
    counts = dict.fromkeys(caches, 0)
    busy: list[tuple[float, int, object]] = []
    peak = dict.fromkeys(caches, 0)
    inflight = dict.fromkeys(caches, 0)
    hit_tokens = total_tokens = 0
    for seq, (row, key) in enumerate(zip(rows, keys, strict=True)):
        now = float(row["timestamp"]) / 1000  # type: ignore[arg-type]
        while busy and busy[0][0] <= now:
            _, _, lease = heapq.heappop(busy)
            lease.end()  # type: ignore[attr-defined]
            inflight[lease.node_id] -= 1  # type: ignore[attr-defined]
        lease = router.request(Request(key=key))
        lease.begin()
        node = lease.node_id
        ids: list[int] = row["hash_ids"]  # type: ignore[assignment]
        length: int = row["input_length"]  # type: ignore[assignment]
        hit = min(caches[node].hit_blocks(ids) * TRACE_BLOCK, length)
        caches[node].insert(ids)
        hit_tokens += hit
        total_tokens += length
        counts[node] += 1
        inflight[node] += 1
        peak[node] = max(peak[node], inflight[node])
        service = (length - hit) / PREFILL_TOKENS_PER_S + int(row["output_length"]) * DECODE_S_PER_TOKEN  # type: ignore[call-overload]
        heapq.heappush(busy, (now + service, seq, lease))
    mean = len(rows) / len(nodes)
    return max(counts.values()) / mean, max(peak.values()) / (sum(peak.values()) / len(peak)), hit_tokens / total_tokens


def mooncake_section(quick: bool) -> None:
    if not MOONCAKE.exists():
        print(f"\n(Mooncake trace not found at {MOONCAKE}: cache-affinity section skipped)")
        return
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    if quick:
        rows = rows[:3000]

    def prompt(row: dict[str, object], limit: int) -> list[int]:
        """The first `limit` tokens of the row's prompt."""
        ids: list[int] = row["hash_ids"]  # type: ignore[assignment]
        return mooncake_tokens(ids, min(int(row["input_length"]), limit))  # type: ignore[call-overload]

    first_block = [prefix_key(prompt(r, TRACE_BLOCK), block_size=TRACE_BLOCK, prefix_tokens=TRACE_BLOCK) for r in rows]
    prism = [prefix_key(prompt(r, 1024)) for r in rows]
    longer = [prefix_key(prompt(r, 4096), prefix_tokens=4096) for r in rows]
    rand: list[int | None] = [None] * len(rows)  # no key: a random point of the ring
    schemes: list[tuple[str, Sequence[int | None]]] = [
        ("first block only (512 tokens)", first_block),
        ("prefix_key, default (first 1,024 tokens, 16-token blocks)", prism),
        ("prefix_key, prefix_tokens=4096", longer),
        ("random", rand),
    ]
    print(
        f"\n## Mooncake conversation trace: {len(rows):,} requests on 8 equal nodes"
        f" (service = uncached prefill at {PREFILL_TOKENS_PER_S:,} tok/s"
        f" + {DECODE_S_PER_TOKEN * 1e3:.0f} ms per output token)\n"
    )
    print(
        "| key | balance | requests max/mean | peak in flight max/mean | hit rate, LRU 1,000 blocks/node"
        " | hit rate, unbounded |"
    )
    print("|---|---|---|---|---|---|")
    for name, keys in schemes:
        for balance in (0.0, 1.25, 2.0) if keys is prism else (0.0, 1.25):
            load, peak, hits = replay(rows, keys, balance, 1000)
            _, _, unbounded = replay(rows, keys, balance, None)
            print(f"| {name} | {balance:g} | {load:.2f} | {peak:.2f} | {hits:.3f} | {unbounded:.3f} |")
    print("\nUpper bound with one shared unbounded cache (every block reused if seen before, any node): ", end="")
    seen: set[int] = set()
    hit = total = 0
    for r in rows:
        ids = r["hash_ids"]
        leading = 0
        while leading < len(ids) and ids[leading] in seen:
            leading += 1
        hit += min(leading * TRACE_BLOCK, r["input_length"])
        total += r["input_length"]
        seen.update(ids)
    print(f"{hit / total:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer keys, tables and trace rows")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    print(
        f"# Router benchmark ({time.strftime('%Y-%m-%d')},"
        f" Python {'.'.join(map(str, __import__('sys').version_info[:3]))})"
    )
    lookup_section(args.quick)
    ring_or_maglev_section(args.quick)
    apply_section()
    propagation(args.quick)
    mooncake_section(args.quick)


if __name__ == "__main__":
    main()
