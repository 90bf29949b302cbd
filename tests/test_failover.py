"""The cross-zone failover scheduler: the rule, the features, the student's file and fallbacks, the zone
simulator's view of an outage, and a tiny training run."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from prismlb.brain._failover import (
    FEATURES,
    HISTORY,
    LEVELS,
    FailoverModelError,
    FailoverScheduler,
    LocalFirst,
    SpreadByCapacity,
    StudentNetwork,
    StudentPolicy,
    ZoneObservation,
    ZoneSplit,
    features,
    save_student,
    split_from_local,
)
from prismlb.sim._failover_train import train_failover
from prismlb.sim._zones import (
    AGENT_PERIOD_S,
    ALIVE_PERIODS,
    STEP_S,
    Outage,
    Scenario,
    ZoneSim,
    evaluation_scenario,
    make_layout,
    mixture_p99,
    run_episode,
)

WIDE = np.stack([np.zeros(FEATURES), np.full(FEATURES, 4.0)])


def zone(
    name: str, nodes: int = 4, alive: int | None = None, weight: float = 1.0, demand: float = 1 / 3
) -> ZoneObservation:
    return ZoneObservation(name, nodes, nodes if alive is None else alive, weight, 90.0, 0.5, demand)


def healthy() -> list[ZoneObservation]:
    return [zone("a"), zone("b"), zone("c")]


def assert_valid(split: ZoneSplit, zones: list[ZoneObservation]) -> None:
    """Every observed zone has a row summing to 1 with only alive zones (when any is alive)."""
    assert set(split) == {z.zone for z in zones}
    alive = {z.zone for z in zones if z.alive > 0}
    for row in split.values():
        assert abs(sum(row.values()) - 1.0) <= 1e-9
        assert all(f > 0 for f in row.values())
        if alive:
            assert set(row) <= alive


def fixed_student(level: int, path: Path, ranges: np.ndarray = WIDE) -> None:
    """A student file whose network always picks LEVELS[level]: zero weights, a head bias on that level."""
    network = StudentNetwork()
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.zero_()
        network.head.bias[level] = 5.0
    save_student(path, network, ranges)


def test_rule_keeps_all_local_when_healthy() -> None:
    split = LocalFirst().split(healthy(), {})
    assert split == {"a": {"a": 1.0}, "b": {"b": 1.0}, "c": {"c": 1.0}}


def test_rule_gives_an_outage_zone_nothing_once_its_nodes_are_not_alive() -> None:
    still_reporting = [zone("a"), zone("b", alive=2), zone("c")]
    assert 0 < LocalFirst().split(still_reporting, {})["b"]["b"] < 1
    zones = [zone("a"), zone("b", alive=0), zone("c")]
    split = LocalFirst().split(zones, {})
    assert_valid(split, zones)
    assert all("b" not in row for row in split.values())
    assert split["b"] == pytest.approx({"a": 0.5, "c": 0.5})


def test_rule_spills_when_local_capacity_is_short() -> None:
    zones = [zone("a", weight=0.5, demand=0.5), zone("b", demand=0.25), zone("c", nodes=8, demand=0.25)]
    split = LocalFirst().split(zones, {})
    assert_valid(split, zones)
    total = 2 + 4 + 8
    assert split["a"]["a"] == pytest.approx(2 / (0.5 * total))
    spare_b, spare_c = 4 - 0.25 * total, 8 - 0.25 * total
    assert split["a"]["c"] / split["a"]["b"] == pytest.approx(spare_c / spare_b)
    assert split["b"] == {"b": 1.0} and split["c"] == {"c": 1.0}


def test_a_caller_zone_without_nodes_is_spread_by_spare_capacity() -> None:
    zones = [zone("a", demand=0.3), zone("b", nodes=8, demand=0.3), zone("edge", nodes=0, demand=0.4)]
    split = LocalFirst().split(zones, {})
    assert_valid(split, zones)
    total = 12
    assert split["edge"]["b"] / split["edge"]["a"] == pytest.approx((8 - 0.3 * total) / (4 - 0.3 * total))


def test_split_from_local_stays_local_when_no_other_zone_can_take_any() -> None:
    zones = [zone("a"), zone("b", alive=0)]
    assert split_from_local("a", 0.25, zones) == {"a": 1.0}
    assert split_from_local("b", 1.0, zones) == {"a": 1.0}


def random_zones(rng: np.random.Generator, count: int) -> list[ZoneObservation]:
    demand = rng.dirichlet(np.ones(count))
    out = []
    for i in range(count):
        nodes = int(rng.integers(0, 7))
        alive = int(rng.integers(0, nodes + 1)) if rng.random() < 0.7 else nodes
        out.append(
            ZoneObservation(
                f"z{i}",
                nodes,
                alive,
                float(rng.uniform(0, 1)) if alive else 0.0,
                float(rng.uniform(0, 900)) if alive else 0.0,
                float(rng.uniform(0, 40)),
                float(demand[i]),
            )
        )
    return out


def test_features_are_finite_and_fixed_length_for_1_to_6_zones() -> None:
    rng = np.random.default_rng(1)
    for count in range(1, 7):
        for _ in range(30):
            zones = random_zones(rng, count)
            for z in zones:
                x = features(z.zone, zones, float(rng.choice(LEVELS)))
                assert x.shape == (FEATURES,)
                assert np.isfinite(x).all() and (x >= 0).all()
    dead = [zone("a", alive=0), zone("b", nodes=0)]
    assert np.isfinite(features("a", dead, 1.0)).all()


def test_every_policy_gives_rows_that_sum_to_one_over_alive_zones(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    path = tmp_path / "student.pt"
    fixed_student(3, path)
    policies = [LocalFirst(), SpreadByCapacity(), StudentPolicy.load(path)]
    for count in range(1, 7):
        for _ in range(25):
            zones = random_zones(rng, count)
            for policy in policies:
                assert_valid(policy.split(zones, {}), zones)
            for level in LEVELS:
                row = split_from_local(zones[0].zone, level, zones)
                assert abs(sum(row.values()) - 1.0) <= 1e-9


def test_the_students_numpy_forward_matches_torch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = tmp_path / "student.pt"
    network = StudentNetwork()
    save_student(path, network, WIDE)
    student = StudentPolicy.load(path)
    x = np.random.default_rng(3).uniform(0, 2, size=(5, HISTORY, FEATURES))
    with torch.no_grad():
        expected = network(torch.from_numpy(x).float()).numpy()
    assert np.abs(student.logits(x) - expected).max() < 1e-5


def test_a_missing_model_runs_the_rule_and_counts_it(tmp_path: Path) -> None:
    scheduler = FailoverScheduler(tmp_path / "absent.pt")
    assert scheduler.split(healthy(), now=0.0) == LocalFirst().split(healthy(), {})
    assert scheduler.source == "rule"
    assert scheduler.counts["fallback_missing"] == 1 and scheduler.counts["rule"] == 1
    assert scheduler.counts["reload_errors"] == 0


def test_a_corrupt_model_runs_the_rule_and_counts_the_error(tmp_path: Path) -> None:
    path = tmp_path / "student.pt"
    path.write_bytes(b"not a torch file")
    with pytest.raises(FailoverModelError):
        StudentPolicy.load(path)
    scheduler = FailoverScheduler(path)
    assert scheduler.counts["reload_errors"] == 1
    scheduler.split(healthy(), now=0.0)
    assert scheduler.source == "rule" and scheduler.counts["fallback_missing"] == 1


def test_a_model_of_another_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "student.pt"
    save_student(path, StudentNetwork(hidden=16), WIDE)
    assert StudentPolicy.load(path).network.lstm.hidden_size == 16
    state = torch.load(path, weights_only=True)
    state["levels"] = [1.0, 0.0]
    torch.save(state, path)
    with pytest.raises(FailoverModelError, match="levels"):
        StudentPolicy.load(path)


@pytest.mark.parametrize(
    "bad",
    [
        ZoneObservation("b", 4, 4, math.nan, 90.0, 0.5, 1 / 3),
        ZoneObservation("b", 4, 4, 1.0, math.inf, 0.5, 1 / 3),
        ZoneObservation("b", 4, 4, 1.0, 90.0, -2.0, 1 / 3),
        ZoneObservation("b", 4, 5, 1.0, 90.0, 0.5, 1 / 3),
    ],
)
def test_invalid_observations_fall_back_to_the_rule_without_raising(tmp_path: Path, bad: ZoneObservation) -> None:
    path = tmp_path / "student.pt"
    fixed_student(LEVELS.index(0.0), path)
    scheduler = FailoverScheduler(path)
    zones = [zone("a"), bad, zone("c")]
    split = scheduler.split(zones, now=0.0)
    assert scheduler.source == "rule" and scheduler.counts["fallback_invalid"] == 1
    assert set(split) == {"a", "b", "c"}
    assert all(abs(sum(row.values()) - 1.0) <= 1e-9 for row in split.values())
    assert split["a"] == {"a": 1.0}
    scheduler.split(healthy(), now=0.2)
    assert scheduler.source == "student" and scheduler.counts["student"] == 1


def test_observations_that_are_not_a_list_give_an_empty_split_and_are_counted() -> None:
    scheduler = FailoverScheduler()
    assert scheduler.split(None, now=0.0) == {}  # type: ignore[arg-type]
    assert scheduler.counts["fallback_invalid"] == 1


def test_features_outside_the_trained_range_fall_back_to_the_rule(tmp_path: Path) -> None:
    path = tmp_path / "student.pt"
    narrow = WIDE.copy()
    narrow[1, 3] = 0.05  # local queue never above 0.4 requests in training
    fixed_student(LEVELS.index(0.0), path, narrow)
    scheduler = FailoverScheduler(path)
    calm = [ZoneObservation(z.zone, 4, 4, 1.0, 90.0, 0.1, 1 / 3) for z in healthy()]
    assert scheduler.split(calm, now=0.0)["a"] != {"a": 1.0}
    assert scheduler.source == "student"
    assert scheduler.split(healthy(), now=0.2) == LocalFirst().split(healthy(), {})
    assert scheduler.source == "rule" and scheduler.counts["fallback_range"] == 1


def test_the_model_is_reloaded_when_it_changes_and_a_bad_one_keeps_the_running_student(tmp_path: Path) -> None:
    path = tmp_path / "student.pt"
    fixed_student(LEVELS.index(1.0), path)
    scheduler = FailoverScheduler(path, reload_s=600.0)
    assert scheduler.split(healthy(), now=1000.0)["a"] == {"a": 1.0}
    fixed_student(LEVELS.index(0.0), path)
    assert scheduler.split(healthy(), now=1599.0)["a"] == {"a": 1.0}
    assert scheduler.counts["reloads"] == 0
    spilled = scheduler.split(healthy(), now=1600.0)
    assert scheduler.counts["reloads"] == 1 and scheduler.source == "student"
    assert "a" not in spilled["a"] and spilled["a"] == pytest.approx({"b": 0.5, "c": 0.5})
    assert not [p for p in tmp_path.iterdir() if p.name != "student.pt"]  # no temporary file left
    path.write_bytes(b"\x80\x02 half a pickle")
    os.utime(path, ns=(1, 1))
    assert scheduler.split(healthy(), now=2200.0) == spilled
    assert scheduler.counts["reload_errors"] == 1 and scheduler.counts["reloads"] == 1
    assert scheduler.source == "student"


def test_a_model_that_appears_later_is_loaded_at_the_next_check(tmp_path: Path) -> None:
    path = tmp_path / "student.pt"
    scheduler = FailoverScheduler(path, reload_s=10.0)
    scheduler.split(healthy(), now=0.0)
    fixed_student(LEVELS.index(0.5), path)
    split = scheduler.split(healthy(), now=10.0)
    assert scheduler.source == "student" and scheduler.counts["reloads"] == 1
    assert split["a"]["a"] == pytest.approx(0.5)


def test_the_simulator_is_deterministic_per_seed() -> None:
    first = run_episode(evaluation_scenario("brownout", 4), LocalFirst())
    again = run_episode(evaluation_scenario("brownout", 4), LocalFirst())
    other = run_episode(evaluation_scenario("brownout", 5), LocalFirst())
    assert first == again
    assert first != other
    assert first.steps == round(60.0 / STEP_S)


def test_an_outage_shows_in_observations_only_when_the_vectors_go_stale() -> None:
    layout = make_layout(6)
    outage_s = 5.0
    scenario = Scenario("outage", 6, layout, 0.4, duration_s=10.0, events=(Outage(0, outage_s, 10.0),))
    sim = ZoneSim(scenario)
    nodes = int((layout.node_zone == 0).sum())
    rule = LocalFirst()
    previous: ZoneSplit = {}
    seen: list[tuple[float, int, float]] = []
    while not sim.done():
        observed = sim.observations()[0]
        previous = rule.split(sim.observations(), previous)
        outcome = sim.step(previous)
        seen.append((round(sim.t - STEP_S, 6), observed.alive, outcome.caller_failed_share[0]))
    before = [(alive, failed) for t, alive, failed in seen if t < outage_s]
    assert all(alive == nodes and failed == 0 for alive, failed in before)
    first_step = next(entry for entry in seen if entry[0] >= outage_s)
    assert first_step[1] == nodes and first_step[2] > 0.5  # requests fail at once, the brain sees all alive
    # The last vectors went out at most a period before the outage; each is stale 1.5 periods after it was sent.
    last_sent = outage_s - AGENT_PERIOD_S + layout.phase_s[layout.node_zone == 0]
    for t, alive, _ in seen:
        if t >= outage_s:
            assert alive == int((t - last_sent <= ALIVE_PERIODS * AGENT_PERIOD_S + 1e-9).sum())
    assert seen[-1][1] == 0
    metrics = sim.metrics()
    assert metrics.recovery_s is not None and 0.4 <= metrics.recovery_s <= ALIVE_PERIODS * AGENT_PERIOD_S


def test_the_mixture_p99_follows_a_small_slow_flow() -> None:
    fast = mixture_p99(np.array([[1.0, 0.0]]), np.array([[100.0, 900.0]]))
    mixed = mixture_p99(np.array([[0.95, 0.05]]), np.array([[100.0, 900.0]]))
    assert fast[0] == pytest.approx(100.0)
    x = mixed[0]
    assert 0.95 * 0.01 ** (x / 100.0) + 0.05 * 0.01 ** (x / 900.0) == pytest.approx(0.01)
    assert x > 300.0  # 5% of requests slow: the P99 is one of theirs, three times the fast flow's


def test_a_tiny_training_run_writes_a_loadable_student(tmp_path: Path) -> None:
    path = tmp_path / "models" / "failover.pt"
    lines: list[str] = []
    report = train_failover(path, seed=1, teacher_steps=200, log=lines.append)
    assert report.path == path and report.teacher_steps >= 200
    assert report.kl_final < report.kl_initial
    assert all(math.isfinite(r) for r in (report.teacher_reward, report.student_reward, report.rule_reward))
    assert any("teacher" in line for line in lines)
    scheduler = FailoverScheduler(path)
    assert scheduler.student is not None
    sim = ZoneSim(evaluation_scenario("calm", 1))
    for step in range(20):
        zones = sim.observations()
        split = scheduler.split(zones, now=step * STEP_S)
        assert_valid(split, zones)
        sim.step(split)
    assert scheduler.counts["student"] + scheduler.counts["fallback_range"] == 20
    assert scheduler.counts["fallback_missing"] == 0
