"""Subscriber to an engine's KV-cache events (vLLM's ZeroMQ publisher): the node's cached blocks as a Bloom summary.

Wire format (vLLM `vllm/distributed/kv_events.py`): each message is three frames, topic, sequence number
(8 bytes, big-endian) and a msgpack `KVEventBatch` `[ts, events, data_parallel_rank]`. Events are tagged
msgspec structs: a tagged array `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, extra_keys, group_idx, ...]` up to vLLM 0.23, a map `{"type": "BlockStored", ...}` after
(vLLM #42892); both are read, fields a newer version appends are ignored. Block hashes are ints or bytes.

A sequence number past the expected one is a gap: the subscriber asks the replay endpoint (vLLM's ROUTER) for
the missed batches over a DEALER socket (`["", start_seq]`; answers `["", seq, payload]`, ending with seq -1
and an empty payload) and applies them in order; what replay cannot give is counted, and the subscriber goes
on. On joining late it asks for everything from 0 the same way. A sequence number that goes back means the
publisher restarted: its cache is empty, so the set is cleared.

A block is one (hash, medium, KV-cache group): a block offloaded to CPU still counts as held by the node.
The set keeps at most `max_blocks` (about 200 bytes each), evicting the oldest stored first.

Threading: `start()` runs `poll()` in a background thread until `stop()`; without `start()` the owner calls
`poll(timeout_ms)` itself, from one thread. `summary()` and `stats()` may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple, Self, TypeGuard

import msgspec
import zmq

from prismlb.wire import BLOOM_BITS, BLOOM_HASHES, CountingBloom, KvSummary, RejectCounter, block_key

_log = logging.getLogger("prism.agent.kv_events")

MAX_BLOCKS = 131_072
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_MAX_MESSAGES_PER_POLL = 10_000
_END_SEQ = -1

# Positional fields of the array-encoded events (vLLM's declaration order), after the tag.
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


class _Event(NamedTuple):
    tag: str
    hashes: list[bytes]
    medium: str | None
    group: int | None
    block_size: int | None


class _Malformed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass(frozen=True)
class KvEventStats:
    """Counters since start; malformed input, gaps and replay failures are in `failures` by kind."""

    batches: int
    events: int
    replayed_batches: int
    missed_batches: int
    evicted_blocks: int
    blocks: int
    last_seq: int | None


class KvEventSubscriber:
    """Keeps the set of KV blocks an engine holds, from its events; `summary()` is what goes to the brain."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        *,
        max_blocks: int = MAX_BLOCKS,
        replay_timeout_s: float = 1.0,
        bloom_bits: int = BLOOM_BITS,
        bloom_hashes: int = BLOOM_HASHES,
        context: zmq.Context | None = None,
    ) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, not {max_blocks}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.failures = RejectCounter(f"KV events from {endpoint}", _log)
        self._max_blocks = max_blocks
        self._replay_timeout_ms = max(1, round(replay_timeout_s * 1000))
        self._ctx = context if context is not None else zmq.Context.instance()
        self._decoder = msgspec.msgpack.Decoder()
        self._lock = threading.Lock()
        self._blocks: OrderedDict[tuple[bytes, str | None, int | None], None] = OrderedDict()
        self._bloom = CountingBloom(bloom_bits, bloom_hashes)
        self._block_size: int | None = None
        self._next_seq: int | None = None
        self._counts = {"batches": 0, "events": 0, "replayed": 0, "missed": 0, "evicted": 0}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._dealer: zmq.Socket | None = None
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Poll in a background thread until `stop()`."""
        if self._thread is not None:
            raise RuntimeError("KvEventSubscriber already started")
        self._thread = threading.Thread(target=self._run, name="prism-kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread (if any) and close the sockets."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    close = stop

    def poll(self, timeout_ms: int) -> int:
        """Wait up to `timeout_ms` for events, apply every batch waiting; returns the batches applied."""
        if not self._sub.poll(timeout_ms):
            return 0
        applied = 0
        for _ in range(_MAX_MESSAGES_PER_POLL):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            applied += self._on_message(frames)
        return applied

    def summary(self) -> KvSummary | None:
        """The cached blocks as a Bloom filter (empty when none); None until the first batch arrived."""
        with self._lock:
            if self._next_seq is None:
                return None
            return KvSummary(
                blocks=len(self._blocks),
                bloom=self._bloom.bits() if self._blocks else b"",
                bloom_hashes=self._bloom.k,
                block_size_tokens=self._block_size,
            )

    def stats(self) -> KvEventStats:
        with self._lock:
            counts = self._counts
            return KvEventStats(
                batches=counts["batches"],
                events=counts["events"],
                replayed_batches=counts["replayed"],
                missed_batches=counts["missed"],
                evicted_blocks=counts["evicted"],
                blocks=len(self._blocks),
                last_seq=None if self._next_seq is None else self._next_seq - 1,
            )

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.poll(100)
            except zmq.ContextTerminated:
                return

    def _on_message(self, frames: list[bytes]) -> int:
        if len(frames) != 3:
            self.failures.count("frames", f"{len(frames)} frames, not 3 (topic, seq, payload)")
            return 0
        _, seq_bytes, payload = frames
        if len(seq_bytes) != 8:
            self.failures.count("seq", f"sequence frame of {len(seq_bytes)} bytes, not 8")
            return 0
        seq = int.from_bytes(seq_bytes, "big")
        expected = self._next_seq
        applied = 0
        if expected is not None and seq < expected:
            self.failures.count("publisher_restart", f"sequence went back from {expected - 1} to {seq}")
            self._clear()
            expected = None
        if expected is None:
            if seq > 0:
                applied += self._replay(0, seq)
            _log.info("KV events from %s: first batch seq %d, %d earlier batches replayed", self.endpoint, seq, applied)
        elif seq > expected:
            replayed = self._replay(expected, seq)
            applied += replayed
            missed = seq - expected - replayed
            if missed:
                self.failures.count("gap", f"batches {expected}..{seq - 1} missed, {replayed} replayed")
                with self._lock:
                    self._counts["missed"] += missed
        with self._lock:
            self._next_seq = seq + 1
        events = self._decode(payload)
        if events is not None:
            self._apply(events)
            applied += 1
        return applied

    def _replay(self, start: int, stop: int) -> int:
        """Ask the replay endpoint for batches `start..stop-1` and apply those it has, in order.

        The answer streams every buffered batch from `start` on; newer ones than `stop - 1` arrive on the
        subscription too and are skipped here. Silence for `replay_timeout_s` ends the replay.
        """
        if self.replay_endpoint is None:
            return 0
        dealer = self._replay_socket()
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            self.failures.count("replay_unavailable", f"cannot send to {self.replay_endpoint}")
            return 0
        applied, want = 0, start
        while True:
            if not dealer.poll(self._replay_timeout_ms):
                self.failures.count("replay_timeout", f"replay silent for {self._replay_timeout_ms} ms")
                self._drop_replay_socket()
                break
            frames = dealer.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.failures.count("replay_malformed", f"replay answer of {len(frames)} frames")
                self._drop_replay_socket()
                break
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == _END_SEQ:
                break
            if want <= seq < stop:
                want = seq + 1
                events = self._decode(frames[2])
                if events is not None:
                    self._apply(events)
                    applied += 1
        with self._lock:
            self._counts["replayed"] += applied
        return applied

    def _replay_socket(self) -> zmq.Socket:
        if self._dealer is None:
            assert self.replay_endpoint is not None
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._dealer.connect(self.replay_endpoint)
        return self._dealer

    def _drop_replay_socket(self) -> None:
        """A replay that did not end leaves answers in flight: a fresh socket keeps them out of the next one."""
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _decode(self, payload: bytes) -> list[_Event] | None:
        """The batch's events, or None (counted) when the payload is not a batch; bad events are skipped."""
        try:
            raw = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            self.failures.count("payload", f"not msgpack: {exc}")
            return None
        raw_events = _batch_events(raw)
        if raw_events is None:
            self.failures.count("batch", f"not a KVEventBatch: {type(raw).__name__}")
            return None
        events = []
        for raw_event in raw_events:
            try:
                events.append(_parse_event(raw_event))
            except _Malformed as exc:
                self.failures.count(exc.kind, exc)
        return events

    def _clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bloom.clear()

    def _apply(self, events: list[_Event]) -> None:
        with self._lock:
            blocks, bloom = self._blocks, self._bloom
            for event in events:
                if event.tag == "AllBlocksCleared":
                    blocks.clear()
                    bloom.clear()
                elif event.tag == "BlockStored":
                    for block in event.hashes:
                        key = (block, event.medium, event.group)
                        if key in blocks:
                            blocks.move_to_end(key)
                            continue
                        blocks[key] = None
                        bloom.add(block)
                        if len(blocks) > self._max_blocks:
                            (oldest, _, _), _ = blocks.popitem(last=False)
                            bloom.remove(oldest)
                            self._counts["evicted"] += 1
                    if event.block_size is not None:
                        self._block_size = event.block_size
                else:
                    for block in event.hashes:
                        key = (block, event.medium, event.group)
                        if key in blocks:
                            del blocks[key]
                            bloom.remove(block)
            self._counts["batches"] += 1
            self._counts["events"] += len(events)


def _batch_events(raw: Any) -> list[Any] | None:
    """The events of a batch, array-encoded `[ts, events, ...]` or map-encoded `{"ts", "events", ...}`."""
    events = raw[1] if isinstance(raw, list) and len(raw) >= 2 else raw.get("events") if isinstance(raw, dict) else None
    return events if isinstance(events, list) else None


def _parse_event(raw: Any) -> _Event:
    """One event, tagged array or tagged map, checked for the fields the agent uses."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _FIELDS.get(tag)
        if names is None:
            raise _Malformed("unknown_event", f"unknown event {tag!r}")
        fields: dict[str, Any] = dict(zip(names, raw[1:]))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag = raw["type"]
        if tag not in _FIELDS:
            raise _Malformed("unknown_event", f"unknown event {tag!r}")
        fields = raw
    else:
        raise _Malformed("event", f"not a tagged event: {type(raw).__name__}")
    if tag == "AllBlocksCleared":
        return _Event(tag, [], None, None, None)
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list) or not all(_is_hash(h) for h in hashes):
        raise _Malformed("event", f"{tag}: block_hashes is not a list of ints or bytes")
    medium, group, size = fields.get("medium"), fields.get("group_idx"), fields.get("block_size")
    if not (medium is None or isinstance(medium, str)) or not (group is None or _is_int(group)):
        raise _Malformed("event", f"{tag}: medium or group_idx of the wrong type")
    if tag == "BlockStored" and not (_is_int(size) and size > 0):
        raise _Malformed("event", f"BlockStored: block_size {size!r} is not a positive int")
    return _Event(tag, [block_key(h) for h in hashes], medium, group, size if tag == "BlockStored" else None)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value: object) -> bool:
    return _is_int(value) or isinstance(value, bytes)
