"""Codec round trips, every reject kind, and fuzzed frames against both receivers."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq

from prismlb.wire import (
    KINDS,
    MAX_KV_BLOCKS,
    MAX_TABLE_BYTES,
    MAX_VECTOR_BYTES,
    BrainAddress,
    FrameCountError,
    Heartbeat,
    InvalidFieldError,
    KvBlocks,
    KvDelta,
    KvSnapshotEnd,
    MalformedError,
    NodeMetrics,
    NodeVector,
    NonFiniteError,
    OversizedError,
    RejectCounter,
    RoutingTable,
    SchemaVersionError,
    SliceTable,
    SliceUpdate,
    SnapshotRequest,
    TableAssembler,
    TableEncoder,
    TableHead,
    TableNode,
    TablePublisher,
    TableSubscriber,
    UnknownKindError,
    VectorReceiver,
    VectorSender,
    decode,
    encode,
    split_kv_changes,
)
from prismlb.wire._codec import topic_prefix

from .conftest import free_port, wait_for

LOG = logging.getLogger("test")


def vector(seq: int = 1, **metrics: float) -> NodeVector:
    return NodeVector(
        node_id="node-a",
        host="h",
        endpoint="http://127.0.0.1:8000",
        labels={"gpu": "a100"},
        seq=seq,
        sample_time_unix_s=time.time(),
        period_s=1.0,
        metrics=NodeMetrics(**metrics),
    )


def raw_vector(**overrides: object) -> bytes:
    fields: dict[str, object] = {
        "node_id": "node-a",
        "host": "h",
        "endpoint": "e",
        "seq": 1,
        "sample_time_unix_s": 1.0,
        "period_s": 1.0,
        "metrics": {},
    }
    fields.update(overrides)
    return msgspec.msgpack.encode(fields)


def test_round_trip_keeps_absent_metrics_absent() -> None:
    v = vector(cpu_util_ratio=0.25, mem_used_bytes=10)
    frames = encode(v)
    assert frames[0] == b"prism.node" and frames[1] == b"1"
    assert b"kv_cache_miss_ratio" not in frames[2]
    back = decode(frames, (NodeVector,), MAX_VECTOR_BYTES)
    assert back == v
    assert back.metrics.kv_cache_miss_ratio is None


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([b"prism.node", b"1"], FrameCountError),
        ([b"prism.nope", b"1", raw_vector()], UnknownKindError),
        ([b"prism.table", b"1", raw_vector()], UnknownKindError),
        ([b"prism.node", b"2", raw_vector()], SchemaVersionError),
        ([b"prism.node", b"1", b"\xc1garbage"], MalformedError),
        ([b"prism.node", b"1", raw_vector()[:-3]], MalformedError),
        ([b"prism.node", b"1", raw_vector(seq=-1)], InvalidFieldError),
        ([b"prism.node", b"1", raw_vector(seq="1")], InvalidFieldError),
        ([b"prism.node", b"1", raw_vector(node_id="bad id!")], InvalidFieldError),
        ([b"prism.node", b"1", raw_vector(metrics={"mem_used_bytes": -5})], InvalidFieldError),
        ([b"prism.node", b"1", raw_vector(metrics={"cpu_util_ratio": 1.5})], InvalidFieldError),
        ([b"prism.node", b"1", raw_vector(metrics={"cpu_preproc_p95_ms": float("inf")})], NonFiniteError),
        ([b"prism.node", b"1", raw_vector(sample_time_unix_s=float("inf"))], NonFiniteError),
        ([b"prism.node", b"1", raw_vector(metrics={"kv_cache_miss_ratio": float("nan")})], NonFiniteError),
        # bounded on the wire so the brain's arithmetic cannot overflow: an engine's absurd count, a span's latency
        ([b"prism.node", b"1", raw_vector(metrics={"requests_running": 2 * 10**12})], InvalidFieldError),
        ([b"prism.node", b"1", raw_vector(latency={"llm": {"requests": 1, "ttft_p99_ms": 1e200}})], InvalidFieldError),
        ([b"prism.node", b"1", raw_vector(latency={"llm": {"requests": 1, "ttft_p99_ms": -5.0}})], InvalidFieldError),
        ([b"prism.node", b"1", b"\x00" * (MAX_VECTOR_BYTES + 1)], OversizedError),
    ],
)
def test_decode_rejects_with_typed_error(frames: list[bytes], error: type[Exception]) -> None:
    with pytest.raises(error):
        decode(frames, (NodeVector,), MAX_VECTOR_BYTES)


def test_nan_float_without_range_is_non_finite() -> None:
    payload = msgspec.msgpack.encode({"epoch": 1, "version": 1, "issued_unix_s": float("nan")})
    with pytest.raises((NonFiniteError, InvalidFieldError)):
        decode([b"prism.heartbeat", b"1", payload], (Heartbeat,), 1000)


def test_reject_counter_logs_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    counter = RejectCounter("brain", LOG)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            counter.record(MalformedError("x"))
        counter.record(OversizedError("y"))
    assert counter.counts() == {"malformed": 5, "oversized": 1}
    assert len(caplog.records) == 2


def fuzz_frames(rng: random.Random) -> list[bytes]:
    """Random, truncated or corrupted versions of valid messages."""
    valid = encode(vector(seq=rng.randrange(100), cpu_util_ratio=0.5))
    choice = rng.randrange(5)
    if choice == 0:
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 5))]
    if choice == 1:
        return valid[: rng.randrange(0, 3)] or [b""]
    if choice == 2:
        return [valid[0], valid[1], valid[2][: rng.randrange(len(valid[2]))]]
    if choice == 3:
        body = bytearray(valid[2])
        body[rng.randrange(len(body))] = rng.randrange(256)
        return [valid[0], valid[1], bytes(body)] if bytes(body) != valid[2] else [b"x"]
    return [valid[0], rng.choice([b"0", b"99", b""]), valid[2]]


def test_vector_receiver_survives_fuzz_and_counts_everything(ctx: zmq.Context, endpoint: str) -> None:
    rejects = RejectCounter("brain", LOG)
    receiver = VectorReceiver(ctx, endpoint, rejects)
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    rng = random.Random(7)
    sent_bad = 0
    accepted_by_codec = 0
    for _ in range(500):
        frames = fuzz_frames(rng)
        try:
            decode(frames, (NodeVector,), MAX_VECTOR_BYTES)
            accepted_by_codec += 1
        except Exception:
            sent_bad += 1
        push.send_multipart(frames)
    push.send_multipart(encode(vector(seq=1000)))
    got: list[NodeVector] = []

    def drained() -> bool:
        receiver.socket.poll(100)
        got.extend(receiver.drain())
        return rejects.total >= sent_bad and len(got) >= accepted_by_codec + 1

    wait_for(drained, 5)
    assert rejects.total == sent_bad
    assert len(got) == accepted_by_codec + 1
    assert got[-1].seq == 1000
    receiver.close()
    push.close()


def test_oversized_frames_are_dropped_by_the_socket(ctx: zmq.Context, endpoint: str) -> None:
    receiver = VectorReceiver(ctx, endpoint, RejectCounter("brain", LOG))
    sender = VectorSender(ctx, endpoint)
    push = ctx.socket(zmq.PUSH)
    monitor = push.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    push.connect(endpoint)
    # Beyond the multiple of the limit the receiver's socket takes (to count it), libzmq cuts the connection.
    push.send_multipart([b"prism.node", b"1", b"\x00" * ((VectorReceiver.OVERSIZE_COUNTED + 1) * MAX_VECTOR_BYTES)])
    assert monitor.poll(5000), "the receiver kept the connection that sent the oversized frame"
    push.disable_monitor()
    monitor.close(linger=0)
    assert sender.send(vector(seq=5))
    got: list[NodeVector] = []

    def drained() -> bool:
        receiver.socket.poll(100)
        got.extend(receiver.drain())
        return bool(got)

    wait_for(drained, 5)
    assert [v.seq for v in got] == [5]
    for closable in (receiver, sender, push):
        closable.close()


def table(epoch: int, version: int, nodes: tuple[str, ...] = ("a", "b")) -> RoutingTable:
    return RoutingTable(
        epoch=epoch,
        version=version,
        issued_unix_s=time.time(),
        slices=[
            SliceTable(name="default", nodes=[TableNode(node_id=n, endpoint=f"http://{n}", weight=1.0) for n in nodes])
        ],
    )


def brain_and_router(
    ctx: zmq.Context, first: RoutingTable
) -> tuple[TablePublisher, TableSubscriber, list[RoutingTable]]:
    """A brain that has published `first`, a router subscribed to it (not started), and the tables it hands on."""
    address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    publisher = TablePublisher(ctx, address.updates, address.snapshot, RejectCounter("brain", LOG))
    publisher.publish(first)
    got: list[RoutingTable] = []
    return (
        publisher,
        TableSubscriber(ctx, [address], lambda t: got.append(t) is None, RejectCounter("router", LOG)),
        got,
    )


def test_table_subscriber_survives_fuzz_and_counts_everything(ctx: zmq.Context) -> None:
    updates = f"tcp://127.0.0.1:{free_port()}"
    snapshot = f"tcp://127.0.0.1:{free_port()}"
    rejects = RejectCounter("router", LOG)
    got: list[RoutingTable] = []
    pub = ctx.socket(zmq.PUB)
    pub.bind(updates)
    subscriber = TableSubscriber(ctx, [BrainAddress(updates, snapshot)], lambda t: got.append(t) is None, rejects)
    subscriber.start()
    joined = Heartbeat(epoch=0, version=0, issued_unix_s=time.time())  # a brain at no table: nothing to take

    def heard() -> bool:  # a SUB socket misses what is published before it joins
        pub.send_multipart(encode(joined))
        return subscriber.last_heard_monotonic is not None

    wait_for(heard, what="the subscriber to join the PUB socket")
    rng = random.Random(11)
    bad = 0
    for i in range(300):
        frames = fuzz_frames(rng)
        kind = (TableHead, SliceUpdate, Heartbeat)[i % 3]
        frames[0] = KINDS[kind] + (b"/default/" if kind is SliceUpdate else b"")
        try:
            decode(frames, (kind,), 1 << 24)
        except Exception:
            bad += 1
            pub.send_multipart(frames)
    for frames in TableEncoder().update(table(1, 1)):
        pub.send_multipart(frames)
    wait_for(lambda: rejects.total >= bad and bool(got), 5)
    subscriber.stop()
    pub.close()
    assert rejects.total == bad
    assert [t.order for t in got] == [(1, 1)]


def named(t: RoutingTable, brain_id: str, priority: int = 0) -> RoutingTable:
    return msgspec.structs.replace(t, brain_id=brain_id, priority=priority)


def test_clone_pattern_late_joiner_follows_the_leading_brain(ctx: zmq.Context) -> None:
    addresses = [BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for _ in range(2)]
    publishers = [TablePublisher(ctx, a.updates, a.snapshot, RejectCounter("brain", LOG)) for a in addresses]
    publishers[0].publish(named(table(5, 3, ("old",)), "brain-b"))  # leads: the higher brain id
    publishers[1].publish(named(table(6, 1, ("new",)), "brain-a"))
    got: list[RoutingTable] = []
    subscriber = TableSubscriber(ctx, addresses, lambda t: got.append(t) is None, RejectCounter("router", LOG))
    subscriber.start()

    def served(order: tuple[int, int]) -> Callable[[], bool]:
        """Both brains serving as live brains do (snapshots answered, heartbeats sent) until `order` is followed:
        a snapshot asked again on a loaded host is answered, not left to hold the updates back."""

        def check() -> bool:
            for p in publishers:
                p.serve_snapshots()
                p.heartbeat()
            return subscriber.current_order == order

        return check

    wait_for(served((5, 3)), 10, "the leader's table")
    assert subscriber.current_order == (5, 3) and subscriber.following == "brain-b"
    publishers[1].publish(named(table(6, 2, ("new", "newer")), "brain-a"))
    publishers[0].publish(named(table(5, 4, ("old", "older")), "brain-b"))
    wait_for(served((5, 4)), 10, "the leader's next table")
    subscriber.stop()
    orders = [(t.brain_id, t.order) for t in got]
    # Before it has heard the leader, a late joiner may take the other brain's table (it is all it knows);
    # from the leader's first table on, only the leader's, in order.
    led = orders[orders.index(("brain-b", (5, 3))) :]
    assert led == [("brain-b", (5, 3)), ("brain-b", (5, 4))], "only the leader's tables, in order"
    assert all(order == ("brain-a", (6, 1)) for order in orders[: len(orders) - len(led)]), orders
    for p in publishers:
        p.close()


def test_a_snapshot_answer_read_after_a_newer_table_does_not_take_the_router_back(ctx: zmq.Context) -> None:
    # Driven by hand, on this thread, so that the order the sockets are read in is the test's, not the loop's.
    publisher, subscriber, got = brain_and_router(ctx, table(5, 3))
    sub, dealer = subscriber.open()

    def answered() -> bool:
        subscriber.tick(time.monotonic())
        publisher.serve_snapshots()
        return dealer.poll(50) != 0

    def read_answer() -> bool:
        if dealer.poll(50):
            subscriber.readable(dealer)
        return subscriber.current_order == (5, 3)

    wait_for(answered, 3)
    wait_for(read_answer, 3)
    wait_for(lambda: (publisher.heartbeat(), sub.poll(50))[1] != 0, 3, what="the SUB socket to join")
    subscriber.readable(sub)
    subscriber._ask_all()  # asked again (as after a gap), and answered with (5, 3) ...
    wait_for(answered, 3)
    publisher.publish(table(5, 4, ("a", "b", "c")))  # ... but version 4 is read first

    def read_update() -> bool:
        if sub.poll(50):
            subscriber.readable(sub)
        return subscriber.current_order == (5, 4)

    wait_for(read_update, 3)
    subscriber.readable(dealer)  # the older answer: not a restart
    assert subscriber.current_order == (5, 4)
    assert [t.order for t in got] == [(5, 3), (5, 4)]
    subscriber.close()
    publisher.close()


def test_a_brain_restarted_without_its_state_is_followed_from_its_first_table(ctx: zmq.Context) -> None:
    publisher, subscriber, got = brain_and_router(ctx, table(1, 7))
    subscriber.start()

    def following(p: TablePublisher, order: tuple[int, int]) -> Callable[[], bool]:
        def check() -> bool:
            p.heartbeat()
            p.serve_snapshots()
            return subscriber.current_order == order

        return check

    wait_for(following(publisher, (1, 7)), what="the first table")
    publisher._encoder = TableEncoder()  # the brain restarted on the same addresses, its tables' state lost ...
    publisher.publish(table(1, 1, ("c",)))  # ... and its epoch too: no state directory kept it
    wait_for(following(publisher, (1, 1)), what="the restarted brain's first table")
    subscriber.stop()
    publisher.close()
    assert [t.order for t in got] == [(1, 7), (1, 1)]
    assert [n.node_id for n in got[-1].slices[0].nodes] == ["c"]


def test_heartbeat_ahead_of_us_triggers_a_new_snapshot(ctx: zmq.Context) -> None:
    publisher, subscriber, got = brain_and_router(ctx, table(1, 1))
    subscriber.start()

    def caught_up() -> bool:
        if subscriber.current_order == (1, 2):
            return True
        if subscriber.current_order == (1, 1) and publisher.current is not None and publisher.current.version == 1:
            # Version 2 goes out while the PUB socket is cut off (as if dropped at a full queue): only the
            # heartbeat tells the subscriber it is behind, and it must fetch the snapshot.
            publisher._encoder.update(table(1, 2, ("a", "b", "c")))  # made, never sent
            publisher.current = table(1, 2, ("a", "b", "c"))
        publisher.heartbeat()
        publisher.serve_snapshots()
        return False

    wait_for(caught_up, 3)
    subscriber.stop()
    assert [t.order for t in got] == [(1, 1), (1, 2)]
    assert [len(t.slices[0].nodes) for t in got] == [2, 3]
    publisher.close()


def test_deltas_carry_only_what_changed_and_rebuild_the_same_table() -> None:
    encoder = TableEncoder(chunk_entries=3)
    assembler = TableAssembler()
    nodes = [TableNode(node_id=f"n{i}", endpoint=f"http://n{i}", weight=1.0) for i in range(7)]
    first = RoutingTable(
        epoch=2,
        version=1,
        issued_unix_s=1.0,
        slices=[SliceTable(name="llm", nodes=nodes), SliceTable(name="vlm", nodes=nodes[:2])],
    )
    messages = encoder.update(first)
    assert len(messages) == 3 + 1 + 1, "7 entries in parts of 3, one part for vlm, the head"
    built = None
    for frames in messages:
        msg = decode(frames, (SliceUpdate, TableHead), 1 << 24)
        built = assembler.slice_update(msg) if isinstance(msg, SliceUpdate) else assembler.head(msg)
    assert built == first
    changed = [*nodes[:3], msgspec.structs.replace(nodes[3], weight=0.5), *nodes[5:]]  # n3 reweighed, n4 gone
    second = msgspec.structs.replace(first, version=2, slices=[SliceTable(name="llm", nodes=changed), first.slices[1]])
    messages = encoder.update(second)
    updates = [decode(m, (SliceUpdate, TableHead), 1 << 24) for m in messages]
    assert len(updates) == 2 and updates[0].slice == "llm" and updates[0].base_version == 1
    assert [n.node_id for n in updates[0].upserts] == ["n3"] and [r.node_id for r in updates[0].removes] == ["n4"]
    assert sum(len(m[2]) for m in messages) < sum(len(m[2]) for m in encoder.snapshot(None)) / 2
    assembler.slice_update(updates[0])
    assert assembler.head(updates[1]) == second
    # A router that missed an update cannot complete the next head: a gap, then a snapshot repairs it.
    late = TableAssembler(wanted=["llm"])
    assert late.head(updates[1]) is None and late.gaps == 1
    repaired = None
    for frames in encoder.snapshot(["llm"]):
        msg = decode(frames, (SliceUpdate, TableHead), 1 << 24)
        repaired = late.slice_update(msg) if isinstance(msg, SliceUpdate) else late.head(msg)
    assert repaired is not None and [s.name for s in repaired.slices] == ["llm"]
    assert repaired.slices[0] == second.slices[0]


def test_a_snapshot_answered_after_the_stream_moved_on_is_dropped_until_the_brain_goes_back() -> None:
    """A snapshot asked for at version 3 and read after the stream's update to 4 would set the copy back to 3, and
    the stream's next head would find a gap: it is dropped. After the brain goes back (restarted without its state,
    versions starting again) its lower versions are taken."""
    encoder, assembler = TableEncoder(), TableAssembler()

    def feed(frames: list[list[bytes]], *, snapshot: bool = False) -> RoutingTable | None:
        built = None
        for message in frames:
            msg = decode(message, (SliceUpdate, TableHead), 1 << 24)
            if isinstance(msg, SliceUpdate):
                assembler.slice_update(msg, snapshot=snapshot)
            else:
                built = assembler.head(msg)
        return built

    third, fourth, again = table(1, 3, ("a",)), table(1, 4, ("a", "b")), table(1, 1, ("c",))
    assert feed(encoder.update(third)) == third
    late = encoder.snapshot(None)[:-1]  # its slice parts, the head left out
    *parts, head = encoder.update(fourth)
    feed(parts)
    feed(late, snapshot=True)
    assert feed([head]) == fourth and assembler.gaps == 0
    restarted = TableEncoder()
    restarted.update(again)
    assert feed(restarted.snapshot(None), snapshot=True) is None, "older than the copy: dropped"
    assembler.forget_after(again.order)
    assert feed(restarted.snapshot(None), snapshot=True) == again


def test_a_table_the_callback_refuses_is_not_taken(ctx: zmq.Context) -> None:
    address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    publisher = TablePublisher(ctx, address.updates, address.snapshot, RejectCounter("brain", LOG))
    publisher.publish(table(1, 5))
    calls: list[tuple[int, int]] = []

    def refuse_then_crash(t: RoutingTable) -> bool:
        calls.append(t.order)
        if len(calls) == 1:
            return False
        raise RuntimeError("callback bug")

    subscriber = TableSubscriber(ctx, [address], refuse_then_crash, RejectCounter("router", LOG))
    subscriber.start()

    def asked_again() -> bool:
        publisher.heartbeat()  # each heartbeat shows the subscriber it is still behind
        publisher.serve_snapshots()
        return len(calls) >= 3

    wait_for(asked_again, 3)
    subscriber.stop()
    publisher.close()
    assert subscriber.current_order == (-1, -1)
    assert len(calls) >= 3, (
        "a refused table is asked for again on the next heartbeat; a crashing callback does not stop the thread"
    )


def test_publisher_refuses_a_table_routers_would_reject(ctx: zmq.Context) -> None:
    publisher = TablePublisher(
        ctx, f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", RejectCounter("b", LOG)
    )
    bad = RoutingTable(
        epoch=1,
        version=1,
        issued_unix_s=time.time(),
        slices=[SliceTable(name="default", nodes=[TableNode(node_id="bad id!", endpoint="e", weight=7.0)])],
    )
    with pytest.raises(InvalidFieldError):
        publisher.publish(bad)
    assert publisher.current is None
    publisher.close()


@pytest.mark.parametrize(
    ("signature", "expected"),
    [
        ("text", ("llm", True)),
        ("TEXT", ("llm", True)),
        ("image+text", ("vlm", True)),
        ("text + Image", ("vlm", True)),
        ("audio+video", ("av", True)),
        ("video", ("av", True)),
        ("speech,text", ("av", True)),
        ("rag+text", ("rag", True)),
        ("retrieval+image+text", ("rag", True)),
        ("", ("llm", False)),
        (None, ("llm", False)),
        ("hologram+text", ("llm", False)),
        ("+++", ("llm", False)),
        ("text" * 100, ("llm", False)),
    ],
)
def test_modality_signature_grammar(signature: str | None, expected: tuple[str, bool]) -> None:
    from prismlb.semantics import parse_signature

    assert parse_signature(signature) == expected


def test_vector_with_gpus_latency_and_kv_round_trips() -> None:
    from prismlb.wire import GpuState, KvSummary, ModalityLatency

    v = msgspec.structs.replace(
        vector(seq=3, gpu_count=1, kv_cache_usage_ratio=0.4),
        latency={"llm": ModalityLatency(requests=10, ttft_p99_ms=120.0)},
        gpus=[GpuState(index=0, uuid="GPU-1", mem_used_bytes=1, mem_total_bytes=2, numa_node=0, nvlink_peers=[1, 2])],
        kv=KvSummary(blocks=3, bloom=b"\x00" * 64, bloom_hashes=4),
    )
    assert decode(encode(v), (NodeVector,), MAX_VECTOR_BYTES) == v
    bad = msgspec.msgpack.encode(
        {**msgspec.to_builtins(v, builtin_types=(bytes,)), "latency": {"llm": {"requests": 1, "ttft_p99_ms": -1.0}}}
    )
    with pytest.raises(InvalidFieldError):
        decode([b"prism.node", b"1", bad], (NodeVector,), MAX_VECTOR_BYTES)


def test_subscribers_on_one_context_share_one_thread_and_release_the_context() -> None:
    ctx = zmq.Context()
    address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    publisher = TablePublisher(ctx, address.updates, address.snapshot, RejectCounter("brain", LOG))
    publisher.publish(table(1, 1))
    got: dict[int, list[tuple[int, int]]] = {i: [] for i in range(5)}

    def loops() -> int:
        return sum(t.name == "prism-table-subscribers" for t in threading.enumerate())

    loops_before = loops()
    subscribers = [
        TableSubscriber(ctx, [address], lambda t, i=i: got[i].append(t.order) is None, RejectCounter("r", LOG))
        for i in range(5)
    ]
    for s in subscribers:
        s.start()
    assert loops() == loops_before + 1  # one loop thread for all five

    def served() -> bool:
        publisher.serve_snapshots()
        return all(got.values())

    wait_for(served, 3)
    subscribers[0].stop()  # one leaves; the others go on receiving
    publisher.publish(table(1, 2))
    wait_for(lambda: all(got[i][-1:] == [(1, 2)] for i in range(1, 5)), 3)
    assert got[0] == [(1, 1)] and all(got[i] == [(1, 1), (1, 2)] for i in range(1, 5))
    for s in subscribers[1:]:
        s.stop()
    publisher.close()
    ended = threading.Thread(target=ctx.term, daemon=True)  # the loop closed its sockets: term() returns
    ended.start()
    ended.join(timeout=5)
    assert not ended.is_alive()
    assert loops() == loops_before


def test_a_table_over_the_frame_limit_is_published_in_parts() -> None:
    """300 hosts of 64 GPUs with the longest labels the wire allows: one message would pass the 16 MiB limit
    (the brain used to raise and exit); in slice updates of 20,000 entries it goes out and reassembles."""
    nodes = [
        TableNode(
            node_id=f"host-{h:03d}-" + "n" * 110,
            endpoint="http://" + "e" * 240 + f":{8000 + g}",
            weight=1.0,
            zone="z" * 256,
            model_version="m" * 256,
            gpu=g,
            numa_node=g // 32,
        )
        for h in range(300)
        for g in range(64)
    ]
    big = RoutingTable(epoch=1, version=1, issued_unix_s=1.0, slices=[SliceTable(name="av", nodes=nodes)])
    assert len(encode(big)[2]) > MAX_TABLE_BYTES
    publisher_side = TableEncoder()
    messages = publisher_side.update(big)
    assert len(messages) == 3, "one part would pass the limit: two parts, then the head"
    assert all(len(m[2]) <= MAX_TABLE_BYTES for m in messages)
    assembler = TableAssembler()
    for frames in messages[:-1]:
        assembler.slice_update(decode(frames, (SliceUpdate,), MAX_TABLE_BYTES))
    assert assembler.head(decode(messages[-1], (TableHead,), MAX_TABLE_BYTES)) == big


# --- the prefix index's messages -------------------------------------------------------------------------------


def test_kv_messages_round_trip_with_full_64_bit_hashes() -> None:
    top = 2**64 - 1
    messages = [
        KvBlocks(node_id="n1", seq=3, reset=True, block_size_tokens=16, stored=[0, top], removed=[]),
        KvDelta(brain_id="b", epoch=1, seq=9, node_id="n1", stored=[top], removed=[1]),
        KvSnapshotEnd(brain_id="b", epoch=1, seq=9, nodes=["n1"]),
        SnapshotRequest(kv=True),
    ]
    for message in messages:
        assert decode(encode(message), (type(message),), MAX_TABLE_BYTES) == message
    assert topic_prefix(KvDelta) == KINDS[KvDelta] and not KINDS[KvDelta].startswith(KINDS[SliceUpdate])


@pytest.mark.parametrize(
    "overrides",
    [
        {"stored": [-1]},  # hashes are unsigned
        {"removed": [1.5]},  # and ints
        {"stored": [float("nan")]},
        {"stored": ["1"]},
        {"seq": -1},
        {"node_id": ""},
        {"stored": list(range(MAX_KV_BLOCKS + 1))},
    ],
)
def test_kv_blocks_out_of_bounds_are_refused(overrides: dict[str, object]) -> None:
    fields: dict[str, object] = {"node_id": "n1", "seq": 0, "stored": [1]}
    fields.update(overrides)
    frames = [KINDS[KvBlocks], b"1", msgspec.msgpack.encode(fields)]
    with pytest.raises((InvalidFieldError, NonFiniteError)):
        decode(frames, (KvBlocks,), 10 * MAX_VECTOR_BYTES)


def test_a_full_kv_blocks_fits_the_vector_limit_and_a_larger_one_does_not() -> None:
    full = split_kv_changes("n" * 128, 2**53, reset=True, stored=[2**64 - 1] * MAX_KV_BLOCKS, removed=(), block_size=16)
    assert len(full) == 1
    decode(encode(full[0]), (KvBlocks,), MAX_VECTOR_BYTES)
    both = split_kv_changes("n1", 0, reset=False, stored=[2**64 - 1] * 5000, removed=[2**64 - 2] * 5000, block_size=16)
    assert [len(m.stored) + len(m.removed) for m in both] == [MAX_KV_BLOCKS, 3000]
    assert [m.removed == [] for m in both] == [False, True]  # removals first
    frames = [KINDS[KvBlocks], b"1", msgspec.msgpack.encode({"node_id": "n1", "seq": 0, "stored": [2**64 - 1] * 7500})]
    with pytest.raises(OversizedError):
        decode(frames, (KvBlocks,), MAX_VECTOR_BYTES)


def test_vector_receiver_takes_kv_blocks_only_when_asked_and_counts_bad_ones(ctx: zmq.Context, endpoint: str) -> None:
    rejects = RejectCounter("test", LOG)
    receiver = VectorReceiver(ctx, endpoint, rejects)
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.connect(endpoint)
    try:
        good = KvBlocks(node_id="n1", seq=0, stored=[1, 2])
        push.send_multipart(encode(vector(seq=1)))
        push.send_multipart(encode(good))
        bad = msgspec.msgpack.encode({"node_id": "n1", "seq": 0, "stored": [-5]})
        push.send_multipart([KINDS[KvBlocks], b"1", bad])
        got: list[NodeVector] = []
        kv: list[KvBlocks] = []

        def drained_with_kv() -> bool:
            receiver.socket.poll(100)
            got.extend(receiver.drain(kv=kv))
            return len(got) + len(kv) + rejects.total >= 3

        def drained_plain() -> bool:  # the plain drain refuses it
            receiver.socket.poll(100)
            got.extend(receiver.drain())
            return rejects.total >= 2

        wait_for(drained_with_kv, 5)
        push.send_multipart(encode(good))
        wait_for(drained_plain, 5)
        assert [v.seq for v in got] == [1] and kv == [good]
        assert rejects.counts() == {"invalid_field": 1, "unknown_kind": 1}
    finally:
        push.close()
        receiver.close()
