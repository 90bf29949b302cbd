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

The decode-adjusted capacity also counts what the engine model charges every prefill for the decode batch it runs
beside (`sim/_model.py`: `1 + DECODE_INTERFERENCE × decoding / max_batch`), whichever router placed it: at a load,
the sequences decoding per node follow from Little's law, the request rate times each request's decode time
(`output − 1` tokens at `tpot_s` of that batch) over the nodes, and a load is within it while its work left by the
infinite cache, so stretched, fits the cluster. The mean decode batch is a steady state's, which a 35-50 s run
reaches only after its first seconds (on Azure conv at 75% the replay's prefills are stretched 1.29× against the
1.33× it gives).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from pathlib import Path

from prismlb.sim._cluster import NodeSpec
from prismlb.sim._eval import EVAL_WORKLOADS, PRISM, SEARCH_LIMIT, _workload, capacity, cluster_for, request_rate
from prismlb.sim._model import DECODE_INTERFERENCE, PROFILES
from prismlb.sim._types import Workload
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


def ceiling(spec: str) -> tuple[str, float, float, float]:
    """(workload name, prefix-hit bound, cache-bound capacity, decode-adjusted capacity; both as a utilisation) of
    one workload of the search."""
    workload, bound = _workload(spec, 1, SEARCH_LIMIT)
    nodes = cluster_for(spec, workload)
    tokens, media = capacity(nodes)
    prompt = offered_utilisation(workload, tokens)
    share = prompt / offered_utilisation(workload, tokens, encoder_s_per_media=media)
    top = 1 / (1 - bound * share)
    per_load = request_rate(spec, 1, SEARCH_LIMIT, 1.0)  # requests per second at 100%, proportional to the load
    low, high = 0.0, top
    for _ in range(40):  # the stretch grows with the load: bisect for the load whose stretched work fits
        load = (low + high) / 2
        if load * decode_stretch(workload, nodes, load * per_load) <= top:
            low = load
        else:
            high = load
    return workload.name, bound, top, low


def decode_stretch(workload: Workload, nodes: Sequence[NodeSpec], rate: float) -> float:
    """The mean factor by which the decode batches stretch prefill when `rate` requests per second of `workload`
    arrive at `nodes` (weighed by each node's prefill speed); inf once decoding cannot keep up.

    Each node decodes `d = a · tpot(d)` sequences (Little's law, `a` its share of the rate times a request's
    output tokens after the first), and `tpot(d) = (1 + slope · (d − 1)) / decode speed` is linear in `d`, so
    `d = a · c0 / (1 − a · c1)` with `c0`, `c1` the nodes' mean intercept and slope."""
    profiles = [PROFILES[node.gpu_class] for node in nodes]
    outputs = sum(request.output_tokens - 1 for request in workload.requests) / len(workload.requests)
    arrivals = rate * outputs / len(nodes)
    intercept = sum((1 - p.decode_batch_slope) / p.decode_tokens_per_s for p in profiles) / len(profiles)
    slope = sum(p.decode_batch_slope / p.decode_tokens_per_s for p in profiles) / len(profiles)
    if arrivals * slope >= 1:
        return math.inf
    decoding = arrivals * intercept / (1 - arrivals * slope)
    speed = sum(p.prefill_tokens_per_s for p in profiles)
    return sum(p.prefill_tokens_per_s * (1 + DECODE_INTERFERENCE * decoding / p.max_batch) for p in profiles) / speed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("docs/results"), help="the last full run's report")
    args = parser.parse_args()
    goodputs = recorded((args.results / "summary.md").read_text())
    print(
        f"{'workload':14} {'hit bound %':>11} {'capacity %':>10} {'decode-adj. %':>13} {'best %':>7} {'target %':>8} "
        f"{'target / decode-adj.':>20} {'Prism %':>7} {'Prism / decode-adj.':>19}"
    )
    over, over_adjusted = [], []
    for spec in EVAL_WORKLOADS:
        name, bound, top, adjusted = ceiling(spec)
        if name not in goodputs:
            continue
        best, prism = goodputs[name]
        target = TARGET * best
        if target >= 100 * top:
            over.append(name)
        if target >= 100 * adjusted:
            over_adjusted.append(name)
        print(
            f"{name:14} {100 * bound:11.1f} {100 * top:10.0f} {100 * adjusted:13.0f} {best:7.0f} {target:8.0f} "
            f"{target / (100 * adjusted):20.2f} {prism:7.0f} {prism / (100 * adjusted):19.2f}"
        )
    for label, names in (("cache-bound", over), ("decode-adjusted", over_adjusted)):
        print(f"\n{len(names)} of {len(goodputs)} workloads have a goodput target at or above the {label} capacity")
        if names:
            print(f"({', '.join(names)})")


if __name__ == "__main__":
    main()
