"""Weights per (node, slice): latency sensitivity, alarms, floor, hysteresis, per-GPU entries, table threshold."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prismlb.brain import (
    LATENCY_WEIGHTS,
    NodeState,
    Predictions,
    Registry,
    TableBuilder,
    compute_weights,
    numa_factor,
    sensitivity,
)
from prismlb.brain._registry import ALARM_DERATE
from prismlb.brain._topology import BASE_VIRTUAL_NODES, PCIE_DERATE, virtual_nodes
from prismlb.brain._weights import TAU0_MS, WEIGHT_FLOOR, quantise
from prismlb.semantics import Slice, callers_speeds
from prismlb.wire import (
    Experiment,
    ExperimentArm,
    GpuState,
    ModalityLatency,
    NodeMetrics,
    RoutingTable,
    TableNode,
    decode,
    encode,
)

from ._helpers_vectors import node_vector


class Cluster:
    """A registry fed one vector per node per step, as the brain's loop does."""

    def __init__(self) -> None:
        self.registry = Registry()
        self.seq = 0

    def report(
        self,
        node_id: str,
        labels: dict[str, str] | None = None,
        latency: dict[str, float] | None = None,
        gpus: Sequence[GpuState] = (),
        period_s: float = 1.0,
        **metrics: float,
    ) -> None:
        self.seq += 1
        vector = node_vector(
            node_id,
            self.seq,
            period_s=period_s,
            zone="z1",
            labels=labels,
            metrics=NodeMetrics(**metrics),  # type: ignore[arg-type]
            latency={k: ModalityLatency(requests=10, ttft_p99_ms=v) for k, v in (latency or {}).items()},
            gpus=gpus,
        )
        self.registry.update(vector, now=float(self.seq))

    @property
    def nodes(self) -> dict[str, NodeState]:
        return self.registry.nodes

    def weights(self, predictions: Predictions | None = None, latency: bool = True) -> dict[Slice, list[TableNode]]:
        """The design's weights (`latency`, what most tests here check), else the library's default: health alone."""
        return compute_weights(self.nodes, predictions or {}, latency=latency)


def weight_of(entries: dict[Slice, list[TableNode]], slice_: Slice, node_id: str) -> float:
    (entry,) = [e for e in entries[slice_] if e.node_id == node_id]
    return entry.weight


# s(τ)


def test_sensitivity_at_tau0_and_extremes() -> None:
    assert sensitivity(800.0, 800.0) == 0.5
    assert sensitivity(0.0, 800.0) == 1.0
    assert sensitivity(3 * 250.0, 250.0) == pytest.approx(0.1)
    assert sensitivity(1e7, 250.0) < 1e-9
    assert sensitivity(1e200, 250.0) == sensitivity(1e7, 250.0)  # saturates: no overflow
    assert sensitivity(math.nan, 250.0) == sensitivity(1e7, 250.0)


@given(st.floats(0.0, 1e6), st.floats(0.0, 1e6), st.sampled_from(sorted(TAU0_MS.values())))
def test_sensitivity_is_in_unit_interval_and_decreasing(a: float, b: float, tau0: float) -> None:
    low, high = sorted((a, b))
    assert 0.0 < sensitivity(high, tau0) <= sensitivity(low, tau0) <= 1.0


def test_tau0_maps_the_designs_three_classes_onto_four_slices() -> None:
    assert TAU0_MS == {Slice.LLM: 800.0, Slice.VLM: 1200.0, Slice.AV: 250.0, Slice.RAG: 800.0}


# weight = health × alarms × s(τ̂)


def test_weight_is_health_times_sensitivity_per_slice() -> None:
    c = Cluster()
    c.report("a", {"gpu": "l40s", "nvlink": "yes"}, latency={"engine": 250.0}, cpu_util_ratio=0.45)  # health 0.75
    c.report("ref", {"gpu": "l40s", "nvlink": "yes"}, latency={"engine": 250.0})  # the pool's healthiest: 1.0
    w = c.weights()
    assert weight_of(w, Slice.LLM, "a") == quantise(0.75 * sensitivity(250.0, 800.0)) == 0.7
    assert weight_of(w, Slice.VLM, "a") == quantise(0.75 * sensitivity(250.0, 1200.0)) == 0.7
    assert weight_of(w, Slice.AV, "a") == quantise(0.75 * 0.5) == 0.4


def test_default_weights_are_health_alone_whatever_the_latency() -> None:
    """Without `latency` (the library's default, `LATENCY_WEIGHTS`) a node's latency and forecast leave its weight:
    routers weigh the queue that makes most of a tail themselves; health still does."""
    c = Cluster()
    c.report("a", {"gpu": "l40s", "nvlink": "yes"}, latency={"engine": 250.0}, cpu_util_ratio=0.45)  # health 0.75
    c.report("ref", {"gpu": "l40s", "nvlink": "yes"}, latency={"engine": 250.0})
    c.report("slow", {"gpu": "l40s", "nvlink": "yes"}, latency={"engine": 4000.0})
    w = c.weights({"ref": {Slice.LLM: 5000.0}}, latency=False)
    assert not LATENCY_WEIGHTS
    assert weight_of(w, Slice.LLM, "a") == weight_of(w, Slice.AV, "a") == 0.75
    assert weight_of(w, Slice.LLM, "ref") == weight_of(w, Slice.LLM, "slow") == weight_of(w, Slice.AV, "slow") == 1.0
    assert weight_of(c.weights(), Slice.LLM, "slow") < weight_of(c.weights(), Slice.LLM, "a")  # the design's rule


def test_latency_source_prediction_then_slice_then_engine() -> None:
    c = Cluster()
    c.report("a", latency={"llm": 800.0, "engine": 0.0})
    c.report("b", latency={"engine": 800.0})
    assert weight_of(c.weights(), Slice.LLM, "a") == 0.5
    assert weight_of(c.weights(), Slice.LLM, "b") == 0.5
    c2 = Cluster()
    c2.report("a", latency={"llm": 800.0})
    w = c2.weights({"a": {Slice.LLM: 0.0}})
    assert weight_of(w, Slice.LLM, "a") == 1.0
    (entry,) = w[Slice.LLM]
    assert entry.predicted_p99_ms == 0.0


def test_unusable_predictions_are_ignored() -> None:
    for bad in (math.nan, math.inf, -1.0):
        c = Cluster()
        c.report("a", latency={"llm": 800.0})
        w = c.weights({"a": {Slice.LLM: bad}})
        assert weight_of(w, Slice.LLM, "a") == 0.5 and w[Slice.LLM][0].predicted_p99_ms is None


def test_unmeasured_node_takes_the_pools_median_sensitivity() -> None:
    c = Cluster()
    for node_id, tau in (("a", 0.0), ("b", 800.0), ("c", 2400.0)):
        c.report(node_id, latency={"llm": tau})
    c.report("new")
    assert weight_of(c.weights(), Slice.LLM, "new") == 0.5
    lone = Cluster()
    lone.report("new")
    assert weight_of(lone.weights(), Slice.LLM, "new") == 1.0


def test_alarms_derate_the_weight() -> None:
    c = Cluster()
    c.report("calm", kv_cache_miss_ratio=0.18)  # at the threshold: score 0.5, no alarm
    c.report("alarmed", kv_cache_miss_ratio=0.185)  # just over: score ≈ 0.49, alarm
    c.report("healthy")  # the pool's healthiest: quality 1.0
    assert c.nodes["alarmed"].health.alarms == ("kv_cache_miss_ratio",)
    w = c.weights()
    assert weight_of(w, Slice.LLM, "calm") == 0.5
    score = c.nodes["alarmed"].health.score
    assert weight_of(w, Slice.LLM, "alarmed") == quantise(score * ALARM_DERATE) == 0.25


def test_floor_keeps_a_live_eligible_node_in_its_pool() -> None:
    c = Cluster()
    c.report(
        "sick",
        latency={"engine": 60_000.0},
        gpu_mem_frag_ratio=1.0,
        kv_cache_miss_ratio=1.0,
        cpu_preproc_p95_ms=10_000.0,
        nvlink_util_ratio=1.0,
    )
    c.report("well", latency={"engine": 100.0})
    w = c.weights()
    assert weight_of(w, Slice.LLM, "sick") == WEIGHT_FLOOR > 0.0


def test_table_fields_model_version_load_and_zone() -> None:
    c = Cluster()
    c.report("a", {"model_version": "qwen2-vl-7b@3"}, requests_running=3, requests_waiting=2)
    c.report("b", requests_running=4)
    c.report("c")
    by_id = {e.node_id: e for e in c.weights()[Slice.LLM]}
    assert by_id["a"].model_version == "qwen2-vl-7b@3" and by_id["a"].load == 5.0 and by_id["a"].zone == "z1"
    assert by_id["b"].model_version == "" and by_id["b"].load == 4.0
    assert by_id["c"].load is None and by_id["c"].gpu is None


def rate_of(entries: dict[Slice, list[TableNode]], node_id: str) -> float | None:
    (entry,) = [e for e in entries[Slice.LLM] if e.node_id == node_id]
    return entry.prefill_tokens_per_s


def test_prefill_speed_is_the_nodes_own_else_its_gpu_classs_median_else_none() -> None:
    c = Cluster()
    c.report("h1", {"gpu": "h100"}, prefill_tokens_per_s=20_000.0)
    c.report("h2", {"gpu": "h100"}, prefill_tokens_per_s=18_000.0)
    c.report("h3", {"gpu": "h100"}, prefill_tokens_per_s=22_000.0)
    c.report("h-new", {"gpu": "h100"})
    c.report("l-new", {"gpu": "l40s"})
    c.report("unlabelled")
    entries = c.weights()
    own = rate_of(entries, "h2")
    assert own is not None and abs(own - 18_000.0) / 18_000.0 < 0.05  # within half a 2^(1/8) step
    newcomer = rate_of(entries, "h-new")
    assert newcomer is not None and abs(newcomer - 20_000.0) / 20_000.0 < 0.05
    # no peer of its class measured, or no class: not the H100s' median, which an L40S runs at a third of; each
    # router stands in for it with its own callers' first tokens there
    assert rate_of(entries, "l-new") is None and rate_of(entries, "unlabelled") is None
    cold = Cluster()
    cold.report("n1", {"gpu": "h100"})
    assert rate_of(cold.weights(), "n1") is None  # no node has measured: routers compare queued tokens alone
    # each entry names its node's class, over which routers pool their own measures while it has no speed
    classes = {e.node_id: e.gpu_class for e in entries[Slice.LLM]}
    assert classes == {"h1": "h100", "h2": "h100", "h3": "h100", "h-new": "h100", "l-new": "l40s", "unlabelled": ""}


def test_a_node_keeps_its_measured_speed_through_vectors_that_measure_none() -> None:
    """An agent measures a speed only over enough requests (`MIN_PREFILL_REQUESTS`): a node that prefills little
    (media requests, mostly cached prompts) goes many vectors without one, and is still the speed it measured, not
    its class's median of the moment nor unknown."""
    c = Cluster()
    c.report("l1", {"gpu": "l40s"}, prefill_tokens_per_s=3_000.0)
    c.report("l2", {"gpu": "l40s"}, prefill_tokens_per_s=6_000.0)
    for _ in range(5):
        c.report("l1", {"gpu": "l40s"})
        c.report("l2", {"gpu": "l40s"}, prefill_tokens_per_s=6_000.0)
    kept = rate_of(c.weights(), "l1")
    assert kept is not None and abs(kept - 3_000.0) / 3_000.0 < 0.05
    assert c.nodes["l1"].measured_rate == 3_000.0
    c.report("l3", {"gpu": "l40s"})  # has measured nothing: its class's median of what its peers measured last
    newcomer = rate_of(c.weights(), "l3")
    assert newcomer is not None and abs(newcomer - 4_500.0) / 4_500.0 < 0.05


def test_prefill_speed_moves_only_past_its_hysteresis() -> None:
    c = Cluster()
    builder = TableBuilder(epoch=1)
    c.report("a", prefill_tokens_per_s=10_000.0)
    assert builder.build(c.weights()) is not None
    first = rate_of(c.weights(), "a")
    for noisy in (10_900.0, 9_200.0, 11_000.0, 9_000.0):  # within 15%
        c.report("a", prefill_tokens_per_s=noisy)
        assert rate_of(c.weights(), "a") == first
        assert builder.build(c.weights()) is None
    c.report("a", prefill_tokens_per_s=5_000.0)
    moved = rate_of(c.weights(), "a")
    assert moved is not None and abs(moved - 5_000.0) / 5_000.0 < 0.05
    assert builder.build(c.weights()) is not None


# hysteresis


def test_small_oscillations_hold_the_weight_and_publish_nothing() -> None:
    c = Cluster()
    builder = TableBuilder(epoch=1)
    c.report("a", latency={"llm": 800.0})
    c.report("b", latency={"llm": 800.0})
    first = builder.build(c.weights())
    assert first is not None
    for tau in (760.0, 840.0, 700.0, 900.0, 800.0, 720.0):  # s between 0.44 and 0.57
        c.report("a", latency={"llm": tau})
        assert weight_of(c.weights(), Slice.LLM, "a") == 0.5
        assert builder.build(c.weights()) is None
    c.report("a", latency={"llm": 200.0})  # s = 0.94: a real change
    second = builder.build(c.weights())
    assert second is not None and second.version == first.version + 1
    assert weight_of({Slice.LLM: second.slices[0].nodes}, Slice.LLM, "a") == 0.95


def test_hold_moves_only_past_the_hysteresis_band() -> None:
    c = Cluster()
    c.report("ref")  # the pool's healthiest: quality 1.0
    c.report("a", cpu_util_ratio=0.45)  # 0.75
    assert weight_of(c.weights(), Slice.LLM, "a") == 0.75
    c.report("a", cpu_util_ratio=0.58, period_s=3600.0)  # 0.678: within 0.075 of 0.75 (an hour replaces the average)
    assert weight_of(c.weights(), Slice.LLM, "a") == 0.75
    c.report("a", cpu_util_ratio=0.60, period_s=3600.0)  # 0.667: out of the band, snaps to its step
    assert weight_of(c.weights(), Slice.LLM, "a") == 0.65


def test_entries_a_node_leaves_are_forgotten() -> None:
    c = Cluster()
    c.report("a", {"gpu": "l40s"})
    c.weights()
    assert (Slice.AV, None) in c.nodes["a"].weights
    c.report("a", {"gpu": "l40s", "av1": "no"})
    c.weights()
    assert set(c.nodes["a"].weights) == {(Slice.LLM, None)}


# topology


def gpu(index: int, numa: int | None, pcie: float | None = None) -> GpuState:
    return GpuState(
        index=index, uuid=f"GPU-{index}", mem_used_bytes=0, mem_total_bytes=1, numa_node=numa, pcie_util_ratio=pcie
    )


def test_topology_aware_slice_has_one_entry_per_gpu() -> None:
    c = Cluster()
    gpus = [gpu(2, 1, 0.2), gpu(0, 0, 0.1), gpu(1, 0, 0.9), gpu(3, 1)]
    c.report("av-1", {"gpu": "l40s", "cuda_graphs": "yes"}, gpus=gpus, requests_running=8)
    w = c.weights()
    entries = w[Slice.AV]
    assert [(e.node_id, e.gpu, e.numa_node) for e in entries] == [
        ("av-1", 0, 0),
        ("av-1", 1, 0),
        ("av-1", 2, 1),
        ("av-1", 3, 1),
    ]
    assert [e.weight for e in entries] == [1.0, PCIE_DERATE, 1.0, 1.0]  # GPU 1's PCIe is over 85%
    assert [e.load for e in entries] == [2.0, 2.0, 2.0, 2.0]
    (whole,) = w[Slice.LLM]  # other slices route to the node as a whole
    assert whole.gpu is None and whole.numa_node is None and whole.load == 8.0


def test_node_without_gpu_data_is_one_entry_in_a_topology_slice() -> None:
    c = Cluster()
    c.report("av-2", {"av1": "yes"})
    (entry,) = c.weights()[Slice.AV]
    assert entry.gpu is None and entry.weight == 1.0


def test_numa_factor_and_virtual_nodes() -> None:
    assert numa_factor(0, 0) == 1.0
    assert numa_factor(0, 1) == 0.4
    assert numa_factor(None, 1) == 1.0 and numa_factor(1, None) == 1.0
    assert BASE_VIRTUAL_NODES == 128
    assert virtual_nodes(1.0, 0, 0) == 128
    assert virtual_nodes(1.0, 0, 1) == 51
    assert virtual_nodes(0.5, 1, 1) == 64
    assert virtual_nodes(WEIGHT_FLOOR, 0, 1) == 3
    assert virtual_nodes(0.001, 0, 1) == 1


# table threshold


def entry(node_id: str, weight: float, **fields: object) -> TableNode:
    return TableNode(node_id=node_id, endpoint=f"http://{node_id}", weight=weight, **fields)  # type: ignore[arg-type]


def test_table_builder_publishes_only_beyond_the_threshold() -> None:
    builder = TableBuilder(epoch=3)
    base = {Slice.LLM: [entry("a", 0.5), entry("b", 1.0)]}
    first = builder.build(base)
    assert first is not None and first.order == (3, 1)
    assert builder.build({Slice.LLM: [entry("a", 0.52), entry("b", 0.97)]}) is None
    assert builder.build({Slice.LLM: [entry("a", 0.54), entry("b", 1.0)]}) is None  # against 0.5, not 0.52
    assert builder.build({Slice.LLM: [entry("a", 0.5, load=40.0, predicted_p99_ms=900.0), entry("b", 1.0)]}) is None
    moved = builder.build({Slice.LLM: [entry("a", 0.45), entry("b", 1.0)]})  # one step down
    assert moved is not None and moved.version == 2
    assert builder.build({Slice.LLM: [entry("a", 0.45)]}) is not None  # b left
    assert builder.build({Slice.LLM: [entry("a", 0.45, model_version="v2")]}) is not None
    assert builder.build({Slice.LLM: [entry("a", 0.45, model_version="v2")], Slice.VLM: []}) is None
    assert builder.build({Slice.LLM: [entry("a", 0.45, model_version="v2")]}, guardian="degraded") is not None
    arm = ExperimentArm(model_version="v3", fraction=0.1)
    experiment = Experiment(name="canary", slice="llm", arms=[arm])
    last = builder.build({Slice.LLM: [entry("a", 0.45, model_version="v2")]}, experiments=[experiment])
    assert last is not None and last.version == 6 and last.experiments == [experiment]
    assert builder.build({Slice.LLM: [entry("a", 0.45, model_version="v2")]}, experiments=[experiment]) is None


def test_built_table_is_valid_on_the_wire() -> None:
    c = Cluster()
    c.report("a", {"gpu": "a100", "model_version": "m1"}, latency={"engine": 300.0}, requests_running=1)
    c.report("av", {"gpu": "l40s"}, gpus=[gpu(0, 0, 0.95), gpu(1, 1)])
    table = TableBuilder(epoch=9).build(c.weights({"a": {Slice.LLM: 123.0}}))
    assert table is not None
    assert decode(encode(table), (RoutingTable,), 1 << 20) == table


def test_quality_is_relative_to_the_pools_healthiest() -> None:
    c = Cluster()
    for node in ("a", "b", "c"):
        c.report(node, kv_cache_miss_ratio=0.3)  # every node past the alarm: none is singled out
    assert {weight_of(c.weights(), Slice.LLM, n) for n in ("a", "b", "c")} == {1.0}
    c.report("a", kv_cache_miss_ratio=0.9, period_s=3600.0)
    assert weight_of(c.weights(), Slice.LLM, "a") == WEIGHT_FLOOR
    for node in ("b", "c"):
        c.report(node, kv_cache_miss_ratio=0.9, period_s=3600.0)  # quality 0 everywhere: all equal again
    assert {weight_of(c.weights(), Slice.LLM, n) for n in ("a", "b", "c")} == {1.0}


def test_pool_past_its_tolerance_is_weighed_against_its_median() -> None:
    c = Cluster()
    for node, p99 in (("a", 4000.0), ("b", 8000.0), ("c", 8000.0), ("d", 16000.0)):
        c.report(node, latency={"engine": p99})
    w = c.weights()
    assert weight_of(w, Slice.LLM, "b") == 0.5  # at the median (8 s, past τ0 = 0.8 s): 0.5, not the floor
    assert weight_of(w, Slice.LLM, "a") == quantise(sensitivity(4000.0, 8000.0)) == 0.8
    assert weight_of(w, Slice.LLM, "d") == quantise(sensitivity(16000.0, 8000.0)) == 0.2


def test_callers_speeds_pool_over_a_class_and_reach_its_members_not_seen_yet() -> None:
    """The callers' measures on the table's scale (the measured H100 sets it: 2x here), then per GPU class: both
    A100s at the median of theirs, and the A100 no caller has seen yet too; a node of no class keeps its own; a
    measured node is not stood in for."""
    measured = {"m": 8_000.0}
    seen = {"m": 4_000.0, "a1": 1_000.0, "a2": 3_000.0, "x": 500.0}
    classes = {"m": "h100", "a1": "a100", "a2": "a100", "a3": "a100", "x": ""}
    assert callers_speeds(measured, seen, classes) == {"a1": 4_000.0, "a2": 4_000.0, "a3": 4_000.0, "x": 1_000.0}
    assert callers_speeds(measured, seen) == {"a1": 2_000.0, "a2": 6_000.0, "x": 1_000.0}  # no classes: each its own
