"""Topology in the cluster replay: cross-NUMA routing and expert-load spread on hosts of eight GPUs.

Run: .venv/bin/python bench/topology.py [--requests 4000] [--seed 1] [--hosts 1] [--quick]

The MoE workload (`sim/_topology.py`, `moe`: Zipf-popular expert groups) at 80% of the cluster's prefill capacity
on hosts of eight L40S, GPUs 0-3 on NUMA node 0 and 4-7 on NUMA node 1, one engine per GPU, replayed through
Prism three ways (per-GPU entries from host agents with routers that know their NUMA node; the same without the
NUMA node; each GPU's engine a node of its own, NUMA unseen) and the NUMA-blind baselines. Two gateway layouts:
one in-host gateway per NUMA node (balanced), and three on NUMA node 0 beside one on node 1 (skewed, three
quarters of the requests from node 0). Per policy: the share of requests served across NUMA nodes from their
gateway, the GPUs' expert load (prompt tokens served) as standard deviation over mean, TTFT p50/p99 and the
prefix-cache hit rate; the design targets (8×A100 across NUMA/PCIe domains) beside them. `--quick` replays 300
requests per run (a smoke test, not a measurement). Results: docs/topology.md.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence

from prismlb.sim._report import MISSING, _md_table, format_ms, format_pct
from prismlb.sim._topology import UTILISATION, TopologyRun, host_cluster, moe, replay, variants

LAYOUTS: dict[str, tuple[int, ...]] = {"balanced": (0, 1), "skewed": (0, 0, 0, 1)}
"""Gateway layouts by name: each gateway's NUMA node; requests take the gateways in turn."""
DESIGN: tuple[tuple[str, float, float], ...] = (
    ("design target, topology-unaware", 0.372, 0.48),
    ("design target, Prism", 0.091, 0.13),
)
"""(row, cross-NUMA share, expert-load standard deviation over mean) that Prism's design sets for 8×A100 across
NUMA/PCIe domains."""
QUICK_REQUESTS = 300


def _row(name: str, summary: str, run: TopologyRun) -> list[str]:
    overall = run.result.slices["all"]
    return [
        name,
        summary,
        format_pct(run.result.cross_numa_share),
        f"{run.load_spread:.2f}",
        format_ms(overall.ttft_p50_ms),
        format_ms(overall.ttft_p99_ms),
        format_pct(run.result.kv_hit_rate),
    ]


def table(runs: Sequence[tuple[str, str, TopologyRun]]) -> str:
    """One layout's rows, then the design targets."""
    header = ["policy", "entries", "cross-NUMA %", "GPU load std/mean", "TTFT p50 ms", "TTFT p99 ms", "KV hit %"]
    rows = [_row(name, summary, run) for name, summary, run in runs]
    rows += [
        [name, MISSING, format_pct(cross), f"{spread:.2f}", MISSING, MISSING, MISSING] for name, cross, spread in DESIGN
    ]
    return _md_table(header, rows, text_columns=(0, 1))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000, help="requests per run (default 4000)")
    parser.add_argument("--seed", type=int, default=1, help="the workload's seed (default 1)")
    parser.add_argument("--hosts", type=int, default=1, help="hosts of eight GPUs (default 1)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests per run: a smoke test")
    args = parser.parse_args(argv)
    logging.getLogger("prism").setLevel(logging.ERROR)
    requests = QUICK_REQUESTS if args.quick else args.requests
    workload = moe(args.seed, requests)
    cluster = host_cluster(args.hosts)
    started = time.monotonic()
    print(
        f"{workload.name}: {requests} requests at {UTILISATION:.0%} utilisation on {args.hosts} host(s) of "
        f"{cluster[0].gpus} {cluster[0].gpu_class.upper()}, GPUs 0-{cluster[0].gpus // 2 - 1} on NUMA node 0 and "
        f"{cluster[0].gpus // 2}-{cluster[0].gpus - 1} on NUMA node 1"
    )
    for layout, gateways in LAYOUTS.items():
        runs = [
            (name, variant.summary, replay(workload, name, cluster, seed=args.seed, gateways_numa=gateways))
            for name, variant in variants(workload.block_tokens, cluster, gateways).items()
        ]
        nodes = ", ".join(str(k) for k in gateways)
        print(f"\n### {layout} gateways (NUMA nodes {nodes})\n\n{table(runs)}")
    print(f"\n{2 * len(runs)} runs in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
