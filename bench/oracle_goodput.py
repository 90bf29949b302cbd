"""How far Prism's placement is from the same rule with perfect information, and how far that is from the baselines.

Run: .venv/bin/python bench/oracle_goodput.py [--jobs 2] [--workload tenants:1 --workload mooncake ...] [--no-gray]

Prism decides from what a router can know: the prefix index's KV events (delayed), its own and its peers' queued
prompt tokens (shared through the brain), each node's prefill speed as its agent measures it, the brain's weights.
`sim/_oracle.py`'s `FullInformation` decides by the same rule (the least expected time to first token, the longest
prefix's holder while within `Settings.affinity` of it) from the simulated engines' true state instead: their
caches now, their queues and the tokens each queued prompt will compute, their GPUs' true speed, foreign work
included. `oracle-greedy` takes the least true time always (affinity 1).

For each workload (default: the twenty of `prism eval`) every policy of `prism eval` and the two references are
searched for goodput as `prism eval --goodput` searches them (seed 1, 2,000 requests), on a sound cluster and under
`_eval.gray_failure`; each row gives the best baseline, Prism / best, oracle / best and Prism / oracle, measured in
the same run. Where the oracle itself is under 1.2x the best baseline, no better signal gets Prism's rule there.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

from prismlb.sim._ablations import VARIANTS
from prismlb.sim._eval import EVAL_FAMILIES, PRISM, SEARCH_LIMIT, SECOND_SEEDS, goodput, policy_factories
from prismlb.sim._oracle import FullInformation
from prismlb.sim._report import geometric_mean
from prismlb.sim._slo import Goodput
from prismlb.sim._workload import WORKLOADS

REFERENCES = ("oracle", "oracle-greedy")
VARIANTS["oracle"] = lambda tokens: FullInformation(block_tokens=tokens)
VARIANTS["oracle-greedy"] = lambda tokens: FullInformation(block_tokens=tokens, affinity=1.0)
TARGET = 1.2
"""The goodput ratio to the best baseline that the placement issue asks of Prism."""


def _each(workloads: list[str], policies: list[str]) -> list[str]:
    """The workload of each of `goodput`'s rows."""
    return [workload for workload in workloads for _ in policies]


def _cell(value: float) -> str:
    return f"{value:.0%}" if value > 0 else "< 10%"


def _ratio(value: float, baseline: float) -> float | None:
    return value / baseline if value > 0 and baseline > 0 else None


def _text(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}×"


def table(found: list[Goodput], workloads: list[str], policies: list[str]) -> tuple[str, dict[str, list[float]]]:
    """The Markdown table of one search of `policies` on `workloads` (`goodput`'s rows, in its order: by workload,
    then policy) and each ratio's values over its rows."""
    by = {(workload, g.policy): g.utilisation for g, workload in zip(found, _each(workloads, policies), strict=True)}
    names = {workload: g.trace for g, workload in zip(found, _each(workloads, policies), strict=True)}
    baselines = [p for p in policies if p != PRISM and p not in REFERENCES]
    header = (
        "| workload | prism | oracle | oracle-greedy | best baseline | prism / best | oracle / best | prism / oracle |"
    )
    rows = [header, "|---|---:|---:|---:|---|---:|---:|---:|"]
    ratios: dict[str, list[float]] = {"prism / best": [], "oracle / best": [], "prism / oracle": []}
    for workload in workloads:
        best = max(baselines, key=lambda p: by[(workload, p)])
        base = by[(workload, best)]
        prism, oracle, greedy = (by[(workload, p)] for p in (PRISM, *REFERENCES))
        values = {
            "prism / best": _ratio(prism, base),
            "oracle / best": _ratio(oracle, base),
            "prism / oracle": _ratio(prism, oracle),
        }
        for key, value in values.items():
            if value is not None:
                ratios[key].append(value)
        rows.append(
            f"| {names[workload]} | {_cell(prism)} | {_cell(oracle)} | {_cell(greedy)} | {best} {_cell(base)} | "
            + " | ".join(_text(v) for v in values.values())
            + " |"
        )
    return "\n".join(rows), ratios


def summary(ratios: dict[str, list[float]]) -> str:
    """Each ratio's geometric mean and range, and how many rows reach the target."""
    lines = []
    for key, values in ratios.items():
        mean = geometric_mean(values)
        if mean is None:
            continue
        reach = f", ≥ {TARGET}× on {sum(v >= TARGET for v in values)} of {len(values)}" if "best" in key else ""
        lines.append(f"{key}: geometric mean {mean:.3f} ({min(values):.2f}–{max(values):.2f}){reach}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="replay processes")
    parser.add_argument("--workload", action="append", help="workloads (default: those of `prism eval`)")
    parser.add_argument("--no-gray", action="store_true", help="skip the search under the gray failure")
    parser.add_argument("--limit", type=int, default=SEARCH_LIMIT, help=f"requests per workload ({SEARCH_LIMIT})")
    args = parser.parse_args()
    workloads = args.workload or [*WORKLOADS, *SECOND_SEEDS, *EVAL_FAMILIES]
    policies = [*policy_factories(1), *REFERENCES]
    started = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for degraded in (False,) if args.no_gray else (False, True):
            found = goodput(workloads, policies, seed=1, limit=args.limit, pool=pool, degraded=degraded)
            text, ratios = table(found, workloads, policies)
            print(f"\n## Goodput{', under the gray failure' if degraded else ''}\n\n{text}\n\n{summary(ratios)}")
    print(f"\n{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
