"""Ablations: Prism with one part switched off, replayed beside the full Prism (`prism eval --ablations`).

Each variant is the replay's Prism (`_prism.PrismPolicy` with the library's settings) but for the one part its
docstring names, switched off through a seam of the replay (a brain subclass, a policy argument) or one of the
router's documented settings, never through a branch added for the purpose: what a variant loses against the
full Prism is what that part earns.
`VARIANTS` lists them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec

from prismlb.brain import Brain, BrainConfig, NodeState
from prismlb.brain._predictor import PredictorConfig
from prismlb.brain._weights import gpu_label, median_speeds
from prismlb.router import Settings
from prismlb.semantics import ENGINE_LATENCY_KEY, Slice
from prismlb.wire import NodeVector, TableNode

from ._eval import PRISM
from ._prism import PrismPolicy
from ._report import MISSING, _md_table, format_pct, geometric_mean
from ._slo import SEARCH_LOW, Goodput
from ._types import Policy


class EwmaPredictor:
    """An exponentially weighted moving average of each series' observed P99 (`_features.series_p99_ms`: each
    slice's latency entry and the engine's), with the `Predictor`'s `observe`/`predict`/`forget` (all the brain's
    loop calls) and its EWMA factor.

    Like `Predictor` for a series shorter than its models' input, it predicts from a series' first observed P99 on;
    unlike it, it never switches to a model or to the last value, and it has nothing to train."""

    def __init__(self, alpha: float = PredictorConfig().ewma_alpha) -> None:
        self.alpha = alpha
        self._ewma_ms: dict[str, dict[str, float]] = {}

    def observe(self, node_id: str, features_row: Sequence[float], p99_ms: Mapping[str, float | None]) -> None:
        """Fold one window's P99 of each series into its average; a window without requests (None) leaves it."""
        averages = self._ewma_ms.setdefault(node_id, {})
        for key, p99 in p99_ms.items():
            if p99 is not None:
                before = averages.get(key)
                averages[key] = p99 if before is None else self.alpha * p99 + (1.0 - self.alpha) * before

    def predict(self, node_ids: Iterable[str]) -> dict[str, dict[str, float]]:
        """The average per node and series; none for a series without an observed P99."""
        return {node_id: dict(self._ewma_ms.get(node_id, {})) for node_id in node_ids}

    def forget(self, node_id: str) -> None:
        self._ewma_ms.pop(node_id, None)


class EwmaBrain(Brain):
    """The brain with `EwmaPredictor` in place of the LSTM-Attention predictor (and its baselines)."""

    def __init__(self, config: BrainConfig) -> None:
        super().__init__(config)
        # a replay's brain only observes, predicts and forgets (no training thread, checkpoint or metrics scrape)
        self.predictor = EwmaPredictor()  # type: ignore[assignment]


class NoPredictorBrain(Brain):
    """The brain without predictions: `compute_weights` falls back to each node's observed TTFT P99."""

    def predict(self) -> None:
        self.predictions = {}


class NodeMaxPredictionBrain(Brain):
    """The brain predicting one latency per node, the largest P99 over its slices' and engine's latency entries,
    for every slice: each slice weighed against its τ0 by the node's slowest, as before per-slice prediction.

    Through the brain's `_series` seam: one series, keyed as the engine's, whose forecast
    (`_features.slice_predictions`) serves every slice."""

    def _series(self, vector: NodeVector) -> dict[str, float | None]:
        values = [p99 for p99 in super()._series(vector).values() if p99 is not None]
        return {ENGINE_LATENCY_KEY: max(values, default=None)}


def _every_entry(tables: Mapping[Slice, list[TableNode]], **changes: object) -> dict[Slice, list[TableNode]]:
    """The brain's entries with `changes` made to every one: how a variant switches off a field it publishes."""
    return {
        slice_: [msgspec.structs.replace(entry, **changes) for entry in entries] for slice_, entries in tables.items()
    }


class FlatWeightsBrain(Brain):
    """The brain publishing weight 1.0 for every table entry (membership, loads and predictions unchanged)."""

    def _weights(self, states: dict[str, NodeState]) -> dict[Slice, list[TableNode]]:
        return _every_entry(super()._weights(states), weight=1.0)


class NoHealthBrain(Brain):
    """The brain weighing every node as perfectly healthy (quality 1.0): weights are s(τ̂) alone with
    `BrainConfig.latency_weights`, else 1.0 (as `FlatWeightsBrain`'s).

    The weights are computed on copies of the states with quality 1.0, so the registry's smoothed quality (which
    the next vector's quality is averaged with) stays the real one; the held weights (hysteresis) go back."""

    def _weights(self, states: dict[str, NodeState]) -> dict[Slice, list[TableNode]]:
        healthy = {node_id: dataclasses.replace(state, quality=1.0) for node_id, state in states.items()}
        try:
            return super()._weights(healthy)
        finally:
            for node_id, copy in healthy.items():
                states[node_id].weights = copy.weights


class NoStallBrain(Brain):
    """The brain publishing no network stall (`TableNode.stall_ms`): routers expect no node's kernel
    retransmits to delay a request (health, weights and everything else unchanged)."""

    def _weights(self, states: dict[str, NodeState]) -> dict[Slice, list[TableNode]]:
        return _every_entry(super()._weights(states), stall_ms=None)


class NoAdmitWaitBrain(Brain):
    """The brain publishing no wait for KV-cache room (`TableNode.admit_ms`): routers expect a node's queue to move
    at its prefill speed however full its cache (health, weights and everything else unchanged)."""

    def _weights(self, states: dict[str, NodeState]) -> dict[Slice, list[TableNode]]:
        return _every_entry(super()._weights(states), admit_ms=None)


class ClassRateBrain(Brain):
    """The brain publishing, as every node's prefill speed, the median measured speed of its GPU class (the `gpu`
    label): what a router knows from the fleet's inventory, without each node's own measure
    (`NodeMetrics.prefill_tokens_per_s`), which is how a node running slower than its class (throttled, shared
    with work no router placed) shows in its expected time to first token.

    The weights are computed on copies of the states whose measured speed (`NodeState.measured_rate`, all that the
    published speed is read from) is their class's median; the held weights and speeds (hysteresis) go back to the
    real states."""

    def _group(self, vector: NodeVector) -> str:
        """The nodes whose measured speeds are pooled into one published speed: a GPU class (`gpu_label`)."""
        return gpu_label(vector)

    def _weights(self, states: dict[str, NodeState]) -> dict[Slice, list[TableNode]]:
        typical = median_speeds(states.values(), self._group)
        copies = {}
        for node_id, state in states.items():
            copies[node_id] = dataclasses.replace(state, measured_rate=typical.get(self._group(state.vector)))
        try:
            return super()._weights(copies)
        finally:
            for node_id, copy in copies.items():
                states[node_id].weights = copy.weights
                states[node_id].prefill_rate = copy.prefill_rate


class FleetRateBrain(ClassRateBrain):
    """`ClassRateBrain` with one group, the whole fleet: every node published at the median measured speed of all
    of them, so a router weighs queued tokens alike on every GPU class (as the baselines' queue counts do), in
    seconds still (the network stall stays comparable)."""

    def _group(self, vector: NodeVector) -> str:
        return ""


def latency_weighted(brain: Callable[[BrainConfig], Brain]) -> Callable[[BrainConfig], Brain]:
    """`brain` with `BrainConfig.latency_weights` on: the design's weights, through which alone the predictions
    reach placement."""
    return lambda config: brain(dataclasses.replace(config, latency_weights=True))


def flat_weights(block_tokens: int) -> Policy:
    """Every published weight 1.0: health and alarms no longer shape the ring or stretch expected times."""
    return PrismPolicy(block_tokens=block_tokens, brain=FlatWeightsBrain)


def latency_weights(block_tokens: int) -> Policy:
    """The design's weights (`BrainConfig.latency_weights`): health times each node's latency sensitivity s(τ̂)
    for the slice, from the predictor's forecast. Not a part switched off but the library's former default, and
    the base the predictor's own ablations (`ewma`, `no-predictor`, `node-max-prediction`) are read against."""
    return PrismPolicy(block_tokens=block_tokens, brain=latency_weighted(Brain))


def ewma(block_tokens: int) -> Policy:
    """With latency weights, the predictor's choice among its models and baselines replaced by an EWMA of each
    series' observed P99 always (`EwmaPredictor`): against `latency-weights`, what LSTM-Attention (and the last
    value, when it scores better) earn over it."""
    return PrismPolicy(block_tokens=block_tokens, brain=latency_weighted(EwmaBrain), train_steps=0)


def no_predictor(block_tokens: int) -> Policy:
    """With latency weights, no predictions: the weights' τ̂ is each node's observed TTFT P99
    (`NoPredictorBrain`); against `latency-weights`, what the forecast earns."""
    return PrismPolicy(block_tokens=block_tokens, brain=latency_weighted(NoPredictorBrain), train_steps=0)


def no_stall(block_tokens: int) -> Policy:
    """No network stall in the expected time to first token (`NoStallBrain`): a node losing segments is seen
    through its health score alone."""
    return PrismPolicy(block_tokens=block_tokens, brain=NoStallBrain)


def no_client_stall(block_tokens: int) -> Policy:
    """No network stall from the routers' own connections (`Settings(client_stall=False)`): the segments of requests
    lost on the way to a node, which only their callers send again, are not held against it (the node's own
    retransmits still are, through the brain's stall)."""
    return PrismPolicy(block_tokens=block_tokens, settings=Settings(client_stall=False))


def no_admit_wait(block_tokens: int) -> Policy:
    """No wait for KV-cache room in the expected time to first token (`NoAdmitWaitBrain`): a node whose cache is
    full of long replies looks as short as its queued prompt tokens."""
    return PrismPolicy(block_tokens=block_tokens, brain=NoAdmitWaitBrain)


def class_rate(block_tokens: int) -> Policy:
    """Every node's prefill speed its GPU class's median (`ClassRateBrain`): expected times without the node's own
    measured speed."""
    return PrismPolicy(block_tokens=block_tokens, brain=ClassRateBrain)


def fleet_rate(block_tokens: int) -> Policy:
    """Every node's prefill speed the fleet's median (`FleetRateBrain`): expected times blind to GPU classes."""
    return PrismPolicy(block_tokens=block_tokens, brain=FleetRateBrain)


def node_max_prediction(block_tokens: int) -> Policy:
    """With latency weights, one prediction per node, its slowest slice's P99, for every slice
    (`NodeMaxPredictionBrain`); against `latency-weights`, what per-slice prediction earns."""
    return PrismPolicy(block_tokens=block_tokens, brain=latency_weighted(NodeMaxPredictionBrain))


def routers_4(block_tokens: int) -> Policy:
    """Four routers (requests dealt among them in turn) sharing their queued prefill and placements through the
    brain, as routers embedded in several callers do: not a part switched off, but what distributing the router
    costs against the replay's one."""
    return PrismPolicy(block_tokens=block_tokens, gateways=4)


def routers_4_own_turns(block_tokens: int) -> Policy:
    """Four sharing routers that do not share their waiting rooms' heads (`Settings(share_turns=False)`): each lets
    its own requests go in its own order whenever it sees room, whatever its peers hold."""
    return PrismPolicy(block_tokens=block_tokens, gateways=4, settings=Settings(share_turns=False))


def routers_4_no_share(block_tokens: int) -> Policy:
    """Four routers that do not share their queued prefill and placements (`Settings(share_load=False)`): each
    sees only its own share of every node's queue, and its own placements until the engines' KV events come."""
    return PrismPolicy(block_tokens=block_tokens, gateways=4, settings=Settings(share_load=False))


def no_sessions(block_tokens: int) -> Policy:
    """Requests carry no session: a conversation is kept together by its prefix key and prefix memory only."""
    return PrismPolicy(block_tokens=block_tokens, sessions=False)


def text_callers(block_tokens: int) -> Policy:
    """Callers without token ids (a transport with `tokenize=None`, `prism gateway --tokenize text`, a failed
    `/tokenize`): every prompt's blocks as text blocks (`Request.engine_blocks` False), which the engines' KV events
    never name, so the prefix index knows them only from placements."""
    return PrismPolicy(block_tokens=block_tokens, text_blocks=True)


def no_kv_index(block_tokens: int) -> Policy:
    """No prefix index (`Settings(prefix_index=False)`): requests go by their prefix key on the ring and the
    prefix memory, as before the engines' KV events reached the routers."""
    return PrismPolicy(block_tokens=block_tokens, settings=Settings(prefix_index=False))


def no_kv_index_flat(block_tokens: int) -> Policy:
    """No prefix index and every weight 1.0: against `no-kv-index`, what the weights do where requests go by their
    ring (keyed requests without block hashes, bare keys, nginx's rendered upstreams), as nothing there has an
    expected time to first token to see a slow node by."""
    return PrismPolicy(block_tokens=block_tokens, settings=Settings(prefix_index=False), brain=FlatWeightsBrain)


def no_cache_affinity(block_tokens: int) -> Policy:
    """The least expected time to first token always (`Settings(cache_affinity=1.0)`): a node holding the prefix,
    a session's node included, gets no preference beyond the tokens it saves."""
    return PrismPolicy(block_tokens=block_tokens, settings=Settings(cache_affinity=1.0))


def no_overflow(block_tokens: int) -> Policy:
    """Every slice on its own pool (`Settings(overflow=0)`): capable nodes another slice prefers are never taken,
    however long the pool's queue."""
    return PrismPolicy(block_tokens=block_tokens, settings=Settings(overflow=0.0))


def no_overflow_yield(block_tokens: int) -> Policy:
    """Overflow by its price alone (`Settings(overflow_yields=False)`): a detour is taken even while the slice whose
    pool holds the entry has requests waiting in the room."""
    return PrismPolicy(block_tokens=block_tokens, settings=Settings(overflow_yields=False))


def no_hold(block_tokens: int) -> Policy:
    """No waiting room (`Settings(hold_tokens=0)`): every request goes to its engine's queue as it arrives, and is
    served there in arrival order."""
    return PrismPolicy(block_tokens=block_tokens, settings=Settings(hold_tokens=0))


VARIANTS: dict[str, Callable[[int], Policy]] = {
    "no-hold": no_hold,
    "no-kv-index": no_kv_index,
    "no-kv-index-flat": no_kv_index_flat,
    "no-cache-affinity": no_cache_affinity,
    "no-overflow": no_overflow,
    "no-overflow-yield": no_overflow_yield,
    "flat-weights": flat_weights,
    "latency-weights": latency_weights,
    "ewma": ewma,
    "node-max-prediction": node_max_prediction,
    "no-predictor": no_predictor,
    "no-stall": no_stall,
    "no-client-stall": no_client_stall,
    "no-admit-wait": no_admit_wait,
    "class-rate": class_rate,
    "fleet-rate": fleet_rate,
    "no-sessions": no_sessions,
    "text-callers": text_callers,
    "4-routers": routers_4,
    "4-routers-own-turns": routers_4_own_turns,
    "4-routers-no-share": routers_4_no_share,
}
"""Every ablation by name; each builds its policy from the workload's KV block size."""
GRAY_VARIANTS = (
    "flat-weights",
    "latency-weights",
    "no-stall",
    "no-client-stall",
    "class-rate",
    "no-predictor",
    "ewma",
    "no-kv-index",
    "no-kv-index-flat",
)
"""The ablations of the signals that exist for nodes going bad, searched again under a gray failure
(`_eval.gray_failure`): on a sound cluster they have little to find. The last two compare the weights on the
ring path, where no expected time to first token stands in for them."""


def format_ablations(rows: Sequence[Goodput]) -> str:
    """One Markdown table, a row per workload: the full Prism's goodput (utilisation at the SLO, `_slo.search`)
    and each variant's goodput over it (below 1: the part switched off was earning its keep); a last row with
    each variant's geometric mean over the workloads.

    A variant that missed the SLO even at the search's lowest load has a goodput below `SEARCH_LOW`: its ratio
    is shown as that bound ("< 0.12"), and a geometric mean taken over such bounds is itself a bound ("≤"). Where
    the full Prism missed it (its goodput "< 10.0"), there is nothing to set the variants over."""
    variants = [v for v in VARIANTS if any(r.policy == v for r in rows)]
    found = {(r.trace, r.policy): r for r in rows}
    out: list[list[str]] = []
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    bounded: set[str] = set()
    for trace in dict.fromkeys(r.trace for r in rows):
        full = found.get((trace, PRISM))
        reference = 0.0 if full is None else full.utilisation
        cells = []
        for variant in variants:
            run = found.get((trace, variant))
            if run is None or reference <= 0:
                cells.append(MISSING)
                continue
            below = run.utilisation <= 0
            ratio = (SEARCH_LOW if below else run.utilisation) / reference
            ratios[variant].append(ratio)
            if below:
                bounded.add(variant)
            cells.append(f"< {ratio:.2f}" if below else f"{ratio:.2f}")
        prism = MISSING if full is None else format_pct(reference) if reference > 0 else f"< {format_pct(SEARCH_LOW)}"
        out.append([trace, prism, *cells])
    means = []
    for variant in variants:
        mean = geometric_mean(ratios[variant])
        means.append(MISSING if mean is None else f"≤ {mean:.2f}" if variant in bounded else f"{mean:.2f}")
    out.append(["geometric mean", "", *means])
    header = ["workload", "Prism goodput %", *(f"{v} / Prism" for v in variants)]
    return _md_table(header, out, text_columns=(0,))
