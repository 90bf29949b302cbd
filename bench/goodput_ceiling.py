"""How much load any router could serve on each workload of `prism eval`, against the issue's goodput target
(1.2 × the best baseline's goodput).

Run: .venv/bin/python bench/goodput_ceiling.py [--results docs/results]

The cache-bound capacity is the load (`prism eval`'s utilisation: offered prefill work without cache hits over the
cluster's prefill capacity) at which the work left with one infinite cache shared by every node (each prompt's
blocks seen anywhere earlier in the run cached, `infinite_cache_hit_rate`; encoders never spared) equals the
cluster's capacity: `1 / (1 − bound × prompt work / all work)`. Past it no placement keeps up, the queues grow for
the rest of the run, and goodput beyond it comes only from the backlog a run leaves to its end (at 2,000 requests a
run's arrivals span 35-50 s, and a request may wait 10 s in the router's room), not from capacity. It is not a hard
bound, then, but a target at or above it asks a router to serve more than the cluster can compute. The workloads
are the search's (2,000 requests, seed 1); the goodputs come from the last full run's summary (`--results`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from prismlb.sim._eval import EVAL_WORKLOADS, PRISM, SEARCH_LIMIT, _workload, capacity, cluster_for
from prismlb.sim._workload import offered_utilisation

TARGET = 1.2
"""The goodput target as a multiple of the best baseline's goodput."""


def recorded(summary: str) -> dict[str, tuple[float, float]]:
    """{workload: (best baseline's goodput %, Prism's goodput %)} from a summary's goodput table (the first one:
    the sound cluster's). A cell at the search's bounds ("≥ 1280%", "< 10%") reads as the bound."""
    table = summary.split("## Goodput\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    out = {}
    for line in rows[2:]:
        cells = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        best = cells["best baseline"]
        if best not in cells:  # no baseline served it
            continue
        out[cells["workload"]] = (_percent(cells[best]), _percent(cells[PRISM]))
    return out


def _percent(cell: str) -> float:
    match = re.search(r"([\d.]+)%", cell)
    if match is None:
        raise ValueError(f"no goodput in {cell!r}")
    return float(match.group(1))


def ceiling(spec: str) -> tuple[str, float, float]:
    """(workload name, prefix-hit bound, cache-bound capacity as a utilisation) of one workload of the search."""
    workload, bound = _workload(spec, 1, SEARCH_LIMIT)
    tokens, media = capacity(cluster_for(spec, workload))
    prompt = offered_utilisation(workload, tokens)
    share = prompt / offered_utilisation(workload, tokens, encoder_s_per_media=media)
    return workload.name, bound, 1 / (1 - bound * share)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("docs/results"), help="the last full run's report")
    args = parser.parse_args()
    goodputs = recorded((args.results / "summary.md").read_text())
    print(
        f"{'workload':14} {'hit bound %':>11} {'capacity %':>10} {'best %':>7} {'target %':>8} "
        f"{'target / capacity':>17} {'Prism %':>7} {'Prism / capacity':>16}"
    )
    over = []
    for spec in EVAL_WORKLOADS:
        name, bound, top = ceiling(spec)
        if name not in goodputs:
            continue
        best, prism = goodputs[name]
        target = TARGET * best
        if target >= 100 * top:
            over.append(name)
        print(
            f"{name:14} {100 * bound:11.1f} {100 * top:10.0f} {best:7.0f} {target:8.0f} "
            f"{target / (100 * top):17.2f} {prism:7.0f} {prism / (100 * top):16.2f}"
        )
    print(f"\n{len(over)} of {len(goodputs)} workloads have a goodput target at or above the cache-bound capacity")
    if over:
        print(f"({', '.join(over)})")


if __name__ == "__main__":
    main()
