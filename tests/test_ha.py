"""Live brains (`prism brain` processes): poison vectors, kill -9 and restart, two brains failing over.

Each failure here was seen on live processes: one vector took a brain down, a restarted brain emptied its
routers, routers stayed on a dead brain's table. Routes are attempted throughout and none may fail.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from prismlb.router import Router
from prismlb.service import wait_until
from prismlb.sim._live import Agents, LiveBrain, Routes, nodes_of, poison

POLL_S = 0.05
"""How often a condition is asked: several ask a brain's /metrics over HTTP, which a tighter loop would load."""


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Callable[..., LiveBrain]]:
    brains: list[LiveBrain] = []

    def make(name: str, **kwargs: object) -> LiveBrain:
        brain = LiveBrain(name, tmp_path, **kwargs)  # type: ignore[arg-type]
        brain.start()
        brains.append(brain)
        return brain

    yield make
    for brain in brains:
        brain.stop()
        if os.environ.get("PRISM_TEST_SHOW_LOGS"):
            for log in sorted(tmp_path.glob(f"{brain.name}-*.log")):
                print(log.read_text())


def test_poison_vectors_are_refused_and_the_brain_keeps_publishing(live: Callable[..., LiveBrain]) -> None:
    brain = live("brain-a", holddown_s=0.0)
    ctx = zmq.Context()
    agents = Agents(ctx, [brain.ingest], ["n0", "n1"])
    router = Router.connect(brain.address)
    try:
        assert wait_until(lambda: nodes_of(router) == {"n0", "n1"}, 30.0, POLL_S), "the brain publishes both nodes"
        routes = Routes(router)

        def refused(kind: str) -> float:
            return brain.metric("prism_rejected_messages_total", {"kind": kind, "receiver": "brain"}) or 0.0

        for round_ in range(1, 6):  # each round once the brain has refused the one before, between honest vectors
            agents.inject(poison("n1", identity=False))
            assert wait_until(lambda: refused("future_sample") >= round_, 10.0, POLL_S), f"round {round_} refused"
        taken = brain.metric("prism_brain_vectors_total") or 0.0
        assert wait_until(lambda: (brain.metric("prism_brain_vectors_total") or 0.0) >= taken + 8, 10.0, POLL_S), (
            "honest vectors are taken after the poison"
        )
        routes.close()
        assert brain.alive(), "no vector takes the brain down"
        assert nodes_of(router) == {"n0", "n1"}, "the poisoned node stays routed on its honest vectors"
        assert routes.failed == [] and routes.attempted > 100 and routes.seen == {"n0", "n1"}
        assert refused("invalid_field") >= 15 and refused("future_sample") == 5
        assert router.table is not None and all(
            n.endpoint == f"http://{n.node_id}:8000" for s in router.table.slices for n in s.nodes
        ), "the spoofed endpoint never reached a table"
    finally:
        router.close()
        agents.close()
        ctx.destroy(linger=0)


def test_a_restarted_brain_holds_its_first_table_until_its_nodes_report(live: Callable[..., LiveBrain]) -> None:
    brain = live("brain-a", holddown_s=20.0)
    ctx = zmq.Context()
    nodes = ["n0", "n1", "n2", "n3"]
    agents = Agents(ctx, [brain.ingest], nodes)
    router = Router.connect(brain.address)
    try:
        assert wait_until(lambda: nodes_of(router) == set(nodes), 30.0, POLL_S)
        routes = Routes(router)
        brain.kill()
        agents.paused.set()  # the agents reach the restarted brain late
        brain.start()
        assert wait_until(lambda: (brain.metric("prism_brain_cycles_total") or 0) >= 10, 30.0, POLL_S), (
            "the new brain cycles"
        )
        if brain.metric("prism_brain_holding") == 1:  # vectors queued before the kill may reach it and release it
            assert brain.metric("prism_brain_tables_published_total") == 0, "holding, it publishes nothing"
        assert nodes_of(router) == set(nodes), "no empty table from the restarted brain"
        agents.paused.clear()
        assert wait_until(lambda: router.table is not None and router.table.epoch == 2, 20.0, POLL_S), "its first table"
        routes.close()
        assert nodes_of(router) == set(nodes)
        assert routes.failed == [], f"{len(routes.failed)} of {routes.attempted} routes failed"
        assert routes.attempted > 1000
    finally:
        router.close()
        agents.close()
        ctx.destroy(linger=0)


def test_two_brains_fail_over_when_the_leader_is_killed(live: Callable[..., LiveBrain]) -> None:
    low, high = live("brain-a", holddown_s=0.0), live("brain-b", holddown_s=0.0)
    ctx = zmq.Context()
    agents = Agents(ctx, [low.ingest, high.ingest], ["n0", "n1", "n2"])
    router = Router.connect([low.address, high.address])
    try:
        assert wait_until(lambda: router.table is not None and router.table.brain_id == "brain-b", 30.0, POLL_S)
        assert wait_until(lambda: nodes_of(router) == {"n0", "n1", "n2"}, 10.0, POLL_S)
        routes = Routes(router)
        high.kill()
        assert wait_until(lambda: router.brains().get("brain-a", {}).get("following") is True, 15.0, POLL_S)
        brains = router.brains()
        assert brains["brain-b"]["live"] is False and brains["brain-a"]["following"] is True
        heard = router.last_heard_age_s
        assert heard is not None and heard < router.brains()["brain-b"]["age_s"], "the followed brain's age"
        agents.nodes.remove("n2")  # a node leaves after the failover: the new leader's table drops it
        assert wait_until(lambda: nodes_of(router) == {"n0", "n1"}, 20.0, POLL_S)
        routes.close()
        assert routes.failed == [], f"{len(routes.failed)} of {routes.attempted} routes failed"
        assert "n2" not in {router.route(f"key-{i}").node_id for i in range(200)}
    finally:
        router.close()
        agents.close()
        ctx.destroy(linger=0)
