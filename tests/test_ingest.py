"""Ingest overload is counted on the brain's side: oversized frames, sequence gaps, a sender beyond the HWM;
in-process and sharded over worker processes. Real ZeroMQ on loopback."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest
import zmq
from prometheus_client import CollectorRegistry

from prismlb.brain import Brain, BrainConfig
from prismlb.brain._shards import ShardedReceiver
from prismlb.wire import MAX_VECTOR_BYTES, NodeMetrics, NodeVector, VectorReceiver, VectorSender

from .conftest import wait_for

LOG = logging.getLogger("test.ingest")
STARTED = 1_700_000_000.0


def vector(seq: int, node_id: str = "node-a", started: float = STARTED) -> NodeVector:
    return NodeVector(
        node_id=node_id,
        host="host-a",
        endpoint="http://10.0.0.1:8000",
        seq=seq,
        sample_time_unix_s=time.time() - 60 + seq * 1e-3,
        period_s=1.0,
        started_unix_s=started,
        metrics=NodeMetrics(cpu_util_ratio=0.5),
    )


@pytest.fixture
def brain() -> Brain:
    return Brain(BrainConfig(admin_port=0, train_budget_s=0.0, stale_periods=1e6), CollectorRegistry())


Receiver = VectorReceiver | ShardedReceiver


@pytest.fixture(params=["in-process", "sharded"])
def receiver(request: pytest.FixtureRequest, ctx: zmq.Context, brain: Brain) -> Iterator[Receiver]:
    if request.param == "in-process":
        made: Receiver = VectorReceiver(ctx, "tcp://127.0.0.1:0", brain.rejects)
    else:
        made = ShardedReceiver(ctx, "tcp://127.0.0.1:0", brain.rejects, 2)
    yield made
    made.close()


def endpoint(receiver: Receiver) -> str:
    if isinstance(receiver, ShardedReceiver):
        return receiver.endpoint
    return str(receiver.socket.getsockopt(zmq.LAST_ENDPOINT).decode())


def pump(brain: Brain, receiver: Receiver, done: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Drain into the brain until `done` holds or the time is up."""

    def drained() -> bool:
        if receiver.socket.poll(50):
            brain.ingest(receiver.drain(), time.monotonic())
        return done()

    return wait_for(drained, timeout_s)


def lost(brain: Brain) -> float:
    return brain.metrics.get_sample_value("prism_brain_vectors_lost_total") or 0.0


def accepted(brain: Brain) -> float:
    return brain.metrics.get_sample_value("prism_brain_vectors_total") or 0.0


def test_an_oversized_vector_frame_is_counted_and_the_connection_goes_on(
    ctx: zmq.Context, brain: Brain, receiver: Receiver
) -> None:
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint(receiver))
    push.send_multipart([b"prism.node", b"1", b"\x80" * (2 * MAX_VECTOR_BYTES)])
    push.send_multipart([b"prism.node", b"1", b"\x80" * 16])  # after the oversized frame, on the same connection
    with VectorSender(ctx, endpoint(receiver)) as sender:  # open until received: closing drops what it queues
        sender.send(vector(0))
        assert pump(
            brain,
            receiver,
            lambda: brain.rejects.counts() == {"oversized": 1, "invalid_field": 1} and accepted(brain) == 1,
        )
    push.close(linger=0)


def test_a_gap_in_an_agents_sequence_is_counted_as_lost(ctx: zmq.Context, brain: Brain, receiver: Receiver) -> None:
    sent = [
        *(vector(seq) for seq in (0, 1, 4, 5)),  # 2 and 3 never sent
        vector(0, node_id="node-b"),
        vector(1, node_id="node-b"),
        vector(2, node_id="node-b", started=STARTED + 100),  # restarted: its 0 and 1 never came
        vector(3, node_id="node-b", started=STARTED + 100),
    ]
    with VectorSender(ctx, endpoint(receiver), hwm=100) as sender:
        # one at a time: sharded workers may reorder a node's vectors that queue together (brain/_shards.py)
        for count, one in enumerate(sent, start=1):
            sender.send(one)
            assert pump(brain, receiver, lambda count=count: accepted(brain) == count)
    assert lost(brain) == 2 + 2
    assert brain.registry.nodes["node-a"].vector.seq == 5


def test_a_sender_beyond_the_receivers_hwm_is_counted_on_the_brains_side(ctx: zmq.Context, brain: Brain) -> None:
    receiver = VectorReceiver(ctx, "tcp://127.0.0.1:0", brain.rejects, hwm=10)
    with VectorSender(ctx, endpoint(receiver), hwm=10) as sender:
        seq = 0
        while sender.dropped < 50:  # the brain does not read: both queues and the socket buffers fill up
            sender.send(vector(seq))  # like an agent, a dropped vector still uses its sequence number
            seq += 1

        def backlogged() -> bool:  # the I/O thread moves the queue along
            receiver.socket.poll(100)
            brain.ingest(receiver.drain(limit=5), time.monotonic())
            return receiver.backlog != 0

        wait_for(backlogged)
        assert receiver.backlog == 1  # stopped at its limit with more waiting
        dropped = sender.dropped
        # one more after the drops: the gap is behind a received vector
        wait_for(lambda: sender.send(vector(seq)), what="the sender's queue to take one more vector")
        assert pump(brain, receiver, lambda: accepted(brain) == sender.sent, timeout_s=20)
    assert receiver.backlog == 0
    assert lost(brain) == dropped
    receiver.close()
