"""How far Prism's placement is from the same rule with perfect information, and how far that is from the baselines.

Run: .venv/bin/python bench/full_information.py [--jobs 2] [--workload tenants:1 ...] [--no-gray] [--no-p99] [--rules]
     [--lookahead]

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
Then each workload is replayed whole at 50, 80 and 95% load, as `prism eval` replays it, for TTFT p99: Prism's and
the oracle's over the best baseline's, beside the p99 floor's (no policy's p99 is under it, `_slo.ttft_floors_s`).
With `--rules` the sound search also takes the oracle under other rules (`RULES`, `SloRule`): whether any way of
spending a request's SLO, rather than a fixed factor of the least time, gets a myopic placement further. With
`--lookahead` it also takes `oracle-lookahead` (`_oracle.Lookahead`): the oracle choosing each request's node by
playing the requests to come, which it knows, on copies of the engines (a perfect forecast, rollouts of
`Lookahead.HORIZON` requests over `Lookahead.CANDIDATES` options): what looking ahead could add.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

from prismlb.router import Settings
from prismlb.sim._ablations import VARIANTS
from prismlb.sim._eval import (
    EVAL_WORKLOADS,
    PRISM,
    SEARCH_LIMIT,
    cases,
    goodput,
    policy_factories,
    replay_pool,
    run_all,
)
from prismlb.sim._oracle import FullInformation, Lookahead, Times, deepest, quickest
from prismlb.sim._report import geometric_mean
from prismlb.sim._slo import Goodput, slo_s
from prismlb.sim._types import RunResult, SimRequest
from prismlb.sim._workload import LEVELS

REFERENCES = ("oracle", "oracle-greedy")
VARIANTS["oracle"] = lambda tokens: FullInformation(block_tokens=tokens)
VARIANTS["oracle-greedy"] = lambda tokens: FullInformation(block_tokens=tokens, affinity=1.0)
LOOKAHEAD = Lookahead.name
VARIANTS[LOOKAHEAD] = lambda tokens: Lookahead(block_tokens=tokens)


class SloRule(FullInformation):
    """The oracle under another placement rule, each a way a router could spend a request's SLO
    (`_slo.slo_s`, which the oracle knows) rather than a fixed factor of the least time:
    - `budget`: the longest prefix's holder also keeps the request while its time is within `budget` × the SLO;
    - `doomed`: a request over its SLO on every node goes to the holder, where it costs the cluster least;
    - `cheapest`: among the nodes within `cheapest` × the SLO, the one holding the longest prefix (the least work
      for the cluster), the quickest of equals; the oracle's rule when none is."""

    def __init__(
        self,
        *,
        block_tokens: int,
        affinity: float = Settings().cache_affinity,
        budget: float = 0.0,
        doomed: bool = False,
        cheapest: float = 0.0,
    ) -> None:
        super().__init__(block_tokens=block_tokens, affinity=affinity)
        self.budget, self.doomed, self.cheapest = budget, doomed, cheapest

    def pick(self, request: SimRequest, times: Times) -> str:
        slo = slo_s(request, self.classes)
        if self.cheapest:
            within = {name: value for name, value in times.items() if value[0] <= self.cheapest * slo}
            if within:
                return deepest(within)
        best, deep = quickest(times), deepest(times)
        held = times[deep][1]
        if held and self.doomed and times[best][0] > slo:
            return deep
        if held and self.budget and times[deep][0] <= self.budget * slo:
            return deep
        return super().pick(request, times)


RULES: dict[str, dict[str, float]] = {
    "affinity 2": {"affinity": 2.0},
    "affinity 5": {"affinity": 5.0},
    "budget 0.5 SLO": {"budget": 0.5},
    "budget 0.8 SLO": {"budget": 0.8},
    "doomed to holder": {"doomed": True},
    "budget 0.5 SLO, doomed to holder": {"budget": 0.5, "doomed": True},
    "cheapest within 0.5 SLO": {"cheapest": 0.5},
    "cheapest within 0.8 SLO": {"cheapest": 0.8},
}
"""The other rules `--rules` searches, by name (`SloRule`'s arguments)."""
for _name, _arguments in RULES.items():
    VARIANTS[f"oracle, {_name}"] = functools.partial(
        lambda tokens, arguments: SloRule(block_tokens=tokens, **arguments), arguments=_arguments
    )
BASELINES = [name for name in policy_factories(1) if name != PRISM]
TARGET = 1.2
"""The goodput ratio to the best baseline that the placement issue asks of Prism."""
P99_TARGET = 0.8
"""The TTFT p99 ratio to the best baseline that the placement issue asks of Prism."""


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
    baselines = [p for p in policies if p in BASELINES]
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


def rules_table(found: list[Goodput], workloads: list[str], policies: list[str], rules: list[str]) -> str:
    """The Markdown table of the policies `rules` (the oracle under other rules, or looking ahead) in a search of
    `policies`, as `table` reads it: each one's goodput over the best baseline's per workload, and over all of them."""
    by = {(workload, g.policy): g.utilisation for g, workload in zip(found, _each(workloads, policies), strict=True)}
    names = {workload: g.trace for g, workload in zip(found, _each(workloads, policies), strict=True)}
    rows = [
        "| workload | best baseline | " + " | ".join(rules) + " |",
        "|---|---|" + "---:|" * len(rules),
    ]
    ratios: dict[str, list[float]] = {rule: [] for rule in rules}
    for workload in workloads:
        best = max((p for p in policies if p in BASELINES), key=lambda p: by[(workload, p)])
        base = by[(workload, best)]
        values = {rule: _ratio(by[(workload, rule)], base) for rule in rules}
        for rule, value in values.items():
            if value is not None:
                ratios[rule].append(value)
        rows.append(
            f"| {names[workload]} | {best} {_cell(base)} | " + " | ".join(_text(v) for v in values.values()) + " |"
        )
    means = [geometric_mean(values) for values in ratios.values()]
    rows.append("| geometric mean | | " + " | ".join("–" if m is None else f"{m:.3f}" for m in means) + " |")
    rows.append(
        f"| ≥ {TARGET}× | | " + " | ".join(str(sum(v >= TARGET for v in values)) for values in ratios.values()) + " |"
    )
    return "\n".join(rows)


def p99_table(results: list[RunResult], policies: list[str]) -> tuple[str, dict[str, list[float]]]:
    """The Markdown table of whole replays of `policies` (`cases`' order: by workload, load, then policy) and each
    ratio's values over its cells."""
    baselines = [p for p in policies if p in BASELINES]
    rows = [
        "| workload | load | best baseline | prism / best | oracle / best | floor / best |",
        "|---|---:|---|---:|---:|---:|",
    ]
    ratios: dict[str, list[float]] = {"prism / best": [], "oracle / best": [], "floor / best": []}
    for start in range(0, len(results), len(policies)):
        cell = {r.policy: r for r in results[start : start + len(policies)]}
        p99 = {name: r.slices["all"].ttft_p99_ms for name, r in cell.items()}
        best = min(baselines, key=lambda name: p99[name])
        base = p99[best]
        values = {
            "prism / best": p99[PRISM] / base,
            "oracle / best": p99["oracle"] / base,
            "floor / best": cell[PRISM].ttft_p99_floor_ms / base,
        }
        for key, value in values.items():
            ratios[key].append(value)
        run = cell[PRISM]
        rows.append(
            f"| {run.trace} | {run.utilisation:.0%} | {best} {base:,.0f} ms | "
            + " | ".join(f"{v:.2f}×" for v in values.values())
            + " |"
        )
    return "\n".join(rows), ratios


def summary(ratios: dict[str, list[float]], p99: bool = False) -> str:
    """Each ratio's geometric mean and range, and how many rows reach the target (the p99 one with `p99`)."""
    lines = []
    for key, values in ratios.items():
        mean = geometric_mean(values)
        if mean is None:
            continue
        if "best" not in key:
            reach = ""
        elif p99:
            reach = f", ≤ {P99_TARGET}× in {sum(v <= P99_TARGET for v in values)} of {len(values)}"
        else:
            reach = f", ≥ {TARGET}× on {sum(v >= TARGET for v in values)} of {len(values)}"
        lines.append(f"{key}: geometric mean {mean:.3f} ({min(values):.2f}–{max(values):.2f}){reach}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="replay processes")
    parser.add_argument("--workload", action="append", help="workloads (default: those of `prism eval`)")
    parser.add_argument("--no-gray", action="store_true", help="skip the search under the gray failure")
    parser.add_argument("--no-p99", action="store_true", help="skip the whole replays for TTFT p99")
    parser.add_argument("--rules", action="store_true", help="also search the oracle under each of RULES (sound)")
    parser.add_argument("--lookahead", action="store_true", help=f"also search {LOOKAHEAD} (sound)")
    parser.add_argument("--limit", type=int, default=SEARCH_LIMIT, help=f"requests per workload ({SEARCH_LIMIT})")
    args = parser.parse_args()
    workloads = args.workload or list(EVAL_WORKLOADS)
    policies = [*policy_factories(1), *REFERENCES]
    started = time.monotonic()
    with replay_pool(args.jobs) as pool:
        for degraded in (False,) if args.no_gray else (False, True):
            rules = [f"oracle, {name}" for name in RULES] if args.rules and not degraded else []
            ahead = [LOOKAHEAD] if args.lookahead and not degraded else []
            searched = [*policies, *rules, *ahead]
            found = goodput(workloads, searched, seed=1, limit=args.limit, pool=pool, degraded=degraded)
            text, ratios = table(found, workloads, searched)
            print(f"\n## Goodput{', under the gray failure' if degraded else ''}\n\n{text}\n\n{summary(ratios)}")
            if rules:
                text = rules_table(found, workloads, searched, ["oracle", *rules])
                print(f"\n## Goodput of the oracle under other rules\n\n{text}")
            if ahead:
                text = rules_table(found, workloads, searched, ["prism", "oracle", *ahead])
                print(f"\n## Goodput of the oracle looking ahead\n\n{text}")
        if not args.no_p99:
            todo = cases(workloads, policies, list(LEVELS.values()), seed=1, limit=None, kill=False)
            text, ratios = p99_table(run_all(todo, pool=pool), policies)
            print(f"\n## TTFT p99\n\n{text}\n\n{summary(ratios, p99=True)}")
    print(f"\n{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
