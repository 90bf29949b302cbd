"""Sessions: stickiness with a TTL, moving with the context signature on a model-version switch, stable A/B arms."""

from __future__ import annotations

import time
from collections import Counter

from prismlb.router import CONTEXT_HEADER, SESSION_HEADER, Outcome, Request, Router, Settings
from prismlb.semantics import assign_arm
from prismlb.wire import Experiment, ExperimentArm, RoutingTable, SliceTable, TableNode

from .conftest import Clock

NODES = {"a0": "v1", "a1": "v1", "a2": "v1", "b0": "v2", "b1": "v2"}


def table(
    version: int, nodes: dict[str, str] = NODES, arms: dict[str, float] | None = None, gpus: bool = False
) -> RoutingTable:
    entries = [TableNode(node_id=n, endpoint=f"{n}:8000", weight=1.0, model_version=v) for n, v in nodes.items()]
    experiments = []
    if arms is not None:
        arm_list = [ExperimentArm(model_version=v, fraction=f) for v, f in arms.items()]
        experiments.append(Experiment(name="canary", slice="llm", arms=arm_list))
    return RoutingTable(
        epoch=1,
        version=version,
        issued_unix_s=time.time(),
        slices=[SliceTable(name="llm", nodes=entries)],
        experiments=experiments,
    )


def test_a_session_sticks_to_its_endpoint_whatever_its_keys() -> None:
    router = Router.from_table(table(1))
    first = router.route(Request(key="turn-0", session="s1"))
    by_key = {router.route(f"turn-{i}").node_id for i in range(50)}
    assert len(by_key) > 1  # the keys alone would spread
    assert {router.route(Request(key=f"turn-{i}", session="s1")) for i in range(50)} == {first}
    assert router.sessions == 1


def test_a_session_is_forgotten_after_its_ttl() -> None:
    clock = Clock()
    router = Router.from_table(table(1), settings=Settings(session_ttl_s=0.2), clock=clock)
    key = next(f"k{i}" for i in range(1000) if router.route(f"k{i}").node_id != router.route("first").node_id)
    sticky = router.route(Request(key="first", session="s")).node_id
    clock.now += 0.1
    assert router.route(Request(key=key, session="s")).node_id == sticky  # used: its TTL starts again
    clock.now += 0.15
    assert router.route(Request(key=key, session="s")).node_id == sticky
    clock.now += 0.25
    assert router.route(Request(key=key, session="s")).node_id == router.route(key).node_id


def test_sessions_are_bounded() -> None:
    router = Router.from_table(table(1), settings=Settings(max_sessions=100))
    for i in range(1000):
        router.route(Request(key="k", session=f"s{i}"))
    assert 90 <= router.sessions <= 101
    assert router.route(Request(key="k", session="s999")) == router.route(Request(key="other", session="s999"))


def test_a_session_whose_node_leaves_moves_with_its_context_signature() -> None:
    router = Router.from_table(table(1))
    with router.request(Request(key="k", session="s", context_signature="ctx-1")) as lease:
        assert lease.headers == {SESSION_HEADER: "s", CONTEXT_HEADER: "ctx-1"} and lease.moved_from is None
    old = lease.node_id
    assert router.apply(table(2, {n: v for n, v in NODES.items() if n != old}))
    with router.request(Request(key="k", session="s")) as moved:  # this request carries no signature itself
        assert moved.node_id != old and moved.moved_from == old
        assert moved.headers == {SESSION_HEADER: "s", CONTEXT_HEADER: "ctx-1"}  # the new node can load it
    with router.request(Request(key="k", session="s")) as settled:
        assert settled.node_id == moved.node_id and settled.moved_from is None


def test_a_model_version_switch_in_place_moves_the_session_to_the_new_version() -> None:
    router = Router.from_table(table(1))
    with router.request(Request(key="k", session="s", context_signature="ctx")) as lease:
        pass
    upgraded = {**NODES, lease.node_id: "v3"}
    assert router.apply(table(2, upgraded))
    with router.request(Request(key="k", session="s")) as after:
        # Same node, new model version: it must load the session's context, so the signature goes with it.
        assert after.node_id == lease.node_id and after.endpoint.model_version == "v3"
        assert after.moved_from == lease.node_id and after.headers[CONTEXT_HEADER] == "ctx"


def test_a_down_node_moves_its_sessions_too() -> None:
    router = Router.from_table(table(1))
    with router.request(Request(key="k", session="s", context_signature="c")) as lease:
        lease.fail(Outcome.CONNECT)
    with router.request(Request(key="k", session="s")) as moved:
        assert moved.node_id != lease.node_id and moved.moved_from == lease.node_id
        assert moved.headers[CONTEXT_HEADER] == "c"


def test_ab_arms_are_assigned_per_session_as_the_brain_assigns_them() -> None:
    router = Router.from_table(table(1, arms={"v1": 0.9, "v2": 0.1}))
    experiment = router.table.experiments[0] if router.table else None
    assert experiment is not None
    versions: Counter[str] = Counter()
    for i in range(4000):
        session = f"user-{i}"
        endpoint = router.route(Request(key=f"conversation-{i}", session=session))
        assert endpoint.model_version == assign_arm(experiment, session)
        versions[endpoint.model_version] += 1
    assert 0.08 < versions["v2"] / 4000 < 0.12
    # Stable: the same sessions land on the same arm in another router and on later requests.
    again = Router.from_table(table(1, arms={"v1": 0.9, "v2": 0.1}))
    for i in range(200):
        assert again.route(Request(key="other", session=f"user-{i}")).model_version == assign_arm(
            experiment, f"user-{i}"
        )
    # Without a session, the affinity key picks the arm.
    assert router.route(Request(key="conversation-7")).model_version == assign_arm(experiment, "conversation-7")
    assert router.route("conversation-7").model_version == assign_arm(experiment, "conversation-7")


def test_ramping_an_experiment_moves_sessions_to_the_new_version_with_their_context() -> None:
    router = Router.from_table(table(1, arms={"v1": 0.9, "v2": 0.1}))
    placed = {}
    for i in range(100):
        with router.request(Request(key=f"c{i}", session=f"u{i}", context_signature=f"ctx{i}")) as lease:
            placed[f"u{i}"] = lease.endpoint
    assert router.apply(table(2, arms={"v2": 1.0}))
    moved = 0
    for i in range(100):
        with router.request(Request(key=f"c{i}", session=f"u{i}")) as lease:
            assert lease.endpoint.model_version == "v2"
            if placed[f"u{i}"].model_version == "v1":
                moved += 1
                assert lease.moved_from == placed[f"u{i}"].node_id and lease.headers[CONTEXT_HEADER] == f"ctx{i}"
            else:
                assert lease.endpoint == placed[f"u{i}"] and lease.moved_from is None
    assert moved > 80


def test_an_arm_without_nodes_routes_on_the_whole_slice() -> None:
    router = Router.from_table(table(1, arms={"v9": 1.0}))
    assert {router.route(Request(key=f"k{i}", session=f"s{i}")).model_version for i in range(100)} == {"v1", "v2"}


def test_gpu_entries_on_the_callers_numa_node_get_more_requests() -> None:
    gpus = [TableNode(node_id="h", endpoint="h:8000", weight=1.0, gpu=g, numa_node=g // 4) for g in range(8)]
    av = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="av", nodes=gpus)])
    router = Router.from_table(av, settings=Settings(numa_node=1))
    counts = Counter(router.route(Request(key=f"expert-{i}", modality="audio+video")).gpu for i in range(20_000))
    near = sum(counts[g] for g in range(4, 8))
    far = sum(counts[g] for g in range(4))
    assert 2.0 < near / far < 3.2  # 1.0 : 0.4
    status = router.status()
    assert sorted(status) == [f"h/gpu{g}" for g in range(8)]
