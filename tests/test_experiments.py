"""A/B gray releases: clamping, normalisation, stable assignment, revisions, persistence, the wire."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from prismlb.brain._experiments import EXPERIMENTS_FILE, Experiments, clamp_fraction, normalise
from prismlb.semantics import assign_arm
from prismlb.wire import MAX_TABLE_BYTES, ConfigError, Experiment, ExperimentArm, RoutingTable, decode, encode


def fractions(arms: list[ExperimentArm]) -> dict[str, float]:
    return {arm.model_version: arm.fraction for arm in arms}


def test_fractions_clamp_to_the_designs_bounds() -> None:
    assert clamp_fraction(0.0) == 0.001
    assert clamp_fraction(-3.0) == 0.001
    assert clamp_fraction(2.0) == 1.0
    assert clamp_fraction(0.25) == 0.25
    with pytest.raises(ValueError):
        clamp_fraction(float("nan"))
    # 0 is raised to the floor and 2 capped at 1; after the division the small arm is held at the floor
    assert fractions(normalise({"v1": 2.0, "v2": 0.0})) == pytest.approx({"v1": 1.0 / 1.001, "v2": 0.001})


def test_fractions_are_normalised_to_shares_of_the_slice() -> None:
    assert fractions(normalise({"v1": 0.9, "v2": 0.1})) == pytest.approx({"v1": 0.9, "v2": 0.1})
    assert fractions(normalise({"v1": 0.9, "v2": 0.2})) == pytest.approx({"v1": 0.9 / 1.1, "v2": 0.2 / 1.1})
    assert fractions(normalise({"v1": 0.2, "v2": 0.2})) == pytest.approx({"v1": 0.5, "v2": 0.5})
    assert fractions(normalise({"v2": 0.05})) == {"v2": 1.0}
    # an arm pushed under the floor by the division is raised back to it
    many = fractions(normalise({f"v{i}": (1.0 if i == 0 else 0.001) for i in range(16)}))
    assert min(many.values()) == 0.001
    with pytest.raises(ValueError):
        normalise({})
    with pytest.raises(ValueError):
        normalise({f"v{i}": 0.1 for i in range(17)})


def test_assignment_is_stable_per_session_and_follows_fractions() -> None:
    experiment = Experiment(name="canary", slice="llm", arms=normalise({"v1": 0.8, "v2": 0.15, "v3": 0.05}))
    sessions = [f"session-{i}" for i in range(40_000)]
    first = [assign_arm(experiment, s) for s in sessions]
    assert first == [assign_arm(experiment, s) for s in sessions]
    assert assign_arm(experiment, "session-7") == assign_arm(experiment, b"session-7")
    counts = Counter(first)
    for arm in experiment.arms:
        assert counts[arm.model_version] / len(sessions) == pytest.approx(arm.fraction, abs=0.01)


def test_raising_a_canary_only_moves_sessions_onto_it() -> None:
    small = Experiment(name="c", slice="vlm", arms=normalise({"v1": 0.95, "v2": 0.05}))
    large = Experiment(name="c", slice="vlm", arms=normalise({"v1": 0.8, "v2": 0.2}))
    for i in range(5_000):
        if assign_arm(small, f"s{i}") == "v2":
            assert assign_arm(large, f"s{i}") == "v2"


def test_experiments_assign_independently() -> None:
    a = Experiment(name="a", slice="llm", arms=normalise({"x": 0.5, "y": 0.5}))
    b = Experiment(name="b", slice="llm", arms=normalise({"x": 0.5, "y": 0.5}))
    same = sum(assign_arm(a, f"s{i}") == assign_arm(b, f"s{i}") for i in range(10_000))
    assert 0.45 < same / 10_000 < 0.55


def test_revision_increments_on_every_change_only() -> None:
    experiments = Experiments()
    assert experiments.revision == 0 and experiments.snapshot() == []
    experiments.set("canary", "llm", {"v1": 0.9, "v2": 0.1})
    assert experiments.revision == 1
    experiments.set("canary", "llm", {"v1": 0.9, "v2": 0.1})
    assert experiments.revision == 1  # nothing changed
    experiments.set("canary", "llm", {"v1": 0.8, "v2": 0.2})
    experiments.set("vision", "vlm", {"a": 1.0})
    assert experiments.revision == 3
    assert [e.name for e in experiments.snapshot()] == ["canary", "vision"]
    assert experiments.remove("canary") is True
    assert experiments.remove("canary") is False
    assert experiments.revision == 4
    assert [e.name for e in experiments.snapshot()] == ["vision"]


def test_invalid_experiments_are_refused_and_change_nothing() -> None:
    experiments = Experiments()
    experiments.set("canary", "llm", {"v1": 0.9, "v2": 0.1})
    for name, slice_name, arms in [
        ("other", "llm", {"v3": 1.0}),  # one experiment per slice
        ("bad name!", "vlm", {"v1": 1.0}),
        ("ok", "", {"v1": 1.0}),
        ("ok", "vlm", {}),
        ("ok", "vlm", {"": 1.0}),
        ("ok", "vlm", {"v1": float("inf")}),
    ]:
        with pytest.raises(ValueError):
            experiments.set(name, slice_name, arms)
    assert experiments.revision == 1 and [e.name for e in experiments.snapshot()] == ["canary"]


def test_experiments_persist_across_restarts(tmp_path: Path) -> None:
    first = Experiments(tmp_path)
    first.set("canary", "llm", {"v1": 0.9, "v2": 0.1})
    first.set("vision", "vlm", {"a": 0.5, "b": 0.0})
    first.set("gone", "av", {"x": 1.0})
    first.remove("gone")
    assert not list(tmp_path.glob("*.tmp"))
    again = Experiments(tmp_path)
    assert again.snapshot() == first.snapshot()
    assert again.revision == first.revision == 4
    again.set("canary", "llm", {"v2": 1.0})
    assert again.revision == 5
    assert json.loads((tmp_path / EXPERIMENTS_FILE).read_text())["revision"] == 5


def test_a_corrupt_experiments_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / EXPERIMENTS_FILE
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid experiments file"):
        Experiments(tmp_path)
    bad_fraction = {
        "revision": 1,
        "experiments": [{"name": "c", "slice": "llm", "arms": [{"model_version": "v1", "fraction": 0.0}]}],
    }
    path.write_text(json.dumps(bad_fraction))
    with pytest.raises(ConfigError, match="fraction"):
        Experiments(tmp_path)
    arm = [{"model_version": "v1", "fraction": 1.0}]
    twice = {"experiments": [{"name": "a", "slice": "llm", "arms": arm}, {"name": "b", "slice": "llm", "arms": arm}]}
    path.write_text(json.dumps(twice))
    with pytest.raises(ConfigError, match="unique"):
        Experiments(tmp_path)


def test_experiments_travel_whole_in_one_table_message() -> None:
    experiments = Experiments()
    experiments.set("canary", "llm", {"v1": 2.0, "v2": 0.0})
    table = RoutingTable(epoch=1, version=7, issued_unix_s=1.0, slices=[], experiments=experiments.snapshot())
    decoded = decode(encode(table), (RoutingTable,), MAX_TABLE_BYTES)
    assert decoded.experiments == experiments.snapshot()
    assert decoded.experiments[0].arms[1].fraction >= 0.001
