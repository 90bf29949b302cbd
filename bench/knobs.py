"""The router's main knobs swept across every workload, so that the library's defaults are chosen on all of
them at once and never on one trace.

Run: .venv/bin/python bench/knobs.py [--level 80%] [--limit 1000] [--jobs 2]

Each variant is Prism in the cluster replay (`prism eval`'s clusters and scaling) with one `Settings` changed
from the library's defaults (the first row, "defaults", is `Settings()` itself). Every shared trace and every
workload family preset (seed 1) runs at the same load; the table gives each variant's TTFT p99 over the
defaults' on the same workload (below 1: the variant is better there) and the geometric mean over all
workloads, which is what a default has to win.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

from prismlb.router import Settings
from prismlb.sim._cluster import Simulation
from prismlb.sim._eval import _levels, _workload, capacity, cluster_for, replay_pool
from prismlb.sim._families import PRESETS
from prismlb.sim._prism import PrismPolicy
from prismlb.sim._workload import WORKLOADS, scale_to_utilisation

VARIANTS: dict[str, dict[str, object]] = {
    "defaults": {},
    "balance 1.25": {"balance": 1.25},
    "balance 1.1": {"balance": 1.1},
    "balance off": {"balance": 0.0},
    "prefix memory off": {"prefix_memory": 0},
    "load = requests": {"load": "requests", "prefix_memory": 0},
    "slow first token 300 ms": {"slow_s": 0.3},
    "slow first token 1 s": {"slow_s": 1.0},
    "slow first token 10 s": {"slow_s": 10.0},
    "slow first token 30 s": {"slow_s": 30.0},
    "slow first token 60 s": {"slow_s": 60.0},
    "slow first token 120 s": {"slow_s": 120.0},
    "300 ms, open circuits uncapped": {"slow_s": 0.3, "max_open_share": 1.0},
    "cache affinity 1 (off)": {"cache_affinity": 1.0},
    "cache affinity 1.5": {"cache_affinity": 1.5},
    "cache affinity 2": {"cache_affinity": 2.0},
    "cache affinity 5": {"cache_affinity": 5.0},
}
"""Each variant's changes to `Settings()`."""


def run(args: tuple[str, str, float, int]) -> tuple[str, str, float, float]:
    """(workload, variant, TTFT p99 ms, KV hit rate) of one replay."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("prism").setLevel(logging.CRITICAL)
    trace, variant, level, limit = args
    workload, _ = _workload(trace, 1, limit)
    nodes = cluster_for(trace, workload)
    tokens, media = capacity(nodes)
    scaled = scale_to_utilisation(workload, level, tokens, encoder_s_per_media=media)
    settings = dataclasses.replace(Settings(), **VARIANTS[variant])  # type: ignore[arg-type]
    policy = PrismPolicy(block_tokens=workload.block_tokens, settings=settings)
    result = Simulation(scaled, policy, nodes, utilisation=level, seed=1).run()
    return workload.name, variant, result.slices["all"].ttft_p99_ms, result.kv_hit_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", type=_levels, default=[0.8], help="the load, e.g. 80%% (default)")
    parser.add_argument("--limit", type=int, default=1000, help="requests per workload (default 1000)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    traces = [*WORKLOADS, *(f"{name}:1" for name in PRESETS)]
    todo = [(t, v, args.level[0], args.limit) for t in traces for v in VARIANTS]
    started = time.monotonic()
    with replay_pool(args.jobs) as pool:
        results = pool.map(run, todo)
    p99 = {(w, v): ms for w, v, ms, _ in results}
    hit = {(w, v): rate for w, v, _, rate in results}
    names = list(dict.fromkeys(w for w, _, _, _ in results))
    print(f"TTFT p99 over the defaults' at {args.level[0]:.0%} load, {args.limit} requests per workload")
    print(f"(defaults: {Settings()})")
    print()
    print("| variant | " + " | ".join(names) + " | geo. mean |")
    print("|---|" + "---:|" * (len(names) + 1))
    for variant in VARIANTS:
        ratios = [p99[(w, variant)] / p99[(w, "defaults")] for w in names]
        cells = [f"{p99[(w, variant)]:.0f} ms" if variant == "defaults" else f"{r:.2f}" for w, r in zip(names, ratios)]
        mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"| {variant} | " + " | ".join(cells) + f" | {mean:.3f} |")
    print()
    print("| KV hit % | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for variant in VARIANTS:
        print(f"| {variant} | " + " | ".join(f"{100 * hit[(w, variant)]:.1f}" for w in names) + " |")
    print(f"\n{len(results)} runs in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
