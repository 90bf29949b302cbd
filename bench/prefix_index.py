"""PrefixIndex against its budgets: memory for 1M cached blocks on 1,000 nodes, match() of a 64-block prompt, and
the throughput of the engines' stored/removed events; the C tables and the pure-Python fallback side by side.

Run: .venv/bin/python bench/prefix_index.py   (about 20 s)

The cluster: 1,000 nodes, each with 1,000 cached blocks of random 64-bit hashes (1,000,000 distinct blocks).

Memory is what the index keeps once every node's `stored` event is in, each event's list of hashes freed as the
router frees a decoded event. It is measured in a fresh child process per kind of table, twice: tracemalloc's
traced bytes (the Python objects, which for the pure-Python tables includes the int hashes their dicts keep
alive, and the C tables, which `_fastroute` allocates with PyMem_* and tracemalloc therefore traces too), and
separately, without tracemalloc's own overhead, the process's RSS delta, as a cross-check. The budget applies to
the tracemalloc figure.

match: 1,000 prompts of 64 blocks, the first 36 to 44 of each held by 1 to 3 of the nodes, on top of the million
blocks above; each call timed alone with perf_counter_ns (the timer's own median cost subtracted) through the
public PrefixIndex.match, cycling over the prompts so that consecutive calls read different parts of the table.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from prismlb.router import _index
from prismlb.router._index import PrefixIndex

NODES = 1_000
PER_NODE = 1_000
PROMPTS = 1_000
PROMPT_BLOCKS = 64
MEMORY_BUDGET_MIB = 64.0
MATCH_BUDGET_US = 3.0
MATCH_CALLS = {"C": 200_000, "Python": 50_000}
NOW = 1000.0
MIB = 2**20
KINDS = ("C", "Python")


@contextmanager
def tables(kind: str) -> Iterator[None]:
    """PrefixIndex objects created inside use the C tables ("C") or the pure-Python ones ("Python")."""
    saved = _index.fastroute
    if kind == "Python":
        _index.fastroute = None
    try:
        yield
    finally:
        _index.fastroute = saved


def new_index(kind: str) -> PrefixIndex:
    with tables(kind):
        index = PrefixIndex()
    assert (type(index._tables) is _index._PyTables) == (kind == "Python")
    return index


def events(seed: int = 0) -> Iterator[tuple[str, list[int]]]:
    """Each node's stored event: its id and 1,000 random 64-bit block hashes."""
    rng = random.Random(seed)
    for n in range(NODES):
        yield f"node-{n:04d}", [rng.getrandbits(64) for _ in range(PER_NODE)]


def memory_child(kind: str, how: str) -> int:
    """Bytes the index keeps after every stored event, by tracemalloc or by RSS (run in a fresh process)."""
    process = psutil.Process()
    gc.collect()
    if how == "tracemalloc":
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    else:
        base = process.memory_info().rss
    index = new_index(kind)
    for node, blocks in events():
        index.stored(node, blocks)
    del node, blocks
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base if how == "tracemalloc" else process.memory_info().rss - base
    assert len(index) == NODES * PER_NODE
    return used


def memory(kind: str, how: str) -> float:
    """memory_child() in a fresh interpreter, so that neither kind's freed memory or tracemalloc skews the other."""
    out = subprocess.run(
        [sys.executable, __file__, "--memory", kind, how], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[-1]) / MIB


def prompts(index: PrefixIndex, seed: int = 1) -> list[list[int]]:
    """64-block prompts whose first 36 to 44 blocks 1 to 3 nodes hold, stored into `index`."""
    rng = random.Random(seed)
    nodes = [f"node-{n:04d}" for n in range(NODES)]
    out = []
    for _ in range(PROMPTS):
        prompt = [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)]
        for node in rng.sample(nodes, rng.randint(1, 3)):
            index.stored(node, prompt[: rng.randint(36, 44)])
        out.append(prompt)
    return out


def timer_cost_ns() -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(10_000):
        start = clock()
        samples.append(clock() - start)
    return statistics.median(samples)


def match_us(index: PrefixIndex, prompts_: list[list[int]], calls: int) -> tuple[float, float]:
    """p50 and p99 of single match() calls, in µs."""
    for prompt in prompts_:
        depths = index.match(prompt, NOW)
        assert 1 <= len(depths) <= 3 and all(36 <= d <= 44 for d in depths.values()), depths
    clock, match, cost = time.perf_counter_ns, index.match, timer_cost_ns()
    samples = []
    for i in range(calls):
        prompt = prompts_[i % PROMPTS]
        start = clock()
        match(prompt, NOW)
        samples.append(clock() - start - cost)
    samples.sort()
    return samples[len(samples) // 2] / 1000, samples[len(samples) * 99 // 100] / 1000


def run(kind: str) -> dict[str, float]:
    """Event throughput and match latency for one kind of table, in this process."""
    lists = list(events())
    index = new_index(kind)
    start = time.perf_counter()
    for node, blocks in lists:
        index.stored(node, blocks)
    stored = NODES * PER_NODE / (time.perf_counter() - start)
    p50, p99 = match_us(index, prompts(index), MATCH_CALLS[kind])
    held = len(index)
    start = time.perf_counter()
    for node, blocks in lists:
        index.removed(node, blocks)
    removed = NODES * PER_NODE / (time.perf_counter() - start)
    assert len(index) == held - NODES * PER_NODE
    return {"stored": stored, "removed": removed, "p50": p50, "p99": p99}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", nargs=2, metavar=("KIND", "HOW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory:
        print(memory_child(*args.memory))
        return
    built = _index.fastroute is not None
    kinds = KINDS if built else KINDS[1:]
    results = {kind: run(kind) for kind in kinds}
    for kind in kinds:
        results[kind]["tracemalloc"] = memory(kind, "tracemalloc")
        results[kind]["rss"] = memory(kind, "rss")

    rows = [  # label, result, divisor, format, budget (C must stay within it), budget as printed
        ("memory, 1M blocks / 1,000 nodes, tracemalloc (MiB)", "tracemalloc", 1, "{:.1f}", MEMORY_BUDGET_MIB, "<="),
        ("memory, same, RSS delta (MiB)", "rss", 1, "{:.1f}", None, "(cross-check)"),
        ("match, 64-block prompt, p50 (us)", "p50", 1, "{:.2f}", MATCH_BUDGET_US, "<="),
        ("match, 64-block prompt, p99 (us)", "p99", 1, "{:.2f}", None, "-"),
        ("stored events (M blocks/s)", "stored", 1e6, "{:.2f}", None, "none set"),
        ("removed events (M blocks/s)", "removed", 1e6, "{:.2f}", None, "none set"),
    ]
    print(
        f"PrefixIndex: {NODES:,} nodes x {PER_NODE:,} random 64-bit blocks; {PROMPTS:,} {PROMPT_BLOCKS}-block prompts"
    )
    print(f"{'':52} {'C':>9} {'Python':>9}  {'budget':<14} C within")
    for label, key, divisor, fmt, budget, shown in rows:
        c, py = (fmt.format(results[kind][key] / divisor) if kind in results else "not built" for kind in KINDS)
        verdict = "" if budget is None or not built else "yes" if results["C"][key] <= budget else "NO"
        print(f"{label:52} {c:>9} {py:>9}  {shown if budget is None else f'{shown} {budget:g}':<14} {verdict}")


if __name__ == "__main__":
    main()
