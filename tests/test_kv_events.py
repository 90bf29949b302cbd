"""KV-event subscriber against vLLM's wire format over real ZeroMQ sockets, and the Bloom summary.

The publisher below follows vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`): frames (topic,
8-byte big-endian seq, msgpack payload), a replay buffer, and a ROUTER that answers `[id, "", start_seq]` with
`[id, "", seq, payload]` per buffered batch and `[id, "", -1, ""]` at the end. Events are encoded by msgspec
structs declared as vLLM declares them: tagged maps in current vLLM, tagged arrays up to 0.23.

The Prism view (blocks re-hashed with the callers' chain) is checked against callers' `block_hashes` of the same
token ids, with the emulated engine (`prismlb.sim.EmulatedEngine`, over HTTP and its own ZeroMQ publisher) and with
the publisher below sending the emulator's engine hashes.
"""

from __future__ import annotations

import hashlib
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from prismlb import semantics
from prismlb.agent._kv_events import KvChanges, KvEventSubscriber
from prismlb.router import block_hashes
from prismlb.sim import EmulatedEngine, prompt_tokens
from prismlb.sim import block_hashes as engine_hashes
from prismlb.sim._model import EngineModel
from prismlb.wire import KvSummary

from .conftest import free_port, wait_for

TOPIC = b"kv-events"
Hash = int | bytes


# vLLM (current): the batch is array-like, events are tagged maps.
class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class StoredFields(msgspec.Struct, gc=False):
    """The fields `BlockStored` has begun with, in this order, in both formats."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockStored(KVCacheEvent, StoredFields):
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


# vLLM up to 0.23: events are tagged arrays too; `future` stands for a field a later version appends.
class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, StoredFields, tag="BlockStored"):
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    future: str | None = None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


def stored(hashes: list[Hash], block_size: int = 16, medium: str | None = "GPU") -> BlockStored:
    tokens = list(range(block_size * len(hashes)))
    return BlockStored(hashes, None, tokens, block_size, None, medium, None, [None] * len(hashes), 0, "full_attention")


def removed(hashes: list[Hash]) -> BlockRemoved:
    return BlockRemoved(hashes, "GPU", 0)


class Engine:
    """vLLM's publisher side: PUB frames with sequence numbers, a replay buffer and a ROUTER replay socket."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str | None = None, rank: int = 0) -> None:
        self.rank = rank
        """The DP rank the batches carry as `data_parallel_rank`."""
        # XPUB sends exactly what PUB sends; it also reports subscriptions, so the test knows the subscriber joined.
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.encoder = msgspec.msgpack.Encoder()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_endpoint)
            self.thread = threading.Thread(target=self._serve_replay, daemon=True)
            self.thread.start()

    def wait_subscriber(self) -> None:
        assert self.pub.poll(5000), "subscriber never joined"
        assert self.pub.recv()[0] == 1

    def publish(self, *events: Any, send: bool = True) -> int:
        """Encode a batch, keep it for replay, and send it unless `send` is False (a batch lost on the way)."""
        payload = self.encoder.encode(KVEventBatch(time.time(), list(events), self.rank))
        return self.publish_raw(payload, send=send)

    def publish_raw(self, payload: bytes, send: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", self.END_SEQ, b""])

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
            self.router.close()
        self.pub.close()


@pytest.fixture
def replay_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def engine(ctx: zmq.Context, endpoint: str, replay_endpoint: str) -> Iterator[Engine]:
    e = Engine(ctx, endpoint, replay_endpoint)
    yield e
    e.close()


def free_port_pair() -> int:
    """A loopback port p with p + 1 free too: where DP ranks 0 and 1 publish."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


def subscribe(ctx: zmq.Context, engine: Engine, endpoint: str, replay: str | None, **kw: Any) -> KvEventSubscriber:
    subscriber = KvEventSubscriber(endpoint, replay, TOPIC, context=ctx, **kw)
    engine.wait_subscriber()
    return subscriber


def poll_until(subscriber: KvEventSubscriber, done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    def polled() -> bool:
        if not done():
            subscriber.poll(50)
        return done()

    assert wait_for(polled, timeout_s), f"timed out: {subscriber.stats()}"


def held(subscriber: KvEventSubscriber, hashes: list[Hash]) -> list[bool]:
    summary = subscriber.summary()
    assert summary is not None
    return [semantics.bloom_contains(summary, h) for h in hashes]


def test_stored_removed_cleared(ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str) -> None:
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        assert sub.summary() is None
        big = 0xFFFF_FFFF_FFFF_FF00  # above 2**63: msgpack uint64
        engine.publish(stored([1, 2, 3]), stored([big], block_size=32))
        engine.publish(removed([2]))
        poll_until(sub, lambda: sub.stats().batches == 2)
        summary = sub.summary()
        assert summary is not None
        assert (summary.blocks, summary.bloom_hashes, summary.block_size_tokens) == (3, semantics.BLOOM_HASHES, 32)
        assert len(summary.bloom) == semantics.BLOOM_BITS // 8
        assert held(sub, [1, 3, big]) == [True, True, True]
        assert held(sub, [2]) == [False]
        stats = sub.stats()
        assert (stats.events, stats.last_seq, stats.replayed_batches, stats.missed_batches) == (3, 1, 0, 0)

        engine.publish(AllBlocksCleared())
        poll_until(sub, lambda: sub.stats().batches == 3)
        assert sub.summary() == KvSummary(
            blocks=0, bloom=b"", bloom_hashes=semantics.BLOOM_HASHES, block_size_tokens=32
        )
        assert sub.failures.counts() == {}


def test_array_encoded_events_with_bytes_hashes_and_newer_fields(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    sha: list[Hash] = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.publish(ArrayBlockStored(sha, None, list(range(48)), 16, None, "GPU", future="from vLLM 9"))
        engine.publish(ArrayBlockRemoved(sha[:1], "GPU"))
        # A map-encoded batch and event with a key this agent does not know.
        encoder = msgspec.msgpack.Encoder()
        event: dict[str, Any] = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None}
        event |= {"token_ids": [1] * 16, "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
        event["cache_salt"] = "tenant-a"
        engine.publish_raw(encoder.encode({"ts": 1.0, "events": [event], "data_parallel_rank": 0}))
        poll_until(sub, lambda: sub.stats().batches == 3)
        assert held(sub, [sha[0], sha[1], sha[2], 7]) == [False, True, True, True]
        assert sub.stats().blocks == 3
        assert sub.failures.counts() == {}


def test_gap_is_filled_by_replay(ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str) -> None:
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.publish(stored([10]))
        engine.publish(stored([11]), send=False)
        engine.publish(stored([12]), removed([10]), send=False)
        engine.publish(stored([13]))
        engine.publish(stored([14]))
        poll_until(sub, lambda: sub.stats().last_seq == 4)
        stats = sub.stats()
        assert (stats.batches, stats.replayed_batches, stats.missed_batches, stats.blocks) == (5, 2, 0, 4)
        assert held(sub, [10, 11, 12, 13, 14]) == [False, True, True, True, True]
        assert sub.failures.counts() == {}


def test_gap_without_replay_is_counted_and_skipped(ctx: zmq.Context, endpoint: str) -> None:
    engine = Engine(ctx, endpoint)
    try:
        with subscribe(ctx, engine, endpoint, None) as sub:
            engine.publish(stored([20]))
            engine.publish(stored([21]), send=False)
            engine.publish(stored([22]), send=False)
            engine.publish(stored([23]))
            poll_until(sub, lambda: sub.stats().last_seq == 3)
            stats = sub.stats()
            assert (stats.batches, stats.replayed_batches, stats.missed_batches) == (2, 0, 2)
            assert held(sub, [20, 23]) == [True, True]
            assert sub.failures.counts() == {"gap": 1}
    finally:
        engine.close()


def test_gap_with_a_silent_replay_endpoint(ctx: zmq.Context, endpoint: str) -> None:
    engine = Engine(ctx, endpoint)
    silent = f"tcp://127.0.0.1:{free_port()}"
    try:
        with subscribe(ctx, engine, endpoint, silent, replay_timeout_s=0.1) as sub:
            engine.publish(stored([30]))
            engine.publish(stored([31]), send=False)
            engine.publish(stored([32]))
            engine.publish(stored([33]))
            poll_until(sub, lambda: sub.stats().last_seq == 3)
            assert sub.stats().missed_batches == 1
            assert held(sub, [30, 32, 33]) == [True, True, True]
            assert sub.failures.counts() == {"replay_timeout": 1, "gap": 1}
    finally:
        engine.close()


def test_late_join_replays_from_zero(ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str) -> None:
    engine.publish(stored([40, 41]), send=False)  # published before the agent started
    engine.publish(removed([40]), send=False)
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.publish(stored([42]))
        poll_until(sub, lambda: sub.stats().last_seq == 2)
        assert sub.stats().replayed_batches == 2
        assert held(sub, [40, 41, 42]) == [False, True, True]
        assert sub.failures.counts() == {}


def test_publisher_restart_clears_the_set(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.publish(stored([50]))
        engine.publish(stored([51]))
        poll_until(sub, lambda: sub.stats().last_seq == 1)
        engine.seq, engine.buffer = 0, []  # a new engine process: sequence and buffer start over
        engine.publish(stored([52]))
        poll_until(sub, lambda: sub.stats().last_seq == 0)
        assert held(sub, [50, 51, 52]) == [False, False, True]
        assert sub.failures.counts() == {"publisher_restart": 1}


def test_malformed_input_is_counted_by_kind(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    encoder = msgspec.msgpack.Encoder()
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.pub.send_multipart([TOPIC, b"only two frames"])
        engine.pub.send_multipart([TOPIC, b"\x00\x01", b"seq of 2 bytes"])
        engine.publish_raw(b"\xc1 not msgpack")
        engine.publish_raw(b"\x91" * 5000 + b"\xc0")  # nested too deep for msgspec
        engine.publish_raw(encoder.encode({"not": "a batch"}))
        engine.publish(
            stored([60]),
            {"type": "BlockMoved", "block_hashes": [1]},
            {"type": "BlockStored", "block_hashes": "nope", "block_size": 16},
            ["BlockRemoved", [1.5], "GPU"],
            {"type": "BlockStored", "block_hashes": [61], "block_size": 0},
            42,
        )
        poll_until(sub, lambda: sub.stats().last_seq == 3)
        assert sub.failures.counts() == {
            "frames": 1,
            "seq": 1,
            "payload": 2,
            "batch": 1,
            "unknown_event": 1,
            "event": 4,
        }
        assert held(sub, [60]) == [True]
        assert sub.stats().batches == 1


def test_block_set_is_bounded_oldest_first(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    with subscribe(ctx, engine, endpoint, replay_endpoint, max_blocks=4) as sub:
        engine.publish(stored([1, 2, 3, 4]))
        engine.publish(stored([1]))  # stored again: now the newest
        engine.publish(stored([5, 6]))
        poll_until(sub, lambda: sub.stats().batches == 3)
        stats = sub.stats()
        assert (stats.blocks, stats.evicted_blocks) == (4, 2)
        assert held(sub, [1, 2, 3, 4, 5, 6]) == [True, False, False, True, True, True]


def test_background_thread(ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str) -> None:
    sub = subscribe(ctx, engine, endpoint, replay_endpoint)
    sub.start()
    try:
        with pytest.raises(RuntimeError):
            sub.start()
        for block in range(100):
            engine.publish(stored([block]))
        assert wait_for(lambda: sub.stats().batches >= 100, 5.0), sub.stats()
        assert sub.stats().blocks == 100
    finally:
        sub.stop()


hashes = st.one_of(st.integers(min_value=-(2**63), max_value=2**64 - 1), st.binary(min_size=1, max_size=32))


@settings(max_examples=200, deadline=None)
@given(kept=st.lists(hashes, max_size=200), dropped=st.lists(hashes, max_size=200))
def test_bloom_has_no_false_negatives(kept: list[Hash], dropped: list[Hash]) -> None:
    bloom = semantics.CountingBloom(m_bits=1024, k=4)  # small, so that keys share counters
    for h in kept + dropped:
        bloom.add(h)
    for h in dropped:
        bloom.remove(h)
    summary = KvSummary(blocks=len(kept), bloom=bloom.bits(), bloom_hashes=4)
    assert all(semantics.bloom_contains(summary, h) for h in kept)


def test_bloom_removing_everything_empties_it() -> None:
    bloom = semantics.CountingBloom()
    for h in range(1000):
        bloom.add(h)
    for h in range(1000):
        bloom.remove(h)
    assert bloom.bits() == bytes(semantics.BLOOM_BITS // 8)


def test_bloom_false_positive_rate_at_capacity() -> None:
    rng = random.Random(4)
    capacity = semantics.BLOOM_CAPACITY
    members = list({rng.getrandbits(64) for _ in range(capacity + 20_000)})
    assert len(members) == capacity + 20_000
    bloom = semantics.CountingBloom()
    for h in members[:capacity]:
        bloom.add(h)
    summary = KvSummary(blocks=capacity, bloom=bloom.bits(), bloom_hashes=semantics.BLOOM_HASHES)
    rate = sum(semantics.bloom_contains(summary, h) for h in members[capacity:]) / 20_000
    design = semantics.bloom_false_positive_rate(semantics.BLOOM_BITS, semantics.BLOOM_HASHES, capacity)
    assert design == pytest.approx(0.0216, abs=1e-4)
    assert abs(rate - design) < 0.005  # about 5 standard deviations of 20,000 trials


def test_bloom_overlap_is_the_leading_run() -> None:
    bloom = semantics.CountingBloom()
    for h in (1, 2, 3, 9):
        bloom.add(h)
    summary = KvSummary(blocks=4, bloom=bloom.bits(), bloom_hashes=semantics.BLOOM_HASHES)
    assert semantics.bloom_overlap(summary, [1, 2, 3, 4]) == 0.75
    assert semantics.bloom_overlap(summary, [1, 2, 5, 9]) == 0.5
    assert semantics.bloom_overlap(summary, [5, 1]) == 0.0
    assert semantics.bloom_overlap(summary, []) == 0.0
    empty = KvSummary(blocks=0, bloom=b"", bloom_hashes=semantics.BLOOM_HASHES)
    assert not semantics.bloom_contains(empty, 1)


def test_block_key_is_vllms_unsigned_64_bit_form() -> None:
    assert semantics.block_key(-1) == semantics.block_key(2**64 - 1) == b"\xff" * 8
    assert semantics.block_key(5) == (5).to_bytes(8, "big")
    digest = hashlib.sha256(b"x").digest()
    assert semantics.block_key(digest) == digest


# --- the Prism view: engine blocks re-hashed with the callers' chain --------------------------------------------

SCALE = 0.2  # the emulated engine's model runs five times faster than the wall clock


def vllm_stored(
    tokens: list[int], first: int, count: int, *, extra: list[Any] | None = None, medium: str = "GPU"
) -> BlockStored:
    """What vLLM publishes when blocks `first..first+count-1` of a prompt are cached: their engine hashes (the
    emulator's, seeded differently from Prism's chain), the hash of the block before (None at the root), their
    tokens and extra keys."""
    hashes = engine_hashes(tokens)
    parent = hashes[first - 1] if first else None
    block_tokens = tokens[first * 16 : (first + count) * 16]
    return BlockStored(hashes[first : first + count], parent, block_tokens, 16, None, medium, None, extra, 0)


def words(seed: str, blocks: int) -> list[int]:
    """A prompt of `blocks` full 16-token blocks from the emulated tokenizer (4 characters a token)."""
    text = (f"{seed} " * (blocks * 64))[: blocks * 64]
    return prompt_tokens(text)


def chat(engine: EmulatedEngine, text: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    assert httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=10).status_code == 200


def tokenize(engine: EmulatedEngine, text: str) -> list[int]:
    """The prompt's token ids as a caller gets them: from the engine's `/tokenize`."""
    answer = httpx.post(engine.url + "/tokenize", json={"model": "m", "prompt": text}, timeout=10)
    tokens: list[int] = answer.json()["tokens"]
    return tokens


def chat_and_wait(engine: EmulatedEngine, sub: KvEventSubscriber, text: str) -> None:
    """Send a request and apply the KV events it causes (the reply may come before they are published)."""
    before = sub.stats().batches
    chat(engine, text)
    poll_until(sub, lambda: sub.stats().batches > before)


def join(engine: EmulatedEngine, sub: KvEventSubscriber) -> list[str]:
    """Send one-block prompts until the subscriber gets a batch (a SUB socket misses what is published before it
    joined, and the emulator's PUB cannot tell when it has); returns the prompts sent."""
    sent: list[str] = []

    def joined() -> bool:
        if sub.stats().batches:
            return True
        sent.append(f"warm-up prompt number {len(sent)}: ".ljust(64, "."))
        chat(engine, sent[-1])
        sub.poll(100)
        return False

    wait_for(joined, 10, "the subscriber to join")
    return sent


def test_prism_hashes_of_the_emulated_engine_are_the_callers_block_hashes() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with EmulatedEngine("h100", kv_events_endpoint=endpoint, time_scale=SCALE) as engine:
        with KvEventSubscriber(endpoint) as sub:
            join(engine, sub)
            assert sub.take_changes().reset  # the first take is the whole set
            system = "You are a terse assistant. Answer in French, cite sources, never guess. " * 8
            first = system + "What is the capital of Italy, and how long has it been the capital? " * 2
            second = system + "And what about Spain: which city, since when, and why that one? " * 2
            chat_and_wait(engine, sub, first)
            size = sub.block_size
            assert size == 16
            first_keys = block_hashes(tokenize(engine, first), size)
            changes = sub.take_changes()
            assert changes == KvChanges(False, tuple(first_keys), (), 16)

            # The second prompt's new blocks chain on the first's: their parent is looked up among held blocks.
            chat_and_wait(engine, sub, second)
            second_keys = block_hashes(tokenize(engine, second), size)
            shared = next(i for i, (a, b) in enumerate(zip(first_keys, second_keys)) if a != b)
            assert 0 < shared < len(second_keys)
            assert sub.take_changes() == KvChanges(False, tuple(second_keys[shared:]), (), 16)
            assert set(first_keys) | set(second_keys) <= set(sub.blocks())
            stats = sub.stats()
            assert stats.unhashable_blocks == 0 and stats.prism_blocks == len(sub.blocks()) == stats.blocks
            assert sub.failures.counts() == {}


def test_engine_evictions_come_out_as_removed() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = EmulatedEngine("a100", kv_events_endpoint=endpoint, time_scale=SCALE)
    engine.model = EngineModel(replace(engine.profile, kv_blocks=12))  # room for two 4-block prompts and a bit
    with engine, KvEventSubscriber(endpoint) as sub:
        prompts = join(engine, sub)
        held: set[int] = set()  # what a consumer of the changes holds
        removed: set[int] = set()

        def cached_by_engine() -> set[int]:
            """The Prism hashes of the blocks the engine's cache holds now, by its own hashes of the prompts."""
            pairs = (zip(engine_hashes(prompt_tokens(p)), block_hashes(prompt_tokens(p))) for p in prompts)
            return {prism for chain in pairs for engine_hash, prism in chain if engine.model.cached(engine_hash)}

        for text in ("a" * 256, "b" * 256, "c" * 256, "a" * 256, "d" * 256):
            prompts.append(text)
            chat(engine, text)
            poll_until(sub, lambda: set(sub.blocks()) == cached_by_engine())
            changes = sub.take_changes()
            held = (held if not changes.reset else set()) - set(changes.removed) | set(changes.stored)
            assert held == set(sub.blocks())
            assert not set(changes.stored) & set(changes.removed)
            removed |= set(changes.removed)
        first_a = block_hashes(prompt_tokens("a" * 256))
        assert first_a[0] in removed  # "c" evicted the oldest free blocks: the warm-up's, then the root of "a"
        assert engine.model.capacity_blocks == 12 and len(held) <= 12
        assert sub.stats().unhashable_blocks == 0
        assert sub.failures.counts() == {}


def test_unknown_parent_is_counted_and_skipped(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    prompt = words("late", 5)
    keys = block_hashes(prompt)
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.publish(vllm_stored(prompt, 2, 2))  # blocks 0 and 1 were stored before the agent could see them
        engine.publish(vllm_stored(prompt, 4, 1))  # chained on an unhashable block: unhashable too
        poll_until(sub, lambda: sub.stats().batches == 2)
        assert (sub.stats().unhashable_blocks, sub.stats().blocks, sub.blocks()) == (3, 3, ())
        assert held(sub, engine_hashes(prompt)[2:]) == [True, True, True]  # the Bloom summary keeps them

        # The prefix stored, then the rest stored again (vLLM would after a hit): every block re-hashed.
        engine.publish(vllm_stored(prompt, 0, 2))
        engine.publish(vllm_stored(prompt, 2, 3))
        poll_until(sub, lambda: sub.stats().batches == 4)
        assert sub.blocks() == tuple(keys)
        assert (sub.stats().unhashable_blocks, sub.stats().blocks) == (3, 5)
        assert sub.take_changes() == KvChanges(True, tuple(keys), (), 16)
        assert sub.failures.counts() == {}


def test_changes_are_coalesced_between_takes(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    a, b, c = words("alpha", 3), words("beta", 2), words("gamma", 1)
    ka, kb, kc = block_hashes(a), block_hashes(b), block_hashes(c)
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.publish(vllm_stored(a, 0, 3))
        poll_until(sub, lambda: sub.stats().batches == 1)
        assert sub.take_changes() == KvChanges(True, tuple(ka), (), 16)
        assert sub.take_changes() == KvChanges(False, (), (), 16)

        a_hashes = engine_hashes(a)
        engine.publish(vllm_stored(b, 0, 2), removed(engine_hashes(b)))  # stored then removed: nothing
        engine.publish(removed(a_hashes[1:2]), vllm_stored(a, 1, 1))  # removed then stored again: nothing
        engine.publish(removed(a_hashes[2:]), vllm_stored(c, 0, 1))
        engine.publish(vllm_stored(b, 0, 1))
        poll_until(sub, lambda: sub.stats().batches == 5)
        assert sub.take_changes() == KvChanges(False, (kc[0], kb[0]), (ka[2],), 16)
        assert sub.blocks() == (ka[0], ka[1], kc[0], kb[0])


def test_block_held_on_gpu_and_cpu_leaves_the_set_with_its_last_copy(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    prompt = words("offloaded", 2)
    keys, hashes = block_hashes(prompt), engine_hashes(prompt)
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.publish(vllm_stored(prompt, 0, 2))
        # vLLM's CPU offloading reports stored blocks without parent or tokens: known hashes keep their Prism hash.
        engine.publish(BlockStored(hashes, None, [], 16, None, "CPU", None))
        poll_until(sub, lambda: sub.stats().batches == 2)
        assert sub.take_changes() == KvChanges(True, tuple(keys), (), 16)
        assert (sub.stats().blocks, sub.stats().prism_blocks, sub.stats().unhashable_blocks) == (4, 2, 0)

        engine.publish(removed(hashes))  # evicted from the GPU, still in CPU memory
        engine.publish(BlockRemoved(hashes[1:], "CPU"))
        poll_until(sub, lambda: sub.stats().batches == 4)
        assert sub.take_changes() == KvChanges(False, (), (keys[1],), 16)
        assert sub.blocks() == (keys[0],)


def test_cleared_and_restarted_engines_reset_the_set(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    a, b, c = words("before", 2), words("after", 2), words("restarted", 1)
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.publish(vllm_stored(a, 0, 2))
        poll_until(sub, lambda: sub.stats().batches == 1)
        sub.take_changes()
        engine.publish(vllm_stored(b, 0, 1), AllBlocksCleared(), vllm_stored(b, 0, 2))
        poll_until(sub, lambda: sub.stats().batches == 2)
        assert sub.take_changes() == KvChanges(True, tuple(block_hashes(b)), (), 16)

        engine.seq, engine.buffer = 0, []  # a new engine process: its cache is empty
        engine.publish(vllm_stored(c, 0, 1))
        poll_until(sub, lambda: sub.stats().last_seq == 0)
        assert sub.take_changes() == KvChanges(True, tuple(block_hashes(c)), (), 16)
        assert sub.blocks() == tuple(block_hashes(c))


def test_bounded_set_evicts_into_removed_and_too_many_changes_become_a_reset(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    old, new = words("old", 3), words("new", 6)
    ko, kn = block_hashes(old), block_hashes(new)
    with subscribe(ctx, engine, endpoint, replay_endpoint, max_blocks=4) as sub:
        engine.publish(vllm_stored(old, 0, 3))
        poll_until(sub, lambda: sub.stats().batches == 1)
        sub.take_changes()
        engine.publish(vllm_stored(new, 0, 2))  # the oldest block makes room
        poll_until(sub, lambda: sub.stats().batches == 2)
        assert sub.take_changes() == KvChanges(False, tuple(kn[:2]), (ko[0],), 16)

        # Four more blocks evict the rest: 6 changes pending for a set of at most 4, so the take is a reset.
        engine.publish(vllm_stored(new, 2, 4))
        poll_until(sub, lambda: sub.stats().batches == 3)
        assert sub.take_changes() == KvChanges(True, tuple(kn[2:]), (), 16)
        assert (sub.stats().evicted_blocks, sub.stats().prism_blocks) == (5, 4)


def test_malformed_token_ids_are_counted_and_lose_nothing_else(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    good = words("good", 1)
    bad = [words(f"bad {i}", 1) for i in range(8)]
    nested: list[Any] = ["deep"]
    for _ in range(50):
        nested = [nested]

    def event(i: int, **fields: Any) -> dict[str, Any]:
        base = {"type": "BlockStored", "block_hashes": engine_hashes(bad[i]), "parent_block_hash": None}
        return base | {"token_ids": bad[i], "block_size": 16, "medium": "GPU", "group_idx": 0} | fields

    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.publish(
            event(0, token_ids=[-1] * 16),
            event(1, token_ids="not a list"),
            event(2, token_ids=bad[2][:15]),  # short: cannot be lined up, but not malformed
            event(3, extra_keys=[[1.5]]),
            event(4, extra_keys=[None, None]),  # not one entry per block
            event(5, parent_block_hash="parent"),
            event(6, extra_keys=["not an array"]),
            event(7, extra_keys=[nested]),  # nested past what the encoding takes
            vllm_stored(good, 0, 1),
        )
        poll_until(sub, lambda: sub.stats().batches == 1)
        assert sub.failures.counts() == {"token_ids": 2, "extra_keys": 4, "parent_block_hash": 1}
        stats = sub.stats()
        assert (stats.events, stats.blocks, stats.unhashable_blocks) == (9, 9, 8)
        assert sub.blocks() == tuple(block_hashes(good))
        all_hashes = [h for tokens in bad for h in engine_hashes(tokens)]
        assert held(sub, all_hashes) == [True] * 8
        engine.publish(removed(all_hashes))
        poll_until(sub, lambda: sub.stats().batches == 2)
        assert (sub.stats().blocks, sub.blocks()) == (1, tuple(block_hashes(good)))


def test_extra_keys_are_folded_in_as_callers_give_them(
    ctx: zmq.Context, engine: Engine, endpoint: str, replay_endpoint: str
) -> None:
    # An image's placeholder tokens are the same for every image: only the extra keys tell two images apart.
    placeholder = [9] * 8 + [151_655] * 24
    cat: list[Any] = [("lora-fr", ("sha256:cat", 8)), ("lora-fr", ("sha256:cat", -8))]
    dog: list[Any] = [("lora-fr", ("sha256:dog", 8)), ("lora-fr", ("sha256:dog", -8))]
    with subscribe(ctx, engine, endpoint, replay_endpoint) as sub:
        engine.publish(BlockStored([101, 102], None, placeholder, 16, 1, "GPU", "lora-fr", cat, 0))
        engine.publish(BlockStored([201, 202], None, placeholder, 16, 1, "GPU", "lora-fr", dog, 0))
        poll_until(sub, lambda: sub.stats().batches == 2)
        with_cat, with_dog = block_hashes(placeholder, extra=cat), block_hashes(placeholder, extra=dog)
        assert sub.blocks() == (*with_cat, *with_dog)
        assert not set(with_cat) & set(with_dog) and not set(with_cat) & set(block_hashes(placeholder))
        assert sub.failures.counts() == {}


def array_stored(hashes: list[Hash], first_token: int, parent: Hash | None = None, size: int = 16) -> ArrayBlockStored:
    """vLLM's BlockStored as a tagged array, its blocks holding the token ids from `first_token` on."""
    return ArrayBlockStored(
        hashes, parent, list(range(first_token, first_token + size * len(hashes))), size, None, "GPU"
    )


@pytest.fixture
def dp_engines(ctx: zmq.Context) -> Iterator[list[Engine]]:
    """An engine with two DP ranks as vLLM runs it: rank r publishes on the port + r, replays on the replay
    port + r, and marks its batches with its rank."""
    pub, replay = free_port_pair(), free_port_pair()
    engines = [Engine(ctx, f"tcp://127.0.0.1:{pub + r}", f"tcp://127.0.0.1:{replay + r}", rank=r) for r in range(2)]
    yield engines
    for engine in engines:
        engine.close()


def subscribe_ranks(ctx: zmq.Context, engines: list[Engine], replay: bool) -> KvEventSubscriber:
    """A subscriber given rank 0's endpoints and the number of ranks, as the agent is configured."""
    pub = engines[0].pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    replay_endpoint = engines[0].router.getsockopt(zmq.LAST_ENDPOINT).decode() if replay else None
    subscriber = KvEventSubscriber(pub, replay_endpoint, TOPIC, dp_ranks=len(engines), context=ctx)
    for engine in engines:
        engine.wait_subscriber()
    return subscriber


def test_dp_ranks_are_followed_on_their_ports_each_with_its_own_sequence(
    ctx: zmq.Context, dp_engines: list[Engine]
) -> None:
    rank0, rank1 = dp_engines
    with subscribe_ranks(ctx, dp_engines, replay=True) as sub:
        rank0.publish(array_stored([1, 2], first_token=0))
        rank1.publish(array_stored([101], first_token=100))
        rank0.publish(array_stored([3], first_token=32, parent=2))
        rank1.publish(array_stored([102], first_token=116, parent=101), send=False)  # lost: rank 1 replays it
        rank1.publish(array_stored([103], first_token=132, parent=102))
        poll_until(sub, lambda: sub.stats().last_seqs == (1, 2))
        stats = sub.stats()
        # Both ranks count from 0: one shared sequence would have read rank 1's batches as a publisher restart.
        assert (stats.batches, stats.replayed_batches, stats.missed_batches, stats.blocks) == (5, 1, 0, 6)
        assert sub.failures.counts() == {}
        assert held(sub, [1, 2, 3, 101, 102, 103]) == [True] * 6
        # Each rank's chain re-hashed from its own parents: the node's view is both ranks' prompts.
        expected = block_hashes(list(range(48)), 16) + block_hashes(list(range(100, 148)), 16)
        assert sorted(sub.blocks()) == sorted(expected)


def test_dp_rank_gaps_restarts_and_clears_are_the_ranks_own(ctx: zmq.Context, dp_engines: list[Engine]) -> None:
    rank0, rank1 = dp_engines
    shared = block_hashes(list(range(16)), 16)[0]  # both ranks cache the same first block, under engine hash 1
    with subscribe_ranks(ctx, dp_engines, replay=False) as sub:
        rank0.publish(array_stored([1], first_token=0))
        rank0.publish(array_stored([2], first_token=1000), send=False)
        rank0.publish(array_stored([3], first_token=2000))
        rank1.publish(array_stored([1], first_token=0))
        rank1.publish(array_stored([5], first_token=5000))
        poll_until(sub, lambda: sub.stats().last_seqs == (2, 1))
        assert sub.failures.counts() == {"gap": 1} and sub.stats().missed_batches == 1
        rank1.publish(array_stored([6], first_token=6000), send=False)
        rank1.publish(array_stored([7], first_token=7000), send=False)
        rank1.publish(array_stored([8], first_token=8000))
        poll_until(sub, lambda: sub.stats().last_seqs == (2, 4))
        assert sub.failures.counts() == {"gap": 2} and sub.stats().missed_batches == 3
        assert sub.take_changes().reset  # the first take; later ones are the changes since

        rank1.publish(ArrayAllBlocksCleared())
        poll_until(sub, lambda: sub.stats().last_seqs == (2, 5))
        assert held(sub, [1, 3, 5, 8]) == [True, True, False, False]
        changes = sub.take_changes()
        # Rank 0 still holds the shared block: only rank 1's own blocks left the node's view.
        expected = {block_hashes(list(range(start, start + 16)), 16)[0] for start in (5000, 8000)}
        assert (changes.reset, set(changes.removed), changes.stored) == (False, expected, ())
        assert shared in sub.blocks()

        rank1.publish(array_stored([9], first_token=9000))
        rank1.seq, rank1.buffer = 0, []  # rank 1's process restarts: its sequence starts over, its cache is empty
        rank1.publish(array_stored([10], first_token=10000))
        rank0.publish(array_stored([4], first_token=4000))
        poll_until(sub, lambda: sub.stats().last_seqs == (3, 0))
        assert sub.failures.counts() == {"gap": 2, "publisher_restart": 1}
        assert held(sub, [1, 3, 4, 9, 10]) == [True, True, True, False, True]
        assert sub.stats().blocks == 4
