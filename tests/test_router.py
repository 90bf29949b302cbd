"""The router against real ZeroMQ brains on loopback: snapshots, following, fail-static, hostile input."""

from __future__ import annotations

import argparse
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

from prismlb.router import Endpoint, NoRouteError, Router, add_parser
from prismlb.wire import BrainAddress, RejectCounter, RoutingTable, SliceTable, TableNode, TablePublisher, encode

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


def wait_until(predicate: Callable[[], bool], timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


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


def test_late_joiner_gets_the_table_by_snapshot_then_follows_updates(brains: Callable[[], Brain]) -> None:
    brain = brains()
    brain.publish(make_table(1, 1, ["a0", "a1", "a2"]))
    with Router.connect(brain.address) as router:
        assert router.wait_for_table(1.0)
        assert router.table is not None and router.table.order == (1, 1)
        assert brain.publisher.snapshots_served >= 1
        assert router.route("k").node_id in {"a0", "a1", "a2"}

        brain.publish(make_table(1, 2, ["b0", "b1"]))
        brain.publish(make_table(1, 3, ["c0", "c1", "c2", "c3"]))
        assert wait_until(lambda: router.table is not None and router.table.version == 3)
        assert {router.route(k).node_id for k in KEYS} == {"c0", "c1", "c2", "c3"}
        endpoint = router.route("k")
        assert endpoint == Endpoint(endpoint.node_id, f"{endpoint.node_id}.pool:8000")


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
        time.sleep(0.3)
        later = router.last_heard_age_s
        assert later is not None and later >= heard + 0.25
        assert router.table_age_s is not None and router.table_age_s >= age + 0.25
        assert [router.route(k) for k in KEYS] == before
        assert router.table is not None and router.table.order == (4, 9)


def test_follows_the_highest_epoch_and_version_across_brains(brains: Callable[[], Brain]) -> None:
    old, new = brains(), brains()
    old.publish(make_table(1, 5, ["old0", "old1"]))
    new.publish(make_table(2, 1, ["new0", "new1"]))
    with Router.connect([old.address, new.address]) as router:
        assert wait_until(lambda: router.table is not None and router.table.order == (2, 1))
        old.publish(make_table(1, 6, ["old0", "old1"]))
        time.sleep(0.3)
        assert router.table is not None and router.table.order == (2, 1)
        assert {router.route(k).node_id for k in KEYS} == {"new0", "new1"}

        new.publish(make_table(2, 2, ["new0", "new1", "new2"]))
        assert wait_until(lambda: router.table is not None and router.table.order == (2, 2))
        old.publish(make_table(3, 0, ["old0"]))  # the other brain restarted with a newer epoch
        assert wait_until(lambda: router.table is not None and router.table.order == (3, 0))
        assert {router.route(k).node_id for k in KEYS} == {"old0"}


def _invalid_weight_table() -> bytes:
    table = msgspec.to_builtins(make_table(99, 0, ["evil"]))
    table["slices"][0]["nodes"][0]["weight"] = 5.0
    return msgspec.msgpack.encode(table)


def test_hostile_frames_are_counted_and_routing_goes_on(brains: Callable[[], Brain]) -> None:
    brain = brains()
    brain.publish(make_table(1, 1, ["a0", "a1"]))
    hostile_updates, unbound_snapshot = free_tcp_endpoints(2)
    ctx = zmq.Context()
    hostile = ctx.socket(zmq.PUB)
    hostile.linger = 0
    hostile.bind(hostile_updates)
    garbage = [
        [b"prism.table"],
        [b"prism.table", b"1", b"\xc1 not msgpack"],
        [b"prism.table", b"7", encode(make_table(99, 0, ["evil"]))[2]],
        [b"prism.node", b"1", b"\x80"],
        [b"prism.table", b"1", _invalid_weight_table()],
    ]
    kinds = {"frames", "malformed", "schema_version", "unknown_kind", "invalid_field"}
    registry = CollectorRegistry()
    router = Router.connect([brain.address, BrainAddress(hostile_updates, unbound_snapshot)], registry=registry)
    try:
        assert router.wait_for_table(1.0)
        deadline = time.monotonic() + 3.0
        while not kinds <= set(router.rejects.counts()) and time.monotonic() < deadline:
            for frames in garbage:
                hostile.send_multipart(frames)
            assert router.route("k").node_id in {"a0", "a1"}
            time.sleep(0.02)
        assert set(router.rejects.counts()) == kinds
        assert registry.get_sample_value("prism_rejected_messages_total", {"receiver": "router", "kind": "frames"})

        # A table that decodes but cannot be routed on (a node listed twice) is counted, not applied.
        time.sleep(0.1)
        invalid_before = router.rejects.counts()["invalid_field"]
        duplicated = encode(make_table(1, 2, ["a0", "a0"]))
        deadline = time.monotonic() + 2.0
        while router.rejects.counts()["invalid_field"] == invalid_before and time.monotonic() < deadline:
            hostile.send_multipart(duplicated)
            time.sleep(0.02)
        assert router.rejects.counts()["invalid_field"] == invalid_before + 1
        assert router.table is not None and router.table.order == (1, 1)

        brain.publish(make_table(1, 3, ["b0", "b1"]))
        assert wait_until(lambda: router.table is not None and router.table.order == (1, 3))
        assert {router.route(k).node_id for k in KEYS} == {"b0", "b1"}
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


def test_exports_the_table_in_use_as_gauges() -> None:
    registry = CollectorRegistry()
    router = Router(registry=registry)
    assert registry.get_sample_value("prism_router_table_version") is None
    router.apply(make_table(3, 7, ["a0"]))
    assert registry.get_sample_value("prism_router_table_epoch") == 3
    assert registry.get_sample_value("prism_router_table_version") == 7
    age = registry.get_sample_value("prism_router_table_age_seconds")
    assert age is not None and 0 <= age < 5


def test_concurrent_routing_never_sees_a_mixed_table() -> None:
    sets = [[f"a{i}" for i in range(5)], [f"b{i}" for i in range(7)]]
    valid = [{Endpoint(n, f"{n}.pool:8000") for n in ids} for ids in sets]
    router = Router.from_table(make_table(1, 0, sets[0]))
    stop = threading.Event()
    errors: list[BaseException] = []
    routed = [0] * 8

    def reader(index: int) -> None:
        rng = random.Random(index)
        try:
            while not stop.is_set():
                endpoint = router.route(f"key-{rng.randrange(10_000)}")
                if not any(endpoint in group for group in valid):
                    raise AssertionError(f"{endpoint} belongs to no applied table")
                routed[index] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        for version in range(1, 201):
            assert router.apply(make_table(1, version, sets[version % 2]))
            assert {router.route(k).node_id[0] for k in KEYS[:20]} == {"ab"[version % 2]}
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    assert all(count > 0 for count in routed)
    assert router.table is not None and router.table.version == 200


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


def test_cli_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    updates, snapshot = free_tcp_endpoints(2)
    assert _cli(["route", "--updates", updates, "--snapshot", snapshot, "--timeout", "0.2", "k"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"prism route: no routing table from {updates} / {snapshot} within 0.2 s"]
    assert _cli(["route", "--curve-secret", "/nonexistent", "k"]) == 2
    assert "must be given together" in capsys.readouterr().err
