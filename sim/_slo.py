"""Per-request TTFT SLOs, SLO attainment and goodput (`prism eval --goodput`).

A request's SLO is one a well-run cluster can meet:

    SLO(request) = max(τ0 of its slice, SLO_SCALE × its unloaded TTFT on the slowest GPU class of its slice's pool)

The unloaded TTFT is what the engine model (`_model.EngineModel`) gives the request alone on an idle node: its
media encoders plus its whole prompt at the class's prefill rate (no queue, no cache hit, no decode batch to
share steps with). τ0 (`brain.TAU0_MS`) is the slice's interactive tolerance, the floor for short prompts;
the scaled term takes over for long ones, which no router can prefill within τ0.

SLO_SCALE = 5, after DistServe (OSDI'24), which sets TTFT SLOs as multiples of a single-request baseline latency,
and Mooncake (FAST'25), which sets its TTFT threshold as a multiple of the TTFT of a single request processed
without interference. 5× lets a request wait behind a few prompts of its own size and still meet its SLO,
while one stuck behind a hot node's backlog misses it.

Slices come from the request's signature as the router maps them (`prismlb.wire.parse_signature`), pools
from the node labels as the brain forms them (`brain._slices.pools`, an empty pool falling back along its
chain): the rules Prism routes by.

Attainment is the share of a run's requests whose TTFT meets their SLO; a request that failed or never
finished misses. Goodput (DistServe's definition) is the highest offered load at which at least
GOODPUT_TARGET of the requests meet their SLO, searched per policy by bisection over the utilisation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prismlb.brain import TAU0_MS
from prismlb.brain._slices import fallback, pools
from prismlb.wire import NodeMetrics, NodeVector, Slice, parse_signature

from ._cluster import NodeSpec
from ._model import PROFILES, GpuClass
from ._types import SimRequest, Workload

SLO_SCALE = 5.0
"""TTFT SLO as a multiple of the request's unloaded TTFT on its pool's slowest class (DistServe, Mooncake)."""
GOODPUT_TARGET = 0.9
"""Share of requests that must meet their SLO for a load to count towards goodput (DistServe's 90%)."""
SEARCH_LOW = 0.1
SEARCH_HIGH = 1.5
"""The goodput search's range of utilisation (offered prefill work over prefill capacity)."""
SEARCH_STEPS = 6
"""Bisection steps after the two ends: the found load is within (HIGH − LOW) / 2^6 ≈ 2.2 points of the edge."""


def slice_of(request: SimRequest) -> Slice:
    """The slice the router sends the request to, from its modality signature."""
    return parse_signature(request.signature)[0]


def pool_classes(nodes: Sequence[NodeSpec]) -> dict[Slice, frozenset[GpuClass]]:
    """The GPU classes of each slice's pool on the cluster, an empty pool taking its fallback's."""
    vectors = [
        NodeVector(
            node_id=n.name,
            host=n.name,
            endpoint=n.name,
            labels={"gpu": n.gpu_class, **(n.labels or {})},
            seq=0,
            sample_time_unix_s=0.0,
            period_s=1.0,
            metrics=NodeMetrics(),
        )
        for n in nodes
    ]
    classes = {n.name: n.gpu_class for n in nodes}
    members = pools(vectors)
    nonempty = [s for s, names in members.items() if names]
    out: dict[Slice, frozenset[GpuClass]] = {}
    for slice_, names in members.items():
        target = slice_ if names else fallback(slice_, nonempty)
        out[slice_] = frozenset(classes[name] for name in members[target]) if target is not None else frozenset()
    return out


def unloaded_ttft_s(request: SimRequest, gpu_class: GpuClass) -> float:
    """The request's TTFT alone on an idle node of the class: encoders plus the whole prompt's prefill."""
    profile = PROFILES[gpu_class]
    return profile.media_s(request.media) + request.input_tokens / profile.prefill_tokens_per_s


def slo_s(request: SimRequest, classes: Mapping[Slice, frozenset[GpuClass]]) -> float:
    """The request's TTFT SLO in seconds, given the pool classes of the cluster (`pool_classes`)."""
    slice_ = slice_of(request)
    slowest = max((unloaded_ttft_s(request, c) for c in classes[slice_]), default=0.0)
    return max(TAU0_MS[slice_] / 1000, SLO_SCALE * slowest)


def attainment(workload: Workload, ttft_s: Mapping[int, float], nodes: Sequence[NodeSpec]) -> float:
    """Share of the workload's requests whose TTFT (by request id; absent: failed or unfinished) meets its SLO."""
    classes = pool_classes(nodes)
    met = sum(1 for r in workload.requests if r.id in ttft_s and ttft_s[r.id] <= slo_s(r, classes))
    return met / len(workload.requests)


@dataclass(frozen=True, slots=True)
class Goodput:
    """One policy's goodput on one workload."""

    trace: str
    policy: str
    utilisation: float
    """The highest load searched at which attainment was at least GOODPUT_TARGET (0: not even SEARCH_LOW)."""
    requests_per_s: float
    """The same load as an arrival rate (0 when the utilisation is)."""
    attainment: float
    """Attainment at that load (at SEARCH_LOW when none passed)."""
    above: float | None
    """The lowest load searched that missed the target (None: SEARCH_HIGH passed)."""
    above_attainment: float | None


Pair = tuple[str | Path, str]
"""(trace, policy): a trace key as `prism eval` takes it (name, family spec or file) and a policy name."""
Probe = tuple[str | Path, str, float]
"""(trace, policy, utilisation) to run."""
Found = tuple[float, float, float | None, float | None]
"""(found load, its attainment, load above, its attainment): see `search`."""


def search(pairs: Sequence[Pair], measure: Callable[[Sequence[Probe]], Sequence[float]]) -> dict[Pair, Found]:
    """Bisect each (trace, policy) pair's utilisation for the highest at which attainment ≥ GOODPUT_TARGET.

    `measure` runs a batch of probes and returns their attainments in order; all pairs advance together, one
    batch per step, so the runs of a step go through the replay's process pool at once. The steps and the
    points probed depend only on the outcomes, so a deterministic replay gives a deterministic search.
    Returns per pair (found load, its attainment, load above, its attainment); the invariant is that the found
    load passed and the load above failed, or the found load is SEARCH_HIGH (above None), or nothing passed
    (found load 0, with SEARCH_LOW as the load above).
    """
    ends = measure([(t, p, u) for t, p in pairs for u in (SEARCH_LOW, SEARCH_HIGH)])
    state: dict[Pair, list[float]] = {}
    done: dict[Pair, Found] = {}
    for i, pair in enumerate(pairs):
        low, high = ends[2 * i], ends[2 * i + 1]
        if high >= GOODPUT_TARGET:
            done[pair] = (SEARCH_HIGH, high, None, None)
        elif low < GOODPUT_TARGET:
            done[pair] = (0.0, low, SEARCH_LOW, low)
        else:
            state[pair] = [SEARCH_LOW, low, SEARCH_HIGH, high]
    for _ in range(SEARCH_STEPS):
        if not state:
            break
        todo = list(state)
        mids = [(state[p][0] + state[p][2]) / 2 for p in todo]
        for pair, mid, value in zip(todo, mids, measure([(t, p, m) for (t, p), m in zip(todo, mids)]), strict=True):
            if value >= GOODPUT_TARGET:
                state[pair][0:2] = [mid, value]
            else:
                state[pair][2:4] = [mid, value]
    for pair, (lo, lo_value, hi, hi_value) in state.items():
        done[pair] = (lo, lo_value, hi, hi_value)
    return {pair: done[pair] for pair in pairs}


def format_goodput(rows: Sequence[Goodput]) -> str:
    """A Markdown table, rows as given; "vs best baseline" is a row's goodput over the highest non-Prism
    goodput on the same workload (– when that is 0 or there is none)."""
    best: dict[str, float] = {}
    for row in rows:
        if row.policy != "prism":
            best[row.trace] = max(best.get(row.trace, 0.0), row.utilisation)
    lines = [
        f"Goodput: the highest load with ≥ {GOODPUT_TARGET:.0%} of requests within their TTFT SLO "
        f"(max(τ0, {SLO_SCALE:g}× unloaded TTFT)), searched over {SEARCH_LOW:.0%}–{SEARCH_HIGH:.0%} utilisation",
        "",
        "| workload | policy | goodput (utilisation) | goodput (req/s) | attainment there | vs best baseline |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        reference = best.get(row.trace, 0.0)
        ratio = f"{row.utilisation / reference:.2f}×" if reference > 0 else "–"
        load = f"< {SEARCH_LOW:.1%}" if row.utilisation == 0 else f"{row.utilisation:.1%}"
        load = f"≥ {load}" if row.above is None else load
        lines.append(
            f"| {row.trace} | {row.policy} | {load} | {row.requests_per_s:.2f} | {row.attainment:.1%} | {ratio} |"
        )
    return "\n".join(lines)
