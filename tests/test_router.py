"""The router against real ZeroMQ brains on loopback: snapshots, following, fail-static, hostile input."""

from __future__ import annotations

import argparse
import asyncio
import logging
import queue
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from prismlb import wire
from prismlb.router import Endpoint, Lease, NoRouteError, Outcome, Request, Router, Settings, ShedError, add_parser
from prismlb.wire import (
    BrainAddress,
    Experiment,
    ExperimentArm,
    RejectCounter,
    RoutingTable,
    SliceTable,
    TableNode,
    TablePublisher,
)

from .conftest import wait_for

KEYS = [f"conversation-{i}" for i in range(200)]


def free_tcp_endpoints(count: int) -> list[str]:
    """`count` distinct tcp:// endpoints on 127.0.0.1 whose ports the OS just reported free."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            held.append(sock)
        return [f"tcp://127.0.0.1:{sock.getsockname()[1]}" for sock in held]
    finally:
        for sock in held:
            sock.close()


def make_table(epoch: int, version: int, node_ids: Sequence[str], **extra: Sequence[str]) -> RoutingTable:
    """A table whose "default" slice holds `node_ids`, plus one slice per keyword argument."""
    slices = {"default": node_ids, **extra}
    return RoutingTable(
        epoch=epoch,
        version=version,
        issued_unix_s=time.time(),
        slices=[
            SliceTable(name=name, nodes=[TableNode(node_id=n, endpoint=f"{n}.pool:8000", weight=1.0) for n in ids])
            for name, ids in slices.items()
        ],
    )


class Brain:
    """A real `TablePublisher` on free loopback ports, driven by one thread as the brain's loop drives
    it: publishes tables handed to `publish`, answers snapshot requests, heartbeats every 50 ms."""

    def __init__(self) -> None:
        updates, snapshot = free_tcp_endpoints(2)
        self.address = BrainAddress(updates, snapshot)
        self._ctx = zmq.Context()
        self.publisher = TablePublisher(
            self._ctx, updates, snapshot, RejectCounter("test-brain", logging.getLogger("test.brain"))
        )
        self._inbox: queue.SimpleQueue[tuple[RoutingTable, threading.Event]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def publish(self, table: RoutingTable) -> None:
        """Publish `table` and return once it is on the wire."""
        done = threading.Event()
        self._inbox.put((table, done))
        assert done.wait(2.0)

    def _run(self) -> None:
        next_heartbeat = 0.0
        while not self._stop.is_set():
            try:
                table, done = self._inbox.get(timeout=0.005)
            except queue.Empty:
                pass
            else:
                self.publisher.publish(table)
                done.set()
            self.publisher.serve_snapshots()
            if time.monotonic() >= next_heartbeat:
                self.publisher.heartbeat()
                next_heartbeat = time.monotonic() + 0.05

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.publisher.close()
            self._ctx.term()


@pytest.fixture
def brains() -> Iterator[Callable[[], Brain]]:
    started: list[Brain] = []

    def start() -> Brain:
        started.append(Brain())
        return started[-1]

    yield start
    for brain in started:
        brain.close()


def hear_the_brain(router: Router, messages: int = 2) -> None:
    """Return once the router has heard from the brain it follows `messages` more times. After every batch of
    messages it receives, the router's subscriber offers the leader's latest table, so by the second message at
    the latest (the first may share a batch with what came before it) everything before has been offered."""
    subscriber = router._subscriber
    assert subscriber is not None
    for _ in range(messages):
        since = time.monotonic()
        wait_for(lambda since=since: (subscriber.last_heard_monotonic or 0.0) > since, what="a message from the brain")


def test_late_joiner_gets_the_table_by_snapshot_then_follows_updates(brains: Callable[[], Brain]) -> None:
    brain = brains()
    brain.publish(make_table(1, 1, ["a0", "a1", "a2"]))
    with Router.connect(brain.address) as router:
        assert router.wait_for_table(1.0)
        assert router.table is not None and router.table.order == (1, 1)
        # the publisher counts a snapshot once it has sent every part, which may be after the router applied it
        assert wait_for(lambda: brain.publisher.snapshots_served >= 1)
        assert router.route("k").node_id in {"a0", "a1", "a2"}

        brain.publish(make_table(1, 2, ["a0", "a1", "a2", "b0"]))
        brain.publish(make_table(1, 3, ["a0", "a1", "c0", "c1"]))  # two of four gone: within the drop limit
        assert wait_for(lambda: router.table is not None and router.table.version == 3)
        assert {router.route(k).node_id for k in KEYS} == {"a0", "a1", "c0", "c1"}
        endpoint = router.route("k")
        assert endpoint == Endpoint(endpoint.node_id, f"{endpoint.node_id}.pool:8000")


def test_a_table_dropping_most_nodes_is_held_back_then_taken(brains: Callable[[], Brain]) -> None:
    """A brain that lost its agents (a restart, a partition) must not empty its routers at once."""
    brain = brains()
    brain.publish(make_table(1, 1, ["a0", "a1", "a2", "a3"]))
    settings = Settings(drop_hold_s=1.0)
    with Router.connect(brain.address, settings=settings) as router:
        assert router.wait_for_table(1.0)
        brain.publish(make_table(1, 2, []))  # every node gone at once
        assert wait_for(lambda: router.rejects.counts().get("mass_drop") == 1)
        hear_the_brain(router, 3)  # offered again after each
        assert router.table is not None and router.table.order == (1, 1)
        assert router.route("k").node_id.startswith("a")
        assert router.rejects.counts().get("mass_drop") == 1, "counted once per table, however often offered"
        assert wait_for(lambda: router.table is not None and router.table.order == (1, 2), timeout_s=3.0)

        # Nodes the operator drained leave on purpose: not counted against the limit.
        brain.publish(make_table(1, 3, ["a0", "a1", "a2", "a3"]))
        assert wait_for(lambda: router.table is not None and router.table.order == (1, 3))
        drained = msgspec.structs.replace(make_table(1, 4, ["a0"]), drained=["a1", "a2", "a3"])
        brain.publish(drained)
        assert wait_for(lambda: router.table is not None and router.table.order == (1, 4), timeout_s=3.0)
        assert router.rejects.counts().get("mass_drop") == 1, "taken at once: never refused"


def test_keeps_routing_on_the_last_table_when_the_brain_goes_away(brains: Callable[[], Brain]) -> None:
    brain = brains()
    brain.publish(make_table(4, 9, ["a0", "a1", "a2"]))
    with Router.connect(brain.address) as router:
        assert router.wait_for_table(1.0)
        before = [router.route(k) for k in KEYS]
        brain.close()
        heard = router.last_heard_age_s
        age = router.table_age_s
        assert heard is not None and age is not None
        # Both ages run on the real monotonic clock (`Router.connect` takes no clock): they must grow by 0.25 s.
        assert wait_for(
            lambda: (router.last_heard_age_s or 0.0) >= heard + 0.25 and (router.table_age_s or 0.0) >= age + 0.25
        ), (router.last_heard_age_s, router.table_age_s)
        assert [router.route(k) for k in KEYS] == before
        assert router.table is not None and router.table.order == (4, 9)


def named(table: RoutingTable, brain_id: str, priority: int = 0) -> RoutingTable:
    return msgspec.structs.replace(table, brain_id=brain_id, priority=priority)


def test_two_brains_fail_over_to_the_live_one_and_back(brains: Callable[[], Brain]) -> None:
    first, second = brains(), brains()
    nodes = ["n0", "n1", "n2"]
    # The leader is the live brain of highest (priority, brain id): "b" over "a", whatever their epochs.
    first.publish(named(make_table(7, 5, nodes), "a"))
    second.publish(named(make_table(2, 1, nodes), "b"))
    with Router.connect([first.address, second.address], brain_timeout_s=0.5) as router:
        assert wait_for(lambda: router.table is not None and router.table.brain_id == "b")
        first.publish(named(make_table(7, 6, [*nodes, "n3"]), "a"))
        assert wait_for(lambda: router.brains()["a"]["order"] == (7, 6))
        hear_the_brain(router)
        assert router.table is not None and router.table.order == (2, 1), "the follower's tables are not used"
        brains_seen = router.brains()
        assert set(brains_seen) == {"a", "b"} and brains_seen["b"]["following"] and brains_seen["a"]["live"]

        second.close()  # the leader dies: within the timeout the router takes the other brain's latest table
        assert wait_for(lambda: router.brains()["a"]["following"] is True, timeout_s=2.0)
        assert router.table is not None and router.table.order == (7, 6)
        age = router.last_heard_age_s
        ages = router.brains()
        assert ages["b"]["live"] is False and ages["a"]["following"] is True
        assert age is not None and age < ages["b"]["age_s"], "the followed brain's age, not the dead one's"
        assert {router.route(k).node_id for k in KEYS} == {"n0", "n1", "n2", "n3"}


def test_priority_decides_and_a_restart_without_state_is_followed(brains: Callable[[], Brain]) -> None:
    low_id, high_id = brains(), brains()
    low_id.publish(named(make_table(0, 40, ["a0", "a1"]), "a", priority=5))
    high_id.publish(named(make_table(0, 3, ["a0", "a1"]), "z"))
    with Router.connect([low_id.address, high_id.address], brain_timeout_s=0.5) as router:
        assert wait_for(lambda: router.table is not None and router.table.brain_id == "a")
        # The leader restarts without a state folder: epoch 0 again, its versions start again. Its new tables
        # are still the ones to follow (the order going back is how a restart shows).
        low_id.publish(named(make_table(0, 1, ["a0", "a1", "a2"]), "a", priority=5))
        assert wait_for(lambda: router.table is not None and router.table.order == (0, 1))
        assert router.table is not None and router.table.brain_id == "a"


def _invalid_weight_update() -> bytes:
    update = msgspec.to_builtins(
        wire.SliceUpdate(
            epoch=99,
            version=1,
            slice="default",
            base_version=0,
            upserts=[TableNode(node_id="evil", endpoint="e", weight=1.0)],
        )
    )
    update["upserts"][0]["weight"] = 5.0
    return msgspec.msgpack.encode(update)


def test_hostile_frames_are_counted_and_routing_goes_on(brains: Callable[[], Brain]) -> None:
    brain = brains()
    brain.publish(make_table(1, 1, ["a0", "a1"]))
    hostile_updates, unbound_snapshot = free_tcp_endpoints(2)
    ctx = zmq.Context()
    hostile = ctx.socket(zmq.PUB)
    hostile.linger = 0
    hostile.bind(hostile_updates)
    garbage = [
        [b"prism.head"],
        [b"prism.head", b"1", b"\xc1 not msgpack"],
        [b"prism.head", b"7", wire.encode(make_table(99, 0, ["evil"]))[2]],
        [b"prism.headless", b"1", b"\x80"],
        [b"prism.slice/default/", b"1", _invalid_weight_update()],
    ]
    kinds = {"frames", "malformed", "schema_version", "unknown_kind", "invalid_field"}
    registry = CollectorRegistry()
    router = Router.connect([brain.address, BrainAddress(hostile_updates, unbound_snapshot)], registry=registry)
    try:
        assert router.wait_for_table(1.0)

        def rejected_every_kind() -> bool:  # sent again until the router's SUB has joined the hostile PUB
            for frames in garbage:
                hostile.send_multipart(frames)
            assert router.route("k").node_id in {"a0", "a1"}
            return kinds <= set(router.rejects.counts())

        wait_for(rejected_every_kind, 3.0)
        assert set(router.rejects.counts()) == kinds
        assert registry.get_sample_value("prism_rejected_messages_total", {"receiver": "router", "kind": "frames"})

        # A head that names slice versions the router never received cannot make a table: the router keeps
        # its table and asks for a snapshot.
        orphan = wire.encode(
            wire.TableHead(
                epoch=1,
                version=2,
                issued_unix_s=time.time(),
                slices=[wire.SliceHead(name="default", version=2, entries=1)],
            )
        )
        cut_off = router.rejects.counts()["frames"]
        for _ in range(5):
            hostile.send_multipart(orphan)
        hostile.send_multipart(garbage[0])  # after the orphans on one socket: once it is counted, they were read
        assert wait_for(lambda: router.rejects.counts()["frames"] > cut_off)
        hear_the_brain(router)
        assert router.table is not None and router.table.order == (1, 1)

        brain.publish(make_table(1, 3, ["a0", "b1"]))
        assert wait_for(lambda: router.table is not None and router.table.order == (1, 3))
        assert {router.route(k).node_id for k in KEYS} == {"a0", "b1"}
    finally:
        router.close()
        hostile.close()
        ctx.term()


def test_route_before_any_table_raises(brains: Callable[[], Brain]) -> None:
    brain = brains()
    with Router.connect(brain.address) as router:
        assert not router.wait_for_table(0.2)
        with pytest.raises(NoRouteError, match="no routing table yet"):
            router.route("k")
        assert router.table is None and router.table_age_s is None
    with pytest.raises(NoRouteError):
        Router().route("k")


def test_missing_and_empty_slices_raise_clearly() -> None:
    router = Router.from_table(make_table(1, 1, ["a0"], vlm=[], audio=["v0"]))
    assert router.route("k", "audio") == Endpoint("v0", "v0.pool:8000")
    with pytest.raises(NoRouteError, match="slice 'vlm' has no nodes in table epoch 1 version 1"):
        router.route("k", "vlm")
    with pytest.raises(NoRouteError, match=r"no slice 'retrieval' .*\(slices: audio, default, vlm\)"):
        router.route("k", "retrieval")
    assert router.last_heard_age_s is None


def test_apply_takes_only_newer_tables_and_refuses_unroutable_ones() -> None:
    router = Router.from_table(make_table(1, 5, ["a0"]))
    assert not router.apply(make_table(1, 4, ["b0"]))
    assert not router.apply(make_table(1, 5, ["b0"]))
    assert not router.apply(make_table(0, 99, ["b0"]))
    with pytest.raises(ValueError, match="slice 'default': node id 'c0' appears more than once"):
        router.apply(make_table(1, 6, ["c0", "c0"]))
    assert router.route("k").node_id == "a0"
    assert router.apply(make_table(2, 0, ["b0"]))
    assert router.route("k").node_id == "b0"


def test_exports_the_table_in_use_and_each_endpoint_as_gauges() -> None:
    registry = CollectorRegistry()
    router = Router(registry=registry)
    assert registry.get_sample_value("prism_router_table_version") is None
    router.apply(make_table(3, 7, ["a0"]))
    assert registry.get_sample_value("prism_router_table_epoch") == 3
    assert registry.get_sample_value("prism_router_table_version") == 7
    age = registry.get_sample_value("prism_router_table_age_seconds")
    assert age is not None and 0 <= age < 5
    speed = "prism_router_first_token_speed_tokens_per_second"
    with router.request(Request(key="k", session="s", cost=500)) as lease:
        assert registry.get_sample_value("prism_router_inflight_requests", {"endpoint": "a0"}) == 1
        assert registry.get_sample_value(speed, {"endpoint": "a0"}) is None
        lease.first_token()
    assert registry.get_sample_value("prism_router_inflight_requests", {"endpoint": "a0"}) == 0
    assert (registry.get_sample_value(speed, {"endpoint": "a0"}) or 0) > 0
    assert registry.get_sample_value("prism_router_endpoint_available", {"endpoint": "a0"}) == 1
    assert registry.get_sample_value("prism_router_circuit_state", {"endpoint": "a0"}) == 0
    assert registry.get_sample_value("prism_router_requests_total", {"endpoint": "a0", "outcome": "ok"}) == 1
    assert registry.get_sample_value("prism_router_retransmitted_segments_total", {"endpoint": "a0"}) == 0
    assert registry.get_sample_value("prism_router_network_stall_seconds", {"endpoint": "a0"}) == 0
    with router.request(Request(key="k", cost=500)) as lease:
        lease.retransmitted(3)  # as a transport reads them from the connection's TCP_INFO
    assert registry.get_sample_value("prism_router_retransmitted_segments_total", {"endpoint": "a0"}) == 3
    stall = registry.get_sample_value("prism_router_network_stall_seconds", {"endpoint": "a0"})
    assert stall == pytest.approx(3 / 2 * 0.2, rel=0.01)  # 3 segments, 1 request and 1 that lost nothing, 200 ms each
    assert registry.get_sample_value("prism_router_sessions") == 1


def versioned_table(version: int, prefix: str, count: int) -> RoutingTable:
    """A table whose nodes all carry the table's own version in their address and model version."""
    nodes = [
        TableNode(
            node_id=f"{prefix}{i}", endpoint=f"{prefix}{i}.pool:{version}", weight=1.0, model_version=f"v{version}"
        )
        for i in range(count)
    ]
    experiment = Experiment(name="canary", slice="llm", arms=[ExperimentArm(model_version=f"v{version}", fraction=1.0)])
    return RoutingTable(
        epoch=1,
        version=version,
        issued_unix_s=time.time(),
        slices=[SliceTable(name="default", nodes=nodes), SliceTable(name="llm", nodes=nodes)],
        experiments=[experiment],
    )


def test_concurrent_routing_never_sees_a_mixed_table() -> None:
    router = Router.from_table(versioned_table(0, "a", 5))
    stop = threading.Event()
    errors: list[BaseException] = []
    routed = [0] * 8

    def consistent(endpoint: Endpoint) -> None:
        # Node, address and model version must all come from one applied table.
        version = int(endpoint.address.rsplit(":", 1)[1])
        if endpoint.model_version != f"v{version}" or endpoint.node_id[0] != "ab"[version % 2]:
            raise AssertionError(f"{endpoint} mixes tables")

    def reader(index: int) -> None:
        rng = random.Random(index)
        try:
            while not stop.is_set():
                key = f"key-{rng.randrange(10_000)}"
                consistent(router.route(key))
                consistent(router.route(Request(key=key, session=f"s{rng.randrange(50)}")))
                with router.request(Request(key=key, modality="text")) as lease:
                    consistent(lease.endpoint)
                routed[index] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        for version in range(1, 201):
            assert router.apply(versioned_table(version, "ab"[version % 2], 5 + version % 3))
            assert {router.route(k).node_id[0] for k in KEYS[:20]} == {"ab"[version % 2]}
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    assert all(count > 0 for count in routed)
    assert router.table is not None and router.table.version == 200
    assert all(status.inflight == 0 for status in router.status().values())


def test_requests_go_to_their_modality_slice_or_its_fallback() -> None:
    def nodes(*ids: str) -> list[TableNode]:
        return [TableNode(node_id=n, endpoint=f"{n}:8000", weight=1.0) for n in ids]

    table = RoutingTable(
        epoch=1,
        version=1,
        issued_unix_s=time.time(),
        slices=[
            SliceTable(name="llm", nodes=nodes("t0", "t1")),
            SliceTable(name="vlm", nodes=nodes("v0")),
            SliceTable(name="av", nodes=[], fallback="vlm"),
            SliceTable(name="rag", nodes=[]),
        ],
    )
    router = Router.from_table(table)
    assert router.route(Request(key="k", modality="image+text")).node_id == "v0"
    assert router.route(Request(key="k", modality="audio+video")).node_id == "v0"  # av is empty: its fallback
    assert router.route(Request(key="k", modality="text")).node_id in {"t0", "t1"}
    assert router.route(Request(key="k")).node_id in {"t0", "t1"}  # no signature: the text slice
    assert router.route(Request(key="k", modality="hologram")).node_id in {"t0", "t1"}  # unknown: the text slice
    assert router.route("k").node_id in {"t0", "t1"}
    assert router.route(Request(key="k", slice="vlm")).node_id == "v0"
    with pytest.raises(NoRouteError, match="no nodes for slice 'rag' or 'default'"):
        router.route(Request(key="k", modality="rag+text"))
    headers = {"x-modality-signature": "img+txt", "X-SESSION-TOKEN": "s1", "X-Prism-Class": "batch"}
    assert Request.from_headers(headers, key=7) == Request(
        key=7, modality="img+txt", session="s1", request_class="batch"
    )
    # A table with only "default" takes every modality there.
    assert Router.from_table(make_table(1, 1, ["d0"])).route(Request(modality="audio")).node_id == "d0"


def test_the_guardians_shed_classes_are_refused_with_a_typed_error() -> None:
    table = make_table(3, 4, ["a0", "a1"])
    degraded = RoutingTable(
        epoch=3, version=5, issued_unix_s=time.time(), slices=table.slices, shed_classes=["batch"], guardian="degrade"
    )
    router = Router.from_table(degraded)
    with pytest.raises(
        ShedError, match=r"request class 'batch' is shed while the guardian is 'degrade' \(table epoch 3 version 5\)"
    ) as info:
        router.route(Request(key="k", request_class="batch"))
    assert info.value.request_class == "batch" and info.value.guardian == "degrade"
    with pytest.raises(ShedError):
        router.request(Request.from_headers({"X-Prism-Class": "batch"}))
    assert router.route(Request(key="k")).node_id in {"a0", "a1"}  # core traffic still flows
    assert router.apply(RoutingTable(epoch=3, version=6, issued_unix_s=time.time(), slices=table.slices))
    assert router.route(Request(key="k", request_class="batch")).node_id in {"a0", "a1"}


def test_async_callers_use_the_same_leases() -> None:
    router = Router.from_table(make_table(1, 1, ["a0", "a1", "a2"]))

    async def main() -> list[str]:
        async def one(key: str) -> str:
            async with router.request(key) as lease:
                await asyncio.sleep(0.01)
                return lease.node_id

        async def via_acall(lease: Lease) -> str:
            await asyncio.sleep(0)
            return lease.address

        placed = await asyncio.gather(*(one(k) for k in KEYS[:50]))
        placed.append(await router.acall("k", via_acall))
        return placed

    placed = asyncio.run(main())
    assert set(placed[:50]) <= {"a0", "a1", "a2"} and placed[50] == router.route("k").address
    assert all(status.inflight == 0 for status in router.status().values())
    assert {s.outcomes.get(Outcome.OK, 0) for s in router.status().values()} != {0}


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prism")
    add_parser(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_prints_where_keys_go(brains: Callable[[], Brain], capsys: pytest.CaptureFixture[str]) -> None:
    brain = brains()
    brain.publish(make_table(2, 8, ["a0", "a1"], vlm=["v0"]))
    a = brain.address
    assert _cli(["route", "--updates", a.updates, "--snapshot", a.snapshot, "--slice", "vlm", "x", "y"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "table epoch 2 version 8, slice 'vlm'",
        "x -> v0 v0.pool:8000",
        "y -> v0 v0.pool:8000",
    ]
    assert _cli(["route", "--updates", a.updates, "--snapshot", a.snapshot, "x"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "table epoch 2 version 8, slice 'default'", "no text slice here"


def test_slice_of_names_the_slice_that_takes_the_request() -> None:
    nodes = [TableNode(node_id="a", endpoint="a:8000", weight=1.0)]
    slices = [SliceTable(name="llm", nodes=nodes), SliceTable(name="vlm", nodes=[], fallback="llm")]
    router = Router.from_table(RoutingTable(epoch=1, version=1, issued_unix_s=0.0, slices=slices))
    assert router.slice_of() == router.slice_of("llm") == router.slice_of("vlm") == "llm"
    with pytest.raises(NoRouteError, match="no slice 'rag'"):
        router.slice_of("rag")
    with pytest.raises(NoRouteError, match="no routing table yet"):
        Router().slice_of()


def test_cli_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    updates, snapshot = free_tcp_endpoints(2)
    assert _cli(["route", "--updates", updates, "--snapshot", snapshot, "--timeout", "0.2", "k"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"prism route: no routing table from {updates} / {snapshot} within 0.2 s"]
    assert _cli(["route", "--curve-secret", "/nonexistent", "k"]) == 2
    assert "must be given together" in capsys.readouterr().err


def test_cli_renders_the_current_table_for_nginx(
    brains: Callable[[], Brain], capsys: pytest.CaptureFixture[str]
) -> None:
    brain = brains()
    table = make_table(2, 9, ["a0", "a1"])
    brain.publish(RoutingTable(epoch=2, version=9, issued_unix_s=0.0, slices=table.slices))
    a = brain.address
    argv = ["route", "--updates", a.updates, "--snapshot", a.snapshot, "--nginx", "--max-fails", "2"]
    assert _cli([*argv, "--fail-timeout", "5"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "# Prism routing table epoch 2 version 9, issued 1970-01-01T00:00:00Z, guardian 'normal'",
        "upstream prism_default {",
        "    hash $http_x_prism_affinity_key consistent;",
        "    server a0.pool:8000 weight=20 max_fails=2 fail_timeout=5s;  # a0",
        "    server a1.pool:8000 weight=20 max_fails=2 fail_timeout=5s;  # a1",
        "}",
    ]
    assert _cli(["route", "--updates", a.updates, "--snapshot", a.snapshot]) == 2
    assert "give keys to route, or --nginx" in capsys.readouterr().err


def test_a_router_subscribed_to_some_slices_holds_only_those(brains: Callable[[], Brain]) -> None:
    brain = brains()
    brain.publish(make_table(1, 1, ["a0", "a1"], llm=["t0", "t1"], av=["v0"]))
    with Router.connect(brain.address, slices=["llm"]) as router:
        assert router.wait_for_table(1.0)
        assert router.table is not None and [s.name for s in router.table.slices] == ["llm"]
        assert router.route("k", "llm").node_id in {"t0", "t1"}
        brain.publish(make_table(1, 2, ["a0"], llm=["t0", "t1", "t2"], av=[]))
        assert wait_for(lambda: router.table is not None and router.table.version == 2)
        assert {router.route(k, "llm").node_id for k in KEYS} == {"t0", "t1", "t2"}


def test_a_slice_larger_than_the_c_probe_routes_on_the_python_path() -> None:
    """A fleet of per-GPU entries: 140,000 entries, more than the C probe's bitmap; every key still routes,
    under bounded load too (the probe then runs in Python)."""
    nodes = [
        TableNode(node_id=f"host{i // 8:05d}", endpoint=f"h{i // 8}:8000", weight=1.0, gpu=i % 8)
        for i in range(140_000)
    ]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="av", nodes=nodes)])
    router = Router.from_table(table, settings=Settings(max_ring_points=150_000))
    group = router._snapshot.routes["av"].group  # type: ignore[union-attr]
    assert len(group.ring.points) <= 150_000 + len(nodes) and len(group.entries) == 140_000
    leases = [router.request(f"key-{i}", "av") for i in range(300)]
    for lease in leases:
        lease.begin()  # in flight: the bound comes into play for the next ones
    assert all(lease.endpoint.gpu is not None for lease in leases)
    assert all(router.route(f"key-{i}", "av").gpu is not None for i in range(300))
    for lease in leases:
        lease.end()
