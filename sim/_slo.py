"""Per-request TTFT SLOs, SLO attainment and goodput (`prism eval --goodput`).

A request's SLO is one a well-run cluster can meet:

    SLO(request) = max(τ0 of its slice, SLO_SCALE × its unloaded TTFT on the slowest GPU class of its slice's pool)

The unloaded TTFT is what the engine model (`_model.EngineModel`) gives the request alone on an idle node: its
media encoders plus its whole prompt at the class's prefill rate (no queue, no cache hit, no decode batch to
share steps with). τ0 (`semantics.TAU0_MS`) is the slice's interactive tolerance, the floor for short prompts;
the scaled term takes over for long ones, which no router can prefill within τ0.

The rule and its constants are the project's one TTFT target (`prismlb.semantics.ttft_slo_s`), which Prism's
router also orders the requests it holds back by (`Settings.hold_tokens`).

Slices come from the request's signature as the router maps them (`prismlb.semantics.parse_signature`), pools
from the node labels as the brain forms them (`brain._slices.pools`, an empty pool falling back along its
chain): the rules Prism routes by.

Attainment is the share of a run's requests whose TTFT meets their SLO; a request that failed or never
finished misses. Goodput (DistServe's definition) is the highest offered load at which at least
GOODPUT_TARGET of the requests meet their SLO, searched per policy by bisection over the utilisation.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prismlb.brain._slices import fallback, pools
from prismlb.semantics import SLO_SCALE, Slice, parse_signature, ttft_slo_s
from prismlb.wire import NodeMetrics, NodeVector

from ._cluster import NodeSpec
from ._model import PROFILES, GpuClass, cached_tokens
from ._types import SimRequest, Workload

GOODPUT_TARGET = 0.9
"""Share of requests that must meet their SLO for a load to count towards goodput (DistServe's 90%)."""
SEARCH_START = 0.8
"""The goodput search's first probe (utilisation: offered prefill work, without cache reuse, over prefill
capacity); it then doubles or halves."""
SEARCH_DOUBLINGS = (-3, 4)
"""How far it doubles and halves: from SEARCH_START × 2^-3 = 10% to SEARCH_START × 2^4 = 1280%. The top is far
above 100% because utilisation counts prompts without their cache hits: a workload whose prompts hit the cache
93% of the time offers a node a tenth of its nominal prefill work."""
SEARCH_LOW = SEARCH_START * 2.0 ** SEARCH_DOUBLINGS[0]
SEARCH_HIGH = SEARCH_START * 2.0 ** SEARCH_DOUBLINGS[1]
SEARCH_STEPS = 5
"""Bisection steps (of the load's logarithm) once a doubling brackets the edge: the found load is within a factor
2^(1/2^5) ≈ 1.022 of the lowest failing load probed."""


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


def unloaded_ttft_s(request: SimRequest, gpu_class: GpuClass, uncached: int | None = None) -> float:
    """The request's TTFT alone on an idle node of the class: encoders plus the prefill of its `uncached` prompt
    tokens (default: the whole prompt)."""
    profile = PROFILES[gpu_class]
    tokens = request.input_tokens if uncached is None else uncached
    return profile.media_s(request.media) + tokens / profile.prefill_tokens_per_s


def ttft_floors_s(workload: Workload, nodes: Sequence[NodeSpec]) -> dict[int, float]:
    """Each request's least possible TTFT on these nodes, by id: its encoders and its prompt's uncached tokens on an
    idle node of the quickest class for it, with every block of every request that arrived before it (or at the same
    moment) cached, as one infinite cache holding everything would have it. Queues, decode interference and evictions
    only add to it, so no policy's TTFT, and no policy's percentile, is below it: what a tail target can ask for."""
    classes = sorted({n.gpu_class for n in nodes})
    block = workload.block_tokens
    seen: set[int] = set()
    floors: dict[int, float] = {}
    for _, arriving in itertools.groupby(workload.requests, key=lambda r: r.arrival_s):
        moment = list(arriving)
        together: dict[int, int] = {}  # requests of this moment holding each block
        for r in moment:
            for b in set(r.blocks):
                together[b] = together.get(b, 0) + 1
        for r in moment:
            hit = 0
            for b in r.blocks:
                if b not in seen and together[b] < 2:  # neither seen before nor held by another of its moment
                    break
                hit += 1
            uncached = r.input_tokens - cached_tokens(r.input_tokens, r.media_tokens, hit, block)
            floors[r.id] = min(unloaded_ttft_s(r, c, uncached) for c in classes)
        for r in moment:
            seen.update(r.blocks)
    return floors


def slo_s(request: SimRequest, classes: Mapping[Slice, frozenset[GpuClass]], scale: float = SLO_SCALE) -> float:
    """The request's TTFT SLO in seconds, given the pool classes of the cluster (`pool_classes`); `scale` in place of
    SLO_SCALE scores against another multiple of the unloaded TTFT (`bench/slo_rules.py`)."""
    slice_ = slice_of(request)
    slowest = max((unloaded_ttft_s(request, c) for c in classes[slice_]), default=0.0)
    return ttft_slo_s(slice_, slowest, scale)


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
    curve: tuple[tuple[float, float], ...] = ()
    """Every probe of the search as (arrival rate in requests/s, attainment), by rate: the attainment curve."""


Pair = tuple[str | Path, str]
"""(trace, policy): a trace key as `prism eval` takes it (name, family spec or file) and a policy name."""
Probe = tuple[str | Path, str, float]
"""(trace, policy, utilisation) to run."""


@dataclass(frozen=True, slots=True)
class Found:
    """One pair's search: the highest passing load and the lowest failing one, and every probe."""

    load: float
    """The highest load probed that passed; 0 when none did."""
    attainment: float
    """Its attainment (SEARCH_LOW's when none passed)."""
    above: float | None
    """The lowest load probed that failed; None when SEARCH_HIGH passed."""
    above_attainment: float | None
    probes: tuple[tuple[float, float], ...]
    """(utilisation, attainment) of every probe, by utilisation."""


def _load(doubling: float) -> float:
    return SEARCH_START * 2.0**doubling


def _next(results: dict[float, float]) -> float | None:
    """The next doubling exponent to probe for one pair given its results so far (exponent → attainment), or
    None when its search is done."""
    passed = [e for e, value in results.items() if value >= GOODPUT_TARGET]
    failed = [e for e, value in results.items() if value < GOODPUT_TARGET]
    low, high = SEARCH_DOUBLINGS
    if not results:
        return 0.0
    if not failed:
        top = max(passed)
        return top + 1 if top < high else None
    if not passed:
        bottom = min(failed)
        return bottom - 1 if bottom > low else None
    below, above = max(passed), min(failed)  # probes stay inside the bracket, so every failure lies above
    return (below + above) / 2 if above - below > 2.0**-SEARCH_STEPS else None


def search(pairs: Sequence[Pair], measure: Callable[[Sequence[Probe]], Sequence[float]]) -> dict[Pair, Found]:
    """Per (trace, policy) pair, the highest utilisation at which attainment ≥ GOODPUT_TARGET.

    Each pair starts at SEARCH_START and doubles (or halves) until the target flips or the range
    (SEARCH_DOUBLINGS) ends, then bisects the bracketing doubling SEARCH_STEPS times in log scale. Probes stay
    near each pair's edge, where a replay is cheap: low loads stretch the simulated time, which Prism's brain
    ticks through. `measure` runs a batch of probes and returns their attainments in order; all pairs advance
    together, one batch per step, so a step's runs go through the replay's process pool at once. The points
    probed depend only on the outcomes, so a deterministic replay gives a deterministic search. Attainment is
    assumed to fall with load: the found load is the highest passing one below the lowest failing one.
    """
    results: dict[Pair, dict[float, float]] = {pair: {} for pair in pairs}
    while True:
        todo = [(pair, e) for pair in pairs if (e := _next(results[pair])) is not None]
        if not todo:
            break
        values = measure([(t, p, _load(e)) for (t, p), e in todo])
        for (pair, e), value in zip(todo, values, strict=True):
            results[pair][e] = value
    out = {}
    for pair in pairs:
        probes = results[pair]
        passed = [e for e, value in probes.items() if value >= GOODPUT_TARGET]
        failed = [e for e, value in probes.items() if value < GOODPUT_TARGET]
        found = max(passed, default=None)
        above = min(failed, default=None)
        out[pair] = Found(
            0.0 if found is None else _load(found),
            probes[min(probes) if found is None else found],
            None if above is None else _load(above),
            None if above is None else probes[above],
            tuple((_load(e), probes[e]) for e in sorted(probes)),
        )
    return out


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
