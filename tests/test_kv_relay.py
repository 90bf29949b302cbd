"""The cluster's prefix index: agents' KV changes through the brain's relay into every router's index."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import zmq

from prismlb.agent._kv_events import KvChanges
from prismlb.agent._kv_stream import KvStream
from prismlb.brain._kv_relay import REORDER_S, KvRelay
from prismlb.router import Router
from prismlb.wire import (
    MAX_TABLE_BYTES,
    BrainAddress,
    KvBlocks,
    KvDelta,
    KvFollower,
    KvSnapshotEnd,
    RejectCounter,
    RoutingTable,
    SliceTable,
    TableNode,
    TablePublisher,
    VectorReceiver,
    VectorSender,
    decode,
    split_kv_changes,
)

from .conftest import free_port, idle_vector, running_brain, wait_for

LOG = logging.getLogger("test")


def blocks(
    node: str, seq: int, stored: Sequence[int] = (), removed: Sequence[int] = (), reset: bool = False
) -> KvBlocks:
    return KvBlocks(
        node_id=node, seq=seq, reset=reset, block_size_tokens=16, stored=list(stored), removed=list(removed)
    )


# --- KvRelay -------------------------------------------------------------------------------------------------


def test_relay_forwards_changes_in_order_with_its_own_numbers() -> None:
    relay = KvRelay("brain-a", 3)
    out = relay.accept([blocks("n1", 0, [1, 2, 3], reset=True), blocks("n1", 1, [4], [1])], now=0.0)
    assert [(d.seq, d.reset, d.stored, d.removed) for d in out] == [(1, True, [1, 2, 3], []), (2, False, [4], [1])]
    assert {d.brain_id for d in out} == {"brain-a"} and {d.epoch for d in out} == {3}
    assert relay.blocks("n1") == {2, 3, 4} and relay.total == 3
    assert relay.accept([blocks("n1", 2, [2], [9])], now=0.0) == []  # nothing changed: nothing to publish
    assert relay.counts["messages"] == 3


def test_relay_gap_empties_the_node_until_its_next_reset() -> None:
    relay = KvRelay("b", 0)
    relay.accept([blocks("n1", 0, [1, 2], reset=True)], now=0.0)
    assert relay.accept([blocks("n1", 2, [5])], now=0.0) == []  # held: seq 1 may still come
    assert relay.retain({"n1"}, now=REORDER_S - 0.1) == []
    out = relay.retain({"n1"}, now=REORDER_S + 0.1)  # seq 1 never came
    assert [(d.node_id, d.reset, d.stored) for d in out] == [("n1", True, [])]
    assert relay.counts["lost"] == 1 and relay.blocks("n1") == frozenset()
    assert relay.accept([blocks("n1", 3, [6])], now=1.0) == []
    assert relay.counts["awaiting_reset"] == 1
    out = relay.accept([blocks("n1", 4, [7, 8], reset=True), blocks("n1", 5, [9])], now=1.0)
    assert [d.reset for d in out] == [True, False] and relay.blocks("n1") == {7, 8, 9}


def test_relay_puts_a_nodes_reordered_messages_back_in_order() -> None:
    relay = KvRelay("b", 0)
    relay.accept([blocks("n1", 0, [1], reset=True)], now=0.0)
    out = relay.accept([blocks("n1", 2, [3]), blocks("n1", 3, [4], [2]), blocks("n1", 1, [2])], now=0.0)
    assert [(d.stored, d.removed) for d in out] == [([2], []), ([3], []), ([4], [2])], "applied in the agent's order"
    assert relay.blocks("n1") == {1, 3, 4} and relay.counts["reordered"] == 2 and relay.counts["lost"] == 0
    assert relay.accept([blocks("n1", 2, [9])], now=0.0) == [] and relay.counts["late"] == 1, "a duplicate is late"
    assert relay.retain({"n1"}, now=10.0) == []


def test_relay_agent_restart_is_seen_when_the_sequence_goes_back() -> None:
    relay = KvRelay("b", 0)
    relay.accept([blocks("n1", 0, [1], reset=True), blocks("n1", 1, [2]), blocks("n1", 2, [3])], now=0.0)
    assert relay.accept([blocks("n1", 0, [7])], now=0.0) == []  # within the reorder window: taken as late
    assert relay.counts["late"] == 1 and relay.blocks("n1") == {1, 2, 3}
    relay.accept([blocks("n1", 0, [1], reset=True), blocks("n1", 1, [2])], now=0.0)  # the restart's own reset
    assert relay.counts["restarts"] == 1 and relay.blocks("n1") == {1, 2}
    relay.accept([blocks("n1", 0, [5], reset=True)], now=0.0)  # restarted again
    assert relay.counts["restarts"] == 2 and relay.blocks("n1") == {5}
    for seq in range(1, 40):
        relay.accept([blocks("n1", seq, [100 + seq])], now=0.0)
    out = relay.accept([blocks("n1", 1, [7])], now=0.0)  # far behind the window: a restart without its reset
    assert relay.counts["restarts"] == 3 and [(d.reset, d.stored) for d in out] == [(True, [])]


def test_relay_drops_nodes_that_left_the_registry_after_their_grace() -> None:
    relay = KvRelay("b", 0, grace_s=10.0)
    relay.accept([blocks("n1", 0, [1], reset=True), blocks("n2", 0, [2], reset=True)], now=0.0)
    assert relay.retain({"n1"}, now=5.0) == []  # n2 may not have sent its first vector yet
    out = relay.retain({"n1"}, now=11.0)
    assert [(d.node_id, d.reset, d.stored) for d in out] == [("n2", True, [])]
    assert relay.blocks("n2") is None and relay.total == 1 and relay.counts["dropped_nodes"] == 1


def test_relay_cap_refuses_and_counts_what_does_not_fit() -> None:
    relay = KvRelay("b", 0, max_blocks=5, max_nodes=2)
    relay.accept([blocks("n1", 0, [1, 2, 3], reset=True)], now=0.0)
    assert relay.accept([blocks("n2", 0, [4, 5, 6], reset=True)], now=0.0) == []
    assert relay.counts["overflow"] == 1 and relay.blocks("n2") is None
    out = relay.accept([blocks("n1", 1, [4, 5, 6])], now=0.0)  # would hold 6: n1's set becomes unknown
    assert relay.counts["overflow"] == 2 and [(d.reset, d.stored) for d in out] == [(True, [])]
    assert relay.total == 0
    relay.accept([blocks("n2", 0, [1], reset=True), blocks("n3", 0, [2], reset=True)], now=0.0)
    assert relay.nodes == 2 and relay.blocks("n3") is None and relay.counts["overflow"] == 3


def test_relay_snapshot_is_every_node_in_parts_then_the_end() -> None:
    relay = KvRelay("b", 7, snapshot_chunk=2)
    relay.accept([blocks("n1", 0, [1, 2, 3], reset=True), blocks("n2", 0, [], reset=True)], now=0.0)
    messages = [decode(m, (KvDelta, KvSnapshotEnd), MAX_TABLE_BYTES) for m in relay.snapshot()]
    *parts, end = messages
    assert isinstance(end, KvSnapshotEnd) and (end.epoch, end.seq, sorted(end.nodes)) == (7, 2, ["n1", "n2"])
    assert all(isinstance(p, KvDelta) and p.seq == 2 for p in parts)
    n1 = [p for p in parts if isinstance(p, KvDelta) and p.node_id == "n1"]
    assert [p.reset for p in n1] == [True, False] and {h for p in n1 for h in p.stored} == {1, 2, 3}
    assert relay.snapshot() is relay.snapshot()  # reused until the next delta


# --- the follower (router side) --------------------------------------------------------------------------------


def delta(
    seq: int, node: str = "n1", stored: Sequence[int] = (), reset: bool = False, epoch: int = 1, size: int = 16
) -> KvDelta:
    return KvDelta(
        brain_id="b", epoch=epoch, seq=seq, node_id=node, reset=reset, stored=list(stored), block_size_tokens=size
    )


def test_follower_buffers_while_it_waits_for_a_snapshot_and_clears_nodes_left_out() -> None:
    applied: list[tuple[str, bool, tuple[int, ...]]] = []
    follower = KvFollower(lambda node, reset, stored, removed, size: applied.append((node, reset, tuple(stored))))
    follower.follow("b")
    assert follower.wants_snapshot
    follower.delta(delta(5, stored=[50]))  # before the snapshot: in it already
    follower.delta(delta(6, stored=[60]))
    follower.snapshot_part(delta(5, node="n1", stored=[1], reset=True))
    follower.snapshot_end(KvSnapshotEnd(brain_id="b", epoch=1, seq=5, nodes=["n1"]))
    assert applied == [("n1", True, (1,)), ("n1", False, (60,))] and not follower.wants_snapshot
    follower.delta(delta(8, stored=[80]))  # 7 lost
    assert follower.wants_snapshot and follower.stats.gaps == 1
    follower.snapshot_end(KvSnapshotEnd(brain_id="b", epoch=1, seq=8, nodes=[]))
    assert applied[-1] == ("n1", True, ())  # gone from the brain's index: emptied here
    follower.delta(delta(9, stored=[90]))
    assert applied[-1] == ("n1", False, (90,)) and follower.next_seq == 10


def test_follower_hands_on_each_deltas_block_size() -> None:
    sizes: list[int | None] = []
    follower = KvFollower(lambda node, reset, stored, removed, size: sizes.append(size))
    follower.follow("b")
    follower.snapshot_part(delta(1, stored=[1], reset=True, size=64))
    follower.snapshot_end(KvSnapshotEnd(brain_id="b", epoch=1, seq=1, nodes=[]))  # leaves n1 out: emptied, no size
    follower.delta(delta(2, node="n2", stored=[2], size=1))
    assert sizes == [64, None, 1]


def test_follower_ignores_other_brains_and_stale_snapshots() -> None:
    applied: list[str] = []
    follower = KvFollower(lambda node, reset, stored, removed, size: applied.append(node))
    follower.follow("b")
    follower.snapshot_end(KvSnapshotEnd(brain_id="other", epoch=1, seq=0, nodes=[]))
    assert follower.wants_snapshot
    follower.snapshot_end(KvSnapshotEnd(brain_id="b", epoch=1, seq=0, nodes=[]))
    follower.snapshot_part(delta(0, reset=True))  # a second answer, after the first: not applied
    follower.delta(KvDelta(brain_id="other", epoch=1, seq=1, node_id="x"))
    assert applied == [] and follower.next_seq == 1


def test_split_marks_the_reset_on_its_first_part_only() -> None:
    parts = split_kv_changes("n1", 10, reset=True, stored=range(5), removed=(), block_size=16, chunk=2)
    assert [(m.seq, m.reset, m.stored) for m in parts] == [(10, True, [0, 1]), (11, False, [2, 3]), (12, False, [4])]
    assert split_kv_changes("n1", 0, reset=False, stored=(), removed=(), block_size=None) == []
    assert len(split_kv_changes("n1", 0, reset=True, stored=(), removed=(), block_size=None)) == 1


# --- end to end over ZeroMQ ------------------------------------------------------------------------------------


class Hub:
    """A brain's KV path as `Brain._loop` wires it: VectorReceiver → KvRelay → TablePublisher, with a table and
    heartbeats so that routers follow it."""

    def __init__(self, ctx: zmq.Context, brain_id: str = "brain-a") -> None:
        self.ingest = f"tcp://127.0.0.1:{free_port()}"
        self.address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
        self.rejects = RejectCounter("hub", LOG)
        self.receiver = VectorReceiver(ctx, self.ingest, self.rejects)
        self.publisher = TablePublisher(ctx, self.address.updates, self.address.snapshot, self.rejects)
        self.relay = KvRelay(brain_id, 1)
        self.publisher.kv_snapshot = self.relay.snapshot
        self.brain_id = brain_id
        self.publisher.publish(self.table(1))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def table(self, version: int) -> RoutingTable:
        """Version `version` of the hub's table: nodes n1 and n2 in one slice."""
        nodes = [TableNode(node_id=n, endpoint=f"http://{n}:8000", weight=1.0) for n in ("n1", "n2")]
        return RoutingTable(
            epoch=1,
            version=version,
            issued_unix_s=time.time(),
            brain_id=self.brain_id,
            slices=[SliceTable(name="llm", nodes=nodes)],
        )

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.receiver.socket, zmq.POLLIN)
        poller.register(self.publisher.snapshot_socket, zmq.POLLIN)
        next_heartbeat = 0.0
        while not self.stop.is_set():
            poller.poll(timeout=50)
            kv: list[KvBlocks] = []
            self.receiver.drain(kv=kv)
            self.publisher.publish_kv(self.relay.accept(kv, time.monotonic()))
            self.publisher.publish_kv(self.relay.retain({"n1", "n2"}, time.monotonic()))
            self.publisher.serve_snapshots()
            if time.monotonic() >= next_heartbeat:
                next_heartbeat = time.monotonic() + 0.5
                self.publisher.heartbeat()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.receiver.close()
        self.publisher.close()


@pytest.fixture
def hub(ctx: zmq.Context) -> Iterator[Hub]:
    h = Hub(ctx)
    yield h
    h.close()


class FakeEngine:
    """`KvEventSubscriber.take_changes` over a set the test changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held: set[int] = set()
        self._changes: dict[int, bool] = {}
        self._reset = True

    def store(self, *hashes: int) -> None:
        with self._lock:
            for h in hashes:
                if h not in self.held:
                    self.held.add(h)
                    self._changes[h] = True

    def remove(self, *hashes: int) -> None:
        with self._lock:
            for h in hashes:
                if h in self.held:
                    self.held.discard(h)
                    self._changes[h] = False

    def take_changes(self, full: bool = False) -> KvChanges:
        with self._lock:
            if self._reset or full:
                out = KvChanges(True, tuple(self.held), (), 16)
            else:
                stored = tuple(h for h, s in self._changes.items() if s)
                out = KvChanges(False, stored, tuple(h for h, s in self._changes.items() if not s), 16)
            self._reset = False
            self._changes.clear()
            return out


def holds(router: Router, node: str, prefix: Sequence[int]) -> bool:
    return router.index.match(list(prefix), time.monotonic()).get(node) == len(prefix)


def test_agent_blocks_reach_routers_and_a_late_router_gets_them_by_snapshot(hub: Hub) -> None:
    engine = FakeEngine()
    engine.store(11, 12)
    stream = KvStream(engine, "n1", [hub.ingest], interval_s=0.005)
    stream.start()
    early = Router.connect(hub.address)
    try:
        assert wait_for(lambda: holds(early, "n1", [11, 12]))
        engine.store(13)
        engine.remove(12)
        assert wait_for(lambda: early.index.match([11, 12], time.monotonic()).get("n1") == 1)
        assert wait_for(lambda: holds(early, "n1", [11, 13]))
        late = Router.connect(hub.address)
        try:
            follower = late._subscriber.kv if late._subscriber is not None else None
            assert follower is not None
            assert wait_for(lambda: follower.stats.snapshots >= 1)  # the index came by snapshot
            assert holds(late, "n1", [11, 13])
        finally:
            late.close()
    finally:
        early.close()
        stream.close()
    assert stream.sent >= 2 and stream.dropped == 0


def test_a_lost_message_empties_the_node_and_its_next_reset_restores_it(ctx: zmq.Context, hub: Hub) -> None:
    router = Router.connect(hub.address)
    sender = VectorSender(ctx, hub.ingest)
    try:
        assert router._subscriber is not None
        assert wait_for(lambda: router._subscriber is not None and router._subscriber.following == "brain-a")
        sender.send(blocks("n1", 0, [1, 2], reset=True))
        assert wait_for(lambda: holds(router, "n1", [1, 2]))
        sender.send(blocks("n1", 2, [3]))  # seq 1 never sent: the brain sees the skip
        assert wait_for(lambda: router.index.size("n1") == 0)
        assert hub.relay.counts["lost"] == 1
        sender.send(blocks("n1", 3, [4]))  # ignored until a reset
        sender.send(blocks("n1", 4, [1, 2, 3], reset=True))
        assert wait_for(lambda: holds(router, "n1", [1, 2, 3]))
        assert router.index.match([4], time.monotonic()) == {}
    finally:
        sender.close()
        router.close()


def test_a_router_that_misses_a_delta_recovers_by_snapshot(hub: Hub) -> None:
    router = Router.connect(hub.address)
    try:
        sub = router._subscriber
        assert sub is not None and sub.kv is not None
        assert wait_for(lambda: sub.kv is not None and sub.kv.stats.snapshots == 1)
        # The brain publishes a delta the router never gets (as a full queue would drop it), then another.
        relay, publisher = hub.relay, hub.publisher
        hub.stop.set()  # the hub's thread owns the relay and the sockets: pause it
        hub.thread.join(timeout=5)
        lost = relay.accept([blocks("n2", 0, [21], reset=True)], time.monotonic())
        assert len(lost) == 1
        publisher.publish_kv(relay.accept([blocks("n2", 1, [22])], time.monotonic()))
        hub.stop.clear()
        hub.thread = threading.Thread(target=hub._run, daemon=True)
        hub.thread.start()
        assert wait_for(lambda: holds(router, "n2", [21, 22]))
        assert sub.kv.stats.gaps == 1 and sub.kv.stats.snapshots == 2
    finally:
        router.close()


def test_routers_without_the_prefix_index_do_not_receive_deltas(hub: Hub) -> None:
    from prismlb.router import Settings

    router = Router.connect(hub.address, settings=Settings(prefix_index=False))
    try:
        assert router.wait_for_table(10)
        assert router._subscriber is not None and router._subscriber.kv is None
        hub.stop.set()  # the hub's thread owns the relay and the sockets: stop it to publish from here
        hub.thread.join(timeout=5)
        hub.publisher.publish_kv(hub.relay.accept([blocks("n1", 0, [1], reset=True)], time.monotonic()))
        # One socket keeps its order: once the router has the table published after the delta, it would have the
        # delta had it subscribed to deltas.
        hub.publisher.publish(hub.table(2))
        assert wait_for(lambda: router.table is not None and router.table.version == 2)
        assert len(router.index) == 0
    finally:
        router.close()


@pytest.mark.parametrize("workers", [0, 2], ids=["direct", "sharded"])
def test_brain_service_relays_kv_blocks_to_a_router(workers: int) -> None:
    with (
        running_brain(ingest_workers=workers) as brain,
        zmq.Context() as ctx,
        VectorSender(ctx, brain.config.ingest) as sender,
        Router.connect(BrainAddress(brain.config.updates, brain.config.snapshot)) as router,
    ):
        vector = idle_vector("n1", "http://n1:8000")
        sender.send(vector)
        assert router.wait_for_table(15)
        sender.send(blocks("n1", 0, [5, 6, 7], reset=True))
        assert wait_for(lambda: holds(router, "n1", [5, 6, 7]))
        sender.send(KvBlocks(node_id="n1", seq=1, removed=[7]))
        assert wait_for(lambda: router.index.match([5, 6, 7], time.monotonic()).get("n1") == 2)
        assert brain.kv.counts["messages"] == 2
        metrics = brain.metrics.get_sample_value("prism_brain_kv_total", {"kind": "deltas"})
        assert metrics == 2


def test_kv_stream_sends_a_reset_soon_after_a_drop_and_periodically(ctx: zmq.Context) -> None:
    engine = FakeEngine()
    engine.store(1, 2)
    stream = KvStream(engine, "n1", ["tcp://127.0.0.1:1"], full_every_s=60.0, context=ctx)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoint)
    full = VectorSender(ctx, f"tcp://127.0.0.1:{free_port()}", hwm=1)  # nobody there: one message fits
    ok = VectorSender(ctx, endpoint)
    try:
        assert stream.step([full], now=0.0) == 1 and stream.resets == 1 and stream.sent == 1
        engine.store(3)
        assert stream.step([full], now=0.1) == 1 and stream.dropped == 1
        engine.store(4)
        stream.step([ok], now=0.2)  # a plain change: the reset waits for RESYNC_S
        assert stream.resets == 1 and stream.seq == 3
        stream.step([ok], now=1.2)
        assert stream.resets == 2
        stream.step([ok], now=30.0)
        assert stream.resets == 2 and stream.seq == 4  # nothing changed, nothing due
        stream.step([ok], now=61.3)
        assert stream.resets == 3 and stream.seq == 5 and stream.sent == 4
    finally:
        full.close()
        ok.close()
        pull.close()
        stream.close()
