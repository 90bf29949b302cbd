"""bench/predictor_routing.py's building blocks: the earlier runs' traces, training on their pooled windows, and the
brain that forecasts with the trained LSTM-Attention whatever `best()` says. The searches themselves are not run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from prismlb.brain import BrainConfig
from prismlb.brain._features import NODE_FEATURES
from prismlb.brain._predictor import Predictor

from .conftest import bench_with_variants


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_with_variants("predictor_routing") as module:
        yield module


def test_earlier_runs_take_other_seeds_of_a_preset_and_the_trace_itself_otherwise(bench: ModuleType) -> None:
    assert [bench.history_trace("tenants:1", run) for run in range(3)] == ["tenants:11", "tenants:12", "tenants:13"]
    assert bench.history_trace("mooncake", 4) == "mooncake"


def test_too_short_a_history_trains_nothing_and_writes_no_checkpoint(bench: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "short.pt"
    assert bench.train("tenants:1", 1, 3, 40, path) is None
    assert not path.exists()


def test_the_trained_brain_forecasts_with_lstm_attention_from_the_checkpoint(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trained.pt"
    line = bench.train("tenants:1", 1, 3, None, path)
    assert line is not None and "lstm_attention" in line and path.exists()
    monkeypatch.setenv(bench.CHECKPOINT_VARIABLE, str(path))
    brain = bench._TrainedLstmAttentionBrain(BrainConfig(admin_port=0))
    predictor = brain.predictor
    assert predictor.trained_steps == 3
    for window in range(predictor.config.steps):
        predictor.observe("node-0", [0.5] * len(NODE_FEATURES), {"engine": 200.0 + 50 * (window % 3)})
    forced = predictor.predict(["node-0"])["node-0"]["engine"]
    model = Predictor.predict(predictor, ["node-0"], "lstm_attention")["node-0"]["engine"]
    assert forced == model != Predictor.predict(predictor, ["node-0"], "ewma")["node-0"]["engine"]
