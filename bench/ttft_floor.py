"""How low a TTFT p99 any router could reach on each workload of `prism eval`, against the issue's p99 target
(0.8 × the best baseline's p99).

Run: .venv/bin/python bench/ttft_floor.py [--results docs/results]

The floor is the p99 of each request's least possible TTFT on the workload's cluster (`sim._slo.ttft_floors_s`):
alone on an idle node of the quickest GPU class for it, with every block of every earlier request cached as one
infinite cache would hold it. Queues, decode interference and evictions only add to a request's TTFT, so no
policy's p99 is under the floor, and a target under it cannot be met by any router. The best baseline's and
Prism's p99 come from the last full run's tables (`--results`, written by `prism eval`); the floors are computed
here, for every shared trace (Mooncake and mm at seeds 1 and 2) and every workload family preset at seeds 1
and 2, as that run replays them.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from prismlb.sim._eval import EVAL_WORKLOADS, _p99_floor_ms, _workload

LEVELS = ("50%", "80%", "95%")
TARGET = 0.8
"""The p99 target as a share of the best baseline's p99."""


def recorded(text: str, level: str) -> tuple[float, float]:
    """(best baseline's p99 ms, Prism's p99 ms) of one level's table in a workload's report."""
    section = text.split(f"· {level} utilisation", 1)[1].split("\n## ", 1)[0]
    best = re.search(r"Best baseline: \S+ \(TTFT p99 ([\d.]+) ms\)", section)
    prism = re.search(r"^\| prism \| [^|]+ \| ([\d.]+) \|", section, re.MULTILINE)
    if best is None or prism is None:
        raise ValueError(f"no best baseline or Prism row at {level}")
    return float(best.group(1)), float(prism.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("docs/results"), help="the last full run's report")
    args = parser.parse_args()
    print(
        f"{'workload':14} {'level':>5} {'floor ms':>9} {'best ms':>9} {'target ms':>9} {'reachable':>9} {'Prism ms':>9}"
    )
    unreachable = cells = 0
    for spec in EVAL_WORKLOADS:
        workload, _ = _workload(spec, 1, None)
        floor = _p99_floor_ms(spec, 1, None)
        text = (args.results / f"{workload.name}.md").read_text()
        for level in LEVELS:
            best, prism = recorded(text, level)
            target = TARGET * best
            reachable = target >= floor
            cells += 1
            unreachable += not reachable
            print(
                f"{workload.name:14} {level:>5} {floor:9.0f} {best:9.0f} {target:9.0f} "
                f"{'yes' if reachable else 'no':>9} {prism:9.0f}"
            )
    print(f"\n{unreachable} of {cells} cells have a p99 target under the floor: no router can meet them")


if __name__ == "__main__":
    main()
