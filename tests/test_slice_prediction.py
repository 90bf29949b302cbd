"""Per-slice prediction: one series per (node, slice), each slice weighed by its own forecast against its own τ0."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from prismlb.brain import Brain, BrainConfig
from prismlb.brain._features import NODE_FEATURES, slice_predictions
from prismlb.brain._predictor import Predictor, PredictorConfig
from prismlb.semantics import ENGINE_LATENCY_KEY, Slice
from prismlb.sim._ablations import NodeMaxPredictionBrain
from prismlb.wire import ModalityLatency, NodeMetrics, NodeVector, RoutingTable

from ._helpers_vectors import node_vector

SMALL = PredictorConfig(steps=4, history=12, holdout=4, min_evaluation_samples=4, batch_size=16)
PERIOD_S = 5.0
WINDOWS = 20  # past the predictor's 16-window input sequence
# GPUs every node shares: NVLink and HBM3 make vlm's preferred pool, AV1 (L40S) and CUDA Graphs av's
LABELS = {"gpu": "l40s", "nvlink": "yes", "hbm3": "yes", "cuda_graphs": "yes"}


def _vector(node_id: str, seq: int, latency: dict[str, float]) -> NodeVector:
    return node_vector(
        node_id,
        seq,
        period_s=PERIOD_S,
        zone="z1",
        labels=LABELS,
        metrics=NodeMetrics(requests_running=4, requests_waiting=1),
        latency={key: ModalityLatency(requests=20, ttft_p99_ms=ms) for key, ms in latency.items()},
    )


# `mixed` serves images at 2 s and audio at 100 ms (its engine-wide P99 is the images'); `calm-*` serve audio alone
CLUSTER = {
    "mixed": {"vlm": 2000.0, "av": 100.0, ENGINE_LATENCY_KEY: 1900.0},
    "calm-1": {"av": 100.0, ENGINE_LATENCY_KEY: 100.0},
    "calm-2": {"av": 100.0, ENGINE_LATENCY_KEY: 100.0},
}


def _run(brain: Brain) -> RoutingTable:
    """WINDOWS control periods of the cluster, then one prediction and one table."""
    now = 0.0
    for seq in range(1, WINDOWS + 1):
        now = seq * PERIOD_S
        brain.ingest([_vector(node_id, seq, latency) for node_id, latency in CLUSTER.items()], now)
        brain.observe_window()
    brain.predict()
    table = brain.cycle(now)
    assert table is not None
    return table


def _weight(table: RoutingTable, slice_: Slice, node_id: str) -> float:
    entries = next(s for s in table.slices if s.name == slice_.value).nodes
    return max(entry.weight for entry in entries if entry.node_id == node_id)


def _brain(kind: type[Brain] = Brain) -> Brain:
    return kind(BrainConfig(admin_port=0, train_budget_s=0.0, latency_weights=True), CollectorRegistry())


def test_each_slice_is_predicted_and_weighed_from_its_own_latency() -> None:
    brain = _brain()
    table = _run(brain)
    mixed = brain.predictions["mixed"]
    assert mixed[Slice.VLM] == pytest.approx(2000.0) and mixed[Slice.AV] == pytest.approx(100.0)
    assert mixed[Slice.LLM] == mixed[Slice.RAG] == pytest.approx(1900.0)  # no series of their own: the engine's
    assert brain.predictions["calm-1"][Slice.AV] == pytest.approx(100.0)
    # s(100 ms against av's τ0 of 250 ms) = 0.86 for all three: images at 2 s do not drag mixed's audio down
    assert _weight(table, Slice.AV, "mixed") == _weight(table, Slice.AV, "calm-1") == 0.85
    assert _weight(table, Slice.VLM, "mixed") < _weight(table, Slice.VLM, "calm-1")


def test_the_series_seam_restores_the_node_maximum() -> None:
    """The same cluster through a brain whose one series is the node's worst entry: its image latency is copied
    to every slice and mixed's audio weight drops to the floor, what per-slice prediction prevents."""
    brain = _brain(NodeMaxPredictionBrain)
    table = _run(brain)
    assert brain.predictions["mixed"] == pytest.approx(dict.fromkeys(Slice, 2000.0))
    assert _weight(table, Slice.AV, "mixed") == 0.05 < _weight(table, Slice.AV, "calm-1")


def test_slice_predictions_take_the_own_series_else_the_engines() -> None:
    engine = ENGINE_LATENCY_KEY
    both = slice_predictions({"av": 100.0, "vlm": None, engine: 1900.0})
    assert both == {Slice.AV: 100.0, Slice.LLM: 1900.0, Slice.RAG: 1900.0}  # vlm's own series has no forecast yet
    assert slice_predictions({engine: 300.0}) == dict.fromkeys(Slice, 300.0)
    assert slice_predictions({"av": 100.0, engine: None}) == {Slice.AV: 100.0}
    assert slice_predictions({}) == {}


def test_series_share_the_node_features_one_model_and_one_batch() -> None:
    predictor = Predictor(SMALL)
    for t in range(SMALL.history):
        queue = (math.sin(0.7 * t) + 1.0) / 2.0
        row = (0.5, 0.5, queue, 0.1, 0.2, queue, 0.3)
        predictor.observe("n", row, {"vlm": 2000.0 + 500.0 * queue, "av": 100.0 + 20.0 * queue})
    series = predictor._nodes["n"].series
    vlm, av = (series[key].data[series[key].start : series[key].end] for key in ("vlm", "av"))
    features = len(NODE_FEATURES)
    assert vlm[:, :features].equal(av[:, :features]) and not vlm[:, features].equal(av[:, features])
    assert predictor.predict(["n"], "last_value")["n"] == {
        "vlm": pytest.approx(2000.0 + 500.0 * (math.sin(0.7 * 11) + 1.0) / 2.0),
        "av": pytest.approx(100.0 + 20.0 * (math.sin(0.7 * 11) + 1.0) / 2.0),
    }
    batches: list[int] = []
    predictor._serving["lstm_attention"].register_forward_hook(lambda m, args, out: batches.append(args[0].shape[0]))
    assert set(predictor.predict(["n"], "lstm_attention")["n"]) == {"vlm", "av"} and batches == [2]
    per_series = SMALL.holdout  # every held-out window of each series has a target and both baseline forecasts
    assert predictor.evaluate().samples == 2 * per_series
    predictor.train_step(60.0, max_steps=1)
    assert predictor.trained_steps == 1


def test_forget_drops_every_series_of_the_node() -> None:
    predictor = Predictor(SMALL)
    for _ in range(3):
        predictor.observe("a", (0.0,) * len(NODE_FEATURES), {"vlm": 900.0, "av": 90.0, ENGINE_LATENCY_KEY: 800.0})
        predictor.observe("b", (0.0,) * len(NODE_FEATURES), {"av": 50.0})
    assert predictor.history_lengths("a") == {"vlm": 3, "av": 3, ENGINE_LATENCY_KEY: 3}
    predictor.forget("a")
    assert predictor.history_lengths("a") == {} and predictor.predict(["a"]) == {"a": {}}
    assert predictor.history_lengths("b") == {"av": 3}


def test_a_series_without_a_value_for_its_whole_history_is_dropped() -> None:
    predictor = Predictor(SMALL)
    row = (0.0,) * len(NODE_FEATURES)
    predictor.observe("n", row, {"av": 90.0, "vlm": 900.0})
    for _ in range(SMALL.history - 1):  # av no longer served: the window counts for it, without a P99
        predictor.observe("n", row, {"vlm": 900.0})
    assert predictor.history_lengths("n") == {"av": SMALL.history, "vlm": SMALL.history}
    predictor.observe("n", row, {"vlm": 900.0})
    assert predictor.history_lengths("n") == {"vlm": SMALL.history}
    for t in range(10 * SMALL.history):  # a new key every window: never more series than windows kept
        predictor.observe("n", row, {f"key-{t}": 100.0})
    assert len(predictor.history_lengths("n")) == SMALL.history


def test_the_brain_forgets_an_expired_nodes_series() -> None:
    brain = _brain()
    _run(brain)
    assert set(brain.predictor.history_lengths("mixed")) == {"vlm", "av", ENGINE_LATENCY_KEY}
    later = (WINDOWS + 10) * PERIOD_S  # calm-1 reports on; mixed and calm-2 fall silent past 3 periods
    brain.ingest([_vector("calm-1", WINDOWS + 10, CLUSTER["calm-1"])], later)
    brain.cycle(later)
    assert brain.predictor.history_lengths("mixed") == {} and brain.predictor.history_lengths("calm-1")
