"""The brain's zone view and the split it publishes (`brain/_zone_view.py`), through the brain's own cycle to a
router in each zone."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from prismlb.brain import Brain, BrainConfig
from prismlb.brain._failover import LEVELS, FailoverScheduler
from prismlb.brain._zone_view import STEP, quantised
from prismlb.router import Request, Router, Settings
from prismlb.wire import NodeMetrics, NodeVector, RouterLoad

from ._helpers_vectors import node_vector
from .conftest import Clock

ZONES = {"a1": "a", "a2": "a", "b1": "b", "b2": "b"}


def vector(node_id: str, seq: int, zone: str | None = None) -> NodeVector:
    return node_vector(
        node_id,
        seq,
        zone=ZONES[node_id] if zone is None else zone,
        metrics=NodeMetrics(requests_waiting=1),
        sample_time_unix_s=time.time() - 5 + seq * 1e-3,
    )


def brain() -> Brain:
    return Brain(BrainConfig(holddown_s=0.0, train_budget_s=0.0, admin_port=0), CollectorRegistry())


def run(b: Brain, nodes: list[str], start: float, seconds: float, seq: int) -> float:
    """Vectors from `nodes` every second and brain ticks every 0.2 s, for `seconds` from `start`."""
    now = start
    while now < start + seconds:
        if round(now * 5) % 5 == 0:
            seq += 1
            b.ingest([vector(n, seq) for n in nodes], now)
        b.tick(now, time.time())
        now = round(now + 0.2, 6)
    return now


@pytest.mark.parametrize(
    "row", [{"a": 1.0}, {"a": 0.333, "b": 0.333, "c": 0.334}, {"a": 0.0, "b": 0.96, "c": 0.04}, {"a": 2.0, "b": 6.0}]
)
def test_published_shares_are_whole_steps_summing_to_one(row: dict[str, float]) -> None:
    shares = quantised(row)
    assert abs(sum(s.fraction for s in shares) - 1.0) < 1e-9
    assert all(s.fraction > 0 and abs(s.fraction / STEP - round(s.fraction / STEP)) < 1e-9 for s in shares)
    assert [s.zone for s in shares] == sorted(s.zone for s in shares)


def test_one_zone_or_an_unnamed_one_publishes_no_split() -> None:
    b = brain()
    b.ingest([vector("a1", 1), vector("a2", 1)], 0.0)
    assert b.tick(0.0, time.time()) is not None and b.current is not None and b.current.zones == []
    b.ingest([vector("b1", 1, zone="")], 0.1)
    assert not b.zones.routes(b.registry.nodes, {}, {}, 0.1)


def test_healthy_zones_stay_local_and_an_outage_moves_its_callers_traffic() -> None:
    b = brain()
    now = run(b, list(ZONES), 0.0, 3.0, 0)
    table = b.current
    assert table is not None
    rows = {row.caller: {s.zone: s.fraction for s in row.shares} for row in table.zones}
    assert rows == {"a": {"a": 1.0}, "b": {"b": 1.0}}
    in_b = Router.from_table(table, settings=Settings(zone="b"), clock=Clock())
    assert {in_b.route(Request(key=f"k{k}")).node_id for k in range(100)} <= {"b1", "b2"}
    # zone b stops reporting: within 1.5 periods its nodes are not alive, its callers go to zone a
    now = run(b, ["a1", "a2"], now, 2.0, 10)
    observed = {o.zone: o for o in b.zones.observations}
    assert observed["b"].alive == 0 and observed["b"].nodes == 2
    rows = {row.caller: {s.zone: s.fraction for s in row.shares} for row in b.current.zones}
    assert rows["b"] == {"a": 1.0}
    # after the registry dropped them, the zone still counts its nodes (not alive): the outage stays visible
    now = run(b, ["a1", "a2"], now, 3.0, 20)
    assert not {"b1", "b2"} & set(b.registry.nodes)
    assert {o.zone: (o.nodes, o.alive) for o in b.zones.observations}["b"] == (2, 0)


def test_callers_demand_comes_from_the_routers_zones() -> None:
    b = brain()
    b.loads.accept(RouterLoad(router_id="r1", zone="a", seq=1, loads={"a1": 3000.0}), 0.0)
    b.loads.accept(RouterLoad(router_id="r2", zone="b", seq=1, loads={"b1": 1000.0}), 0.0)
    run(b, list(ZONES), 0.0, 2.0, 0)
    demand = {o.zone: o.demand for o in b.zones.observations}
    assert demand == pytest.approx({"a": 0.75, "b": 0.25})


def test_a_scheduler_failure_publishes_no_split_and_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    b = brain()

    def broken(self: FailoverScheduler, zones: object, now: float) -> dict[str, dict[str, float]]:
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(FailoverScheduler, "split", broken)
    run(b, list(ZONES), 0.0, 2.0, 0)
    assert b.current is not None and b.current.zones == []
    assert b.faults.counts().get("zone_split", 0) >= 1
    # routers without a split place over every zone
    r = Router.from_table(b.current, settings=Settings(zone="a"), clock=Clock())
    assert set(Counter(r.route(Request(key=f"k{k}")).node_id for k in range(200))) == set(ZONES)


def test_the_split_and_its_decider_are_on_metrics_and_in_the_admin_status() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from prismlb.brain._backend import Backend

    b = brain()
    run(b, list(ZONES), 0.0, 2.0, 0)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(b.metrics).decode())
        for s in family.samples
    }
    decided = samples[("prism_brain_failover_decisions_total", (("by", "rule"),))]
    assert decided >= 5 and samples[("prism_brain_failover_fallbacks_total", (("reason", "missing"),))] == decided
    assert samples[("prism_brain_zone_nodes", (("state", "alive"), ("zone", "b")))] == 2
    status = Backend(b).status()["zones"]
    assert status["decided_by"] == "rule" and {o["zone"] for o in status["observed"]} == {"a", "b"}
    assert [row["caller"] for row in status["split"]] == ["a", "b"]


def test_a_brain_given_a_student_publishes_its_split(tmp_path: Path) -> None:
    from .test_failover import fixed_student

    path = tmp_path / "failover.pt"
    fixed_student(LEVELS.index(0.5), path)  # a student that always keeps half local
    b = Brain(BrainConfig(holddown_s=0.0, train_budget_s=0.0, admin_port=0, failover_model=path), CollectorRegistry())
    run(b, list(ZONES), 0.0, 2.0, 0)
    assert b.zones.scheduler.source == "student" and b.zones.scheduler.counts["student"] >= 5
    assert b.current is not None
    rows = {row.caller: {s.zone: s.fraction for s in row.shares} for row in b.current.zones}
    assert rows == {"a": {"a": 0.5, "b": 0.5}, "b": {"a": 0.5, "b": 0.5}}


def test_a_moments_burst_in_one_zone_does_not_read_as_all_the_demand() -> None:
    b = brain()
    b.ingest([vector(n, 1) for n in ZONES], 0.0)
    for step in range(50):  # 10 s of even demand
        b.zones.routes(b.registry.nodes, {}, {"a": 0.5, "b": 0.5}, step * 0.2)
    b.zones.routes(b.registry.nodes, {}, {"a": 1.0}, 10.0)  # one cycle where only zone a's router had work queued
    demand = {o.zone: o.demand for o in b.zones.observations}
    assert 0.5 < demand["a"] < 0.52 and demand["a"] + demand["b"] == pytest.approx(1.0)
