"""Per-slice routing weights: health, derated by alarms (and, where `latency` asks, latency sensitivity), floored,
held with hysteresis.

For a node in a slice's pool (`_slices`):

    raw = quality / best quality in the pool [× s(τ̂) with `latency`],   quality = health × 0.5^(alarming dimensions),
    s(τ) = 1 / (1 + (τ/τ0)²)

The latency factor s(τ̂) is the design's, and off by default (`LATENCY_WEIGHTS`, `BrainConfig.latency_weights`):
a node's tail latency under load is mostly its queue, which routers already weigh (their own and their peers'
queued prefill at the node's measured speed, docs/router.md), so stretching its expected time by its latency
counts the queue twice, and on the ring the weights move keys between nodes as latencies move. Measured in the
replay (goodput of `prism eval`'s search, all 20 workloads, docs/eval.md): weights of health alone keep 1.02×
the goodput of the design's weights by expected time and 1.05× on the ring, on a sound cluster, and 1.02× and
1.03× under the gray failure.

Quality counts relative to the pool's healthiest member (all equal when none has any): weights set shares
of one pool's traffic, and a condition every member shares (a trace with little prefix reuse puts every
node past the KV-miss alarm) must not single out whichever node had a lucky window.

quality is averaged over the node's vectors (`_registry.QUALITY_SMOOTHING_S`, 15 s) and τ̂ over the brain's
predictions (`_brain.PREDICTION_SMOOTHING_S`, 30 s): one window's noise (a quiet second with no prefix-cache
misses, a lucky P99) must not swing a weight, or every node in turn becomes the hot spot.

τ̂ is the node's first-token (first-frame) P99 for the slice: the predictor's forecast of that slice's own
latency when it has one (of its engine-wide latency for a node without a series of the slice's own,
`_features.slice_predictions`), else the node's observed TTFT P99 for that slice, else its engine-wide TTFT P99.
Each slice's τ̂ is its own, so a node serving images and audio is weighed for audio by its audio latency, not by
its slower images. A node with none of these takes the median sensitivity of its pool's measured nodes (1.0 when
none is measured), so a newcomer is treated as a typical member rather than as the fastest or slowest.

The reference is τ0 while the pool's median τ̂ is within it, else that median: s = 1 / (1 + (τ̂ / max(τ0,
median τ̂))²). With τ0 alone, a pool running past its tolerance (every node at several times τ0) would sit
at the floor but for a node whose last window happened to be quiet, which would then take up to 20 times
its neighbours' share and become the next hot spot (measured in the cluster replay, docs/eval.md); against
the pool's median, a node at the median weighs 0.5 and one at twice the median 0.2, whatever the load.

τ0 per slice, from the design's first-token tolerances (calibrated on measured P95):

| slice | design's class | τ0 |
|---|---|---|
| llm | LLM text generation | 800 ms |
| vlm | high-resolution image | 1200 ms |
| av | real-time speech | 250 ms |
| rag | LLM text generation (retrieval adds to the same text answer) | 800 ms |

The held weight is `raw` rounded to steps of 0.05, never below 0.05 (a live node in a pool always keeps some
traffic, so its latency stays measured) nor above 1.0, and moves only when `raw` drifts more than 0.075 from
it. Topology-aware slices (`_topology`) hold one weight per GPU, `raw` × the GPU's PCIe factor.

A slice's overflow entries (nodes outside its pool whose model serves it, `_slices.overflow`) are weighed the
same way, their quality against the pool's best (at most 1) and their τ̂ against their own median.

Each entry also carries the node's `model_version` label, its load (requests_running + requests_waiting,
whichever are known; split evenly over per-GPU entries), the predictor's P99 for the slice, if any, its
prefill speed (`prefill_rate`), which routers weigh a node's queued prompt tokens by, and the network stall a
request there can expect from its kernel's retransmits (`published_stall`), which routers add to its expected
time to first token, and the wait for room in its KV cache (`published_admit`), which routers take instead of its
queued prefill when longer.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping

from prismlb.semantics import ENGINE_LATENCY_KEY, TAU0_MS, Slice, held_speed
from prismlb.wire import MAX_MS, MAX_TABLE_VALUE, NodeVector, TableNode

from ._registry import EntryKey, NodeState, admit_ms
from ._slices import overflow, pools
from ._topology import TOPOLOGY_SLICES, WHOLE_NODE, gpu_entries

WEIGHT_STEP = 0.05
WEIGHT_FLOOR = 0.05
HYSTERESIS = 0.075

Predictions = Mapping[str, Mapping[Slice, float]]
"""Predicted first-token P99 in ms by node id, then slice."""


LATENCY_WEIGHTS = False
"""Whether weights also weigh each node's latency sensitivity s(τ̂) (the module docstring says why not by default)."""


def sensitivity(tau_ms: float, tau0_ms: float) -> float:
    """The design's s(τ) = 1 / (1 + (τ/τ0)²): 1 at τ = 0, 0.5 at τ = τ0, towards 0 as τ grows.

    Saturating: τ is taken within [0, MAX_MS] (NaN as MAX_MS), so no input can overflow the square."""
    tau = min(max(tau_ms, 0.0), MAX_MS) if tau_ms == tau_ms else MAX_MS
    return 1.0 / (1.0 + (tau / tau0_ms) ** 2)


def quantise(raw: float) -> float:
    """`raw` in steps of WEIGHT_STEP, clamped to [WEIGHT_FLOOR, 1.0]."""
    return max(WEIGHT_FLOOR, min(1.0, round(round(raw / WEIGHT_STEP) * WEIGHT_STEP, 6)))


def hold(held: float | None, raw: float) -> float:
    """The weight to publish: `held` unless `raw` moved more than HYSTERESIS from it."""
    if held is None or abs(raw - held) > HYSTERESIS:
        return quantise(raw)
    return held


def observed_p99_ms(vector: NodeVector, slice_: Slice) -> float | None:
    """The node's measured TTFT P99 for the slice, else over all its engine's requests."""
    for key in (slice_.value, ENGINE_LATENCY_KEY):
        latency = vector.latency.get(key)
        if latency is not None and latency.ttft_p99_ms is not None:
            return latency.ttft_p99_ms
    return None


def _predicted(predictions: Predictions, node_id: str, slice_: Slice) -> float | None:
    per_node = predictions.get(node_id)
    value = None if per_node is None else per_node.get(slice_)
    return value if value is not None and math.isfinite(value) and 0.0 <= value <= MAX_TABLE_VALUE else None


def gpu_label(vector: NodeVector) -> str:
    """A node's GPU class as its `gpu` label gives it ("" when unlabelled): the peers whose speed it takes before
    it has measured its own."""
    return vector.labels.get("gpu", "")


def median_speeds(states: Iterable[NodeState], group: Callable[[NodeVector], str] = gpu_label) -> dict[str, float]:
    """The median measured prefill speed (`NodeState.measured_rate`) of each group of nodes (by default a GPU class);
    a group none of whose nodes has measured one is absent."""
    measured: dict[str, list[float]] = {}
    for state in states:
        rate = state.measured_rate
        if rate:
            measured.setdefault(group(state.vector), []).append(rate)
    return {name: statistics.median(rates) for name, rates in measured.items()}


def prefill_rates(states: Mapping[str, NodeState]) -> dict[str, float]:
    """Each node's prefill speed in prompt tokens per second to publish, held in its state (`held_speed`): its
    latest own measure (`NodeState.measured_rate`), else the median of the measured nodes of its GPU class
    (`median_speeds`), so that a node that has not prefilled yet is expected to run like its peers. Absent for a
    node of no GPU label or of a class none of whose nodes has measured one: each router then stands in for it with
    its own callers' first tokens there, on the measured nodes' scale, else the median of the table's speeds
    (`router._snapshot`). A fleet's median here would take a slow GPU for a typical one for as long as its first
    16 prefills take, while the first requests placed on it stick to it (its cached prefixes)."""
    typical = median_speeds(states.values())
    out: dict[str, float] = {}
    for node_id, state in states.items():
        label = gpu_label(state.vector)
        rate = state.measured_rate or (typical.get(label) if label else None)
        if not rate:
            state.prefill_rate = None
            continue
        state.prefill_rate = held_speed(rate, state.prefill_rate)
        out[node_id] = state.prefill_rate
    return out


STALL_STEP_MS = 10.0
STALL_HYSTERESIS_MS = 7.5
"""A node's published network stall moves in steps of 10 ms, and only when its average drifts more than 7.5 ms
from it; under 7.5 ms it is not published: a sound network's occasional retransmit is no table change."""


def published_stall(state: NodeState) -> float | None:
    """The node's network stall to publish in ms (`_registry.stall_ms`, averaged), held with hysteresis in its
    state; None while near 0 or unmeasured."""
    held = state.published_stall_ms or 0.0
    stall = state.stall_ms
    if stall is None:
        held = 0.0
    elif abs(stall - held) > STALL_HYSTERESIS_MS:
        held = round(stall / STALL_STEP_MS) * STALL_STEP_MS
    state.published_stall_ms = held or None
    return state.published_stall_ms


ADMIT_STEP_MS = 10.0
"""The wait for cache room is published in steps of this (as the network stall is), so a table changes only when
the wait does by a step."""


def published_admit(vector: NodeVector) -> float | None:
    """The node's wait for KV-cache room to publish in ms (`_registry.admit_ms` of its latest vector, not averaged:
    a cache is full now, and empties as its requests end), in steps of 10 ms; None under 5 ms."""
    wait = admit_ms(vector.metrics)
    if wait is None:
        return None
    return round(wait / ADMIT_STEP_MS) * ADMIT_STEP_MS or None


def _load(vector: NodeVector) -> float | None:
    parts = [v for v in (vector.metrics.requests_running, vector.metrics.requests_waiting) if v is not None]
    return float(sum(parts)) if parts else None


def _sensitivities(
    states: Iterable[NodeState], predictions: Predictions, slice_: Slice, tau0_ms: float
) -> dict[str, float]:
    """s(τ̂) per node of one pool against the pool's reference latency, the unmeasured ones at the pool's median."""
    taus: dict[str, float] = {}
    unmeasured: list[str] = []
    for state in states:
        node_id = state.vector.node_id
        tau = _predicted(predictions, node_id, slice_)
        tau = observed_p99_ms(state.vector, slice_) if tau is None else tau
        if tau is None:
            unmeasured.append(node_id)
        else:
            taus[node_id] = tau
    reference = max(tau0_ms, statistics.median(taus.values())) if taus else tau0_ms
    measured = {node_id: sensitivity(tau, reference) for node_id, tau in taus.items()}
    typical = statistics.median(measured.values()) if measured else 1.0
    return measured | dict.fromkeys(unmeasured, typical)


def compute_weights(
    states: Mapping[str, NodeState],
    predictions: Predictions,
    *,
    latency: bool = LATENCY_WEIGHTS,
    tau0_ms: Mapping[Slice, float] = TAU0_MS,
    topology_slices: frozenset[Slice] = TOPOLOGY_SLICES,
) -> dict[Slice, list[TableNode]]:
    """Every slice's entries, sorted by node and GPU; updates each state's held weights (the hysteresis memory).
    `latency`: each weight also times the node's latency sensitivity s(τ̂) for the slice (the predictions, else
    its observed P99).

    A slice whose pool is empty maps to an empty list; entries a node no longer has are forgotten.
    """
    held: dict[str, dict[EntryKey, float]] = {node_id: {} for node_id in states}
    rates = prefill_rates(states)
    stalls = {node_id: published_stall(state) for node_id, state in states.items()}
    admits = {node_id: published_admit(state.vector) for node_id, state in states.items()}
    result: dict[Slice, list[TableNode]] = {}
    members = pools(s.vector for s in states.values())
    extra = overflow((s.vector for s in states.values()), members)
    for slice_, pool_ids in members.items():
        pool = [states[node_id] for node_id in sorted(pool_ids)]
        spill_ids = set(extra[slice_])
        spill = [states[node_id] for node_id in sorted(spill_ids)]
        sens: dict[str, float] = {}
        if latency:
            tau0 = tau0_ms[slice_]
            sens = _sensitivities(pool, predictions, slice_, tau0) | _sensitivities(spill, predictions, slice_, tau0)
        best = max((state.quality for state in pool), default=0.0)
        entries: list[TableNode] = []
        for state in pool + spill:
            vector = state.vector
            raw = min(1.0, state.quality / best if best > 0 else 1.0) * sens.get(vector.node_id, 1.0)
            load = _load(vector)
            predicted = _predicted(predictions, vector.node_id, slice_)
            rate = rates.get(vector.node_id)
            stall = stalls[vector.node_id]
            admit = admits[vector.node_id]
            model_version = vector.labels.get("model_version", "")
            node_held = held[vector.node_id]
            for entry in gpu_entries(vector) if slice_ in topology_slices else (WHOLE_NODE,):
                key = (slice_, entry.gpu)
                weight = node_held[key] = hold(state.weights.get(key), raw * entry.factor)
                entries.append(
                    TableNode(
                        node_id=vector.node_id,
                        endpoint=vector.endpoint,
                        weight=weight,
                        zone=vector.zone,
                        model_version=model_version,
                        load=None if load is None else load * entry.share,
                        predicted_p99_ms=predicted,
                        prefill_tokens_per_s=None if rate is None else rate * entry.share,
                        stall_ms=stall,
                        admit_ms=admit,
                        gpu=entry.gpu,
                        numa_node=entry.numa_node,
                        gpu_class=gpu_label(vector),
                        overflow=vector.node_id in spill_ids,
                    )
                )
        result[slice_] = entries
    for node_id, state in states.items():
        state.weights = held[node_id]
    return result
