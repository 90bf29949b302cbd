"""Does Prism's goodput lead depend on the SLO it is scored against?

Run: .venv/bin/python bench/slo_rules.py [--jobs 2] [--limit 2000] [--part scale|target|classes|all]
     [--workloads mooncake,tenants:1,...]

`prism eval` scores every request against `max(τ0, 5 × its unloaded TTFT)` and counts a load as served while 90%
of requests meet it (`sim._slo`), and Prism's routers order their waiting rooms by the same rule. A service may keep
another. Each part searches the goodput of Prism and the strongest baselines (SGLang, llm-d with both weightings,
Dynamo) exactly as `prism eval --goodput` does, with the scorer changed in every replay process and in this one:

- `scale`: the SLO at 3 and at 10 times the unloaded TTFT. Prism twice: with the library's defaults, and told the
  service's SLO (`Settings.slo_scale`, what `prism gateway --slo-scale` sets).
- `target`: 99% of requests within the eval's SLO instead of 90%.
- `classes`: two classes in one stream. Every request whose id hashes into the lowest 30% is batch work, due within
  `BATCH_S` (or the eval's rule, if longer); the rest are interactive, due by the eval's rule. Prism twice: with the
  defaults, and told each batch request's SLO (`Request.slo_s`, what the `X-SLO-TTFT-Ms` header sets).

Each table is `prism eval`'s goodput summary, Prism (the defaults) against the best baseline, then the same with
Prism told the SLO in its place.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
from collections.abc import Mapping, Sequence

from prismlb.router import Request, Settings
from prismlb.semantics import Slice
from prismlb.sim import _ablations, _slo
from prismlb.sim._eval import EVAL_WORKLOADS, SEARCH_LIMIT, goodput, replay_pool
from prismlb.sim._model import GpuClass
from prismlb.sim._prism import PrismPolicy
from prismlb.sim._report import goodput_summary
from prismlb.sim._slo import Goodput
from prismlb.sim._types import SimRequest

Classes = Mapping[Slice, frozenset[GpuClass]]
"""The pool classes of a cluster, as the scorer takes them (`sim._slo.pool_classes`)."""

BASELINES = ("sglang", "llm-d", "llm-d-chart", "dynamo-kv")
TOLD = "prism-told"
"""Prism told the service's SLO: the variant each part registers."""
SCALES = (3.0, 10.0)
STRICT_TARGET = 0.99
BATCH_SHARE = 0.3
BATCH_S = 30.0
"""A batch request's TTFT SLO: work a caller wants done within half a minute, not at once."""

_RULE = _slo.slo_s
"""The eval's SLO rule, before any part replaces it."""
_TARGET = _slo.GOODPUT_TARGET
"""The eval's attainment target, likewise."""


def is_batch(request: SimRequest) -> bool:
    """Whether the `classes` part makes `request` batch work: its id's Fibonacci hash in the lowest BATCH_SHARE."""
    return (request.id * 0x9E37_79B1 & 0xFFFF_FFFF) < BATCH_SHARE * 2**32


class _ToldBatch(PrismPolicy):
    """Prism whose callers state each batch request's SLO, as the `X-SLO-TTFT-Ms` header does."""

    def _request(self, request: SimRequest) -> Request:
        described = super()._request(request)
        return dataclasses.replace(described, slo_s=BATCH_S) if is_batch(request) else described


def score(part: str, scale: float) -> None:
    """Replace the scorer (and register `TOLD`) for `part`, in the process that calls it: each replay process
    through the pool's initializer, and this one, where the search reads the attainment."""
    _slo.GOODPUT_TARGET = STRICT_TARGET if part == "target" else _TARGET
    if part == "scale":
        _slo.slo_s = functools.partial(_RULE, scale=scale)
        _ablations.VARIANTS[TOLD] = lambda b: PrismPolicy(block_tokens=b, settings=Settings(slo_scale=scale))
    elif part == "classes":
        _slo.slo_s = _classes_rule
        _ablations.VARIANTS[TOLD] = lambda b: _ToldBatch(block_tokens=b)
    else:
        _slo.slo_s = _RULE


def _classes_rule(request: SimRequest, classes: Classes) -> float:
    """Batch requests due within BATCH_S (or the eval's rule, if longer), the rest by the eval's rule."""
    rule = _RULE(request, classes)
    return max(BATCH_S, rule) if is_batch(request) else rule


def told_in_place(rows: Sequence[Goodput]) -> list[Goodput]:
    """The rows with Prism told the SLO standing as Prism (for `goodput_summary`), the defaults' rows left out."""
    return [dataclasses.replace(r, policy="prism") if r.policy == TOLD else r for r in rows if r.policy != "prism"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="replay processes")
    parser.add_argument("--limit", type=int, default=SEARCH_LIMIT, help="requests per replay (as prism eval's search)")
    parser.add_argument("--part", choices=("scale", "target", "classes", "all"), default="all")
    parser.add_argument("--workloads", help="comma-separated workloads (default: prism eval's 20)")
    args = parser.parse_args()
    workloads = args.workloads.split(",") if args.workloads else list(EVAL_WORKLOADS)
    runs = [("scale", s) for s in SCALES] + [("target", _slo.SLO_SCALE), ("classes", _slo.SLO_SCALE)]
    started = time.monotonic()
    for part, scale in runs:
        if args.part not in (part, "all"):
            continue
        score(part, scale)
        told = part != "target"
        policies = ["prism", *([TOLD] if told else []), *BASELINES]
        with replay_pool(args.jobs, initializer=functools.partial(score, part, scale)) as pool:
            rows = goodput(workloads, policies, seed=1, limit=args.limit, jobs=args.jobs, pool=pool)
        title = {
            "scale": f"SLO {scale:g} × the unloaded TTFT",
            "target": f"{STRICT_TARGET:.0%} of requests within the eval's SLO",
            "classes": f"{BATCH_SHARE:.0%} batch requests due within {BATCH_S:g} s, the rest by the eval's SLO",
        }[part]
        defaults = [r for r in rows if r.policy != TOLD]
        print(f"## {title}: Prism with the library's defaults\n\n{goodput_summary(defaults)}\n", flush=True)
        if told:
            print(f"### Prism told the SLO\n\n{goodput_summary(told_in_place(rows))}\n", flush=True)
    print(f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
