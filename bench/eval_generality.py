"""Does Prism's goodput lead hold where its defaults were never looked at: workload presets at seeds no default was
chosen on, and clusters of other sizes and GPU mixes than `prism eval`'s two?

Run: .venv/bin/python bench/eval_generality.py [--jobs 2] [--limit 2000] [--part seeds|shapes|length|decode|all]

Every policy of `prism eval` (Prism with the library's defaults, every baseline) is searched for its goodput
(`sim._slo.search`: the highest load with 90% of requests within their own TTFT SLO) exactly as `prism eval
--goodput` searches it, in one process pool:

- held-out seeds: every workload family preset at seeds 3 and 4. `prism eval` replays seeds 1 and 2, which are
  what every default was measured on; other seeds draw other tenants, sessions, documents and arrivals from the
  same distributions.
- cluster shapes (`prism eval --cluster`): the shared traces Mooncake and Azure conv and the families tenants,
  sessions, agentic and bursty at seed 1, on a mixed fleet labelled as its agents would label it (two H100s with
  NVLink, four A100s, two L40S with CUDA Graphs: text on every GPU class, so per-node speeds and the pools'
  generalists matter), on three A100s and on twenty-four.
- longer runs (`--part length`, not in `all`): `prism eval`'s own 20 workloads with four times the search's
  requests (`--long-limit`). At 2,000 requests a run's arrivals span 35-50 s on most workloads, and what a policy
  holds back until after the last arrival is served on an idle cluster; a lead that is the end of the run's doing
  shrinks when the run is four times as long.
- reasoning-length replies (`--part decode`, not in `all`): the `reasoning` family (`sim._families.reasoning`, the
  tenants' chat mix with replies ten times as long at the median) at seeds 1 to 4. Every preset's replies are chat
  length, so the engines' prefill is what runs out first; here their KV cache and decode batch do, which no
  router's prefill accounting sees. Beside the policies, the ablation `no-admit-wait` (Prism without the brain's
  wait for KV-cache room, `_registry.admit_ms`) shows what that signal earns where the cache is what runs out.

Each table is `prism eval`'s goodput summary: a column per policy, the best baseline and Prism's ratio to it.
"""

from __future__ import annotations

import argparse
import os
import time

from prismlb.sim._ablations import format_ablations
from prismlb.sim._eval import EVAL_WORKLOADS, SEARCH_LIMIT, goodput, parse_cluster, policy_factories, replay_pool
from prismlb.sim._families import PRESETS
from prismlb.sim._report import goodput_summary

HELD_OUT_SEEDS = (3, 4)
SHAPES = {
    "mixed: 2 H100 + 4 A100 + 2 L40S": "h100:2:nvlink=yes,a100:4,l40s:2:cuda_graphs=yes",
    "small: 3 A100": "a100:3",
    "large: 24 A100": "a100:24",
}
SHAPE_WORKLOADS = ("mooncake", "azure-conv", "tenants:1", "sessions:1", "agentic:1", "bursty:1")
DECODE_WORKLOADS = ("reasoning:1", "reasoning:2", "reasoning:3", "reasoning:4")
DECODE_ABLATIONS = ("no-admit-wait",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="replay processes")
    parser.add_argument("--limit", type=int, default=SEARCH_LIMIT, help="requests per replay (as prism eval's search)")
    parser.add_argument("--long-limit", type=int, default=4 * SEARCH_LIMIT, help="requests per replay in --part length")
    parser.add_argument("--part", choices=("seeds", "shapes", "length", "decode", "all"), default="all")
    args = parser.parse_args()
    for spec in SHAPES.values():
        parse_cluster(spec)  # a bad spec stops the bench before any run
    policies = list(policy_factories(1))
    started = time.monotonic()
    with replay_pool(args.jobs) as pool:
        if args.part in ("seeds", "all"):
            traces = [f"{name}:{seed}" for seed in HELD_OUT_SEEDS for name in PRESETS]
            rows = goodput(traces, policies, seed=1, limit=args.limit, jobs=args.jobs, pool=pool)
            print(f"## Held-out seeds {', '.join(map(str, HELD_OUT_SEEDS))}\n\n{goodput_summary(rows)}\n", flush=True)
        if args.part in ("shapes", "all"):
            for title, spec in SHAPES.items():
                rows = goodput(
                    list(SHAPE_WORKLOADS), policies, seed=1, limit=args.limit, jobs=args.jobs, pool=pool, cluster=spec
                )
                print(f"## Cluster {title} (`--cluster {spec}`)\n\n{goodput_summary(rows)}\n", flush=True)
        if args.part == "length":
            rows = goodput(list(EVAL_WORKLOADS), policies, seed=1, limit=args.long_limit, jobs=args.jobs, pool=pool)
            print(f"## {args.long_limit} requests per run\n\n{goodput_summary(rows)}\n", flush=True)
        if args.part == "decode":
            rows = goodput(
                list(DECODE_WORKLOADS),
                [*policies, *DECODE_ABLATIONS],
                seed=1,
                limit=args.limit,
                jobs=args.jobs,
                pool=pool,
            )
            compared = [r for r in rows if r.policy not in DECODE_ABLATIONS]
            print(f"## Reasoning-length replies\n\n{goodput_summary(compared)}\n", flush=True)
            print(f"### Ablation\n\n{format_ablations(rows)}\n", flush=True)
    print(f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
