"""Subscriber to an engine's KV-cache events (vLLM's ZeroMQ publisher): the node's cached blocks as a Bloom summary,
and as Prism block hashes for the routers' cache index.

Wire format (vLLM `vllm/distributed/kv_events.py`): each message is three frames, topic, sequence number
(8 bytes, big-endian) and a msgpack `KVEventBatch` `[ts, events, data_parallel_rank]`. Events are tagged
msgspec structs: a tagged array `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, extra_keys, group_idx, ...]` up to vLLM 0.23, a map `{"type": "BlockStored", ...}` after
(vLLM #42892); both are read, fields a newer version appends are ignored. Block hashes are ints or bytes.

Data parallelism: each DP rank of an engine has a KV pool and a publisher of its own, rank r bound to the
configured endpoint's port + r, its replay endpoint likewise (vLLM's `offset_endpoint_port`; SGLang copies it).
With `dp_ranks` the subscriber follows ranks 0 to `dp_ranks - 1` from the endpoint it is given, one SUB socket
each, so that the socket a batch came in on names its rank (the batch's `data_parallel_rank` is the engine's
global rank, not the offset from this node's first one). Sequence numbers, gaps, replay and restarts are per rank;
the blocks of every rank make up the node's set.

A sequence number past the rank's expected one is a gap: the subscriber asks the rank's replay endpoint (vLLM's
ROUTER) for the missed batches over a DEALER socket (`["", start_seq]`; answers `["", seq, payload]`, ending with
seq -1 and an empty payload) and applies them in order; what replay cannot give is counted, and the subscriber
goes on. On joining late it asks for everything from 0 the same way. A sequence number that goes back means the
rank's publisher restarted: its cache is empty, so its blocks are forgotten, as on its AllBlocksCleared.

A block is one (DP rank, hash, medium, KV-cache group): a block offloaded to CPU still counts as held by the node,
and so does a block that two ranks hold until both dropped it. The set keeps at most `max_blocks` (about 300
bytes each) over all ranks, evicting the oldest stored first.

Prism hashes. The engine's block hashes depend on its hash seed, so a router cannot compute them from a prompt.
Each stored block is therefore re-hashed with Prism's chain (`prismlb.router.block_hash`): its parent's Prism
hash (`parent_block_hash` looked up among the blocks its rank holds; None is the root, chain value 0), its `block_size`
token ids (`token_ids` holds the event's blocks' tokens in order) and its vLLM `extra_keys` (LoRA name,
multimodal content ids, cache salt), so that `block_hashes(tokens, block_size, extra=...)` computed by a caller
names the same blocks. A block whose engine hash is already held keeps the Prism hash it has (vLLM's CPU
offloading reports blocks without tokens or parent). A block whose parent is not held (the agent joined late,
the parent was evicted) or whose tokens do not line up (`token_ids` not exactly `block_size` per block, as for
a sliding-window group, whose null blocks vLLM leaves out of `block_hashes` only) cannot be re-hashed: it is
counted in `unhashable_blocks`, kept in the Bloom summary, and left out of the Prism view, and so are the blocks
chained after it in the same event. Malformed `token_ids`, `extra_keys` or `parent_block_hash` are counted in
`failures` too; the event's engine hashes are kept all the same.

The Prism view is drained with `take_changes()`: the Prism hashes stored and removed since the last drain,
coalesced (a hash stored then removed, or removed then stored, between two drains is in neither), or a reset
carrying the whole set when the whole set was cleared (AllBlocksCleared or publisher restart without data
parallelism; with it, the rank's blocks are removed one by one), on the first drain, and when more than
`max_blocks` changes piled up. `blocks()` is the whole set, for snapshots.

Threading: `start()` runs `poll()` in a background thread until `stop()`; without `start()` the owner calls
`poll(timeout_ms)` itself, from one thread. `summary()`, `stats()`, `take_changes()`, `blocks()` and
`block_size` may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple, Self, TypeGuard

import msgspec
import zmq

from prismlb.router import block_hash
from prismlb.semantics import BLOOM_BITS, BLOOM_HASHES, CountingBloom, block_key
from prismlb.wire import KvSummary, RejectCounter

_log = logging.getLogger("prism.agent.kv_events")

MAX_BLOCKS = 131_072
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_MAX_MESSAGES_PER_POLL = 10_000
_END_SEQ = -1
_MISSING = object()

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


_Key = tuple[int, bytes, str | None, int | None]
"""A block as the agent keeps it: DP rank (0 without data parallelism), engine hash (`block_key`), medium and
KV-cache group."""


class _Event(NamedTuple):
    tag: str
    hashes: list[bytes]
    medium: str | None
    group: int | None
    block_size: int | None
    parent: bytes | None = None
    """BlockStored: the engine hash of the block before the first (None: the first is the root)."""
    tokens: array[int] | None = None
    """BlockStored: `block_size` token ids per block, in order; None when they cannot be used for re-hashing."""
    extra: list[Any] | None = None
    """BlockStored: the extra keys of each block (vLLM's `extra_keys`), None when there are none."""
    problem: tuple[str, str] | None = None
    """A malformed field that keeps the event's blocks from being re-hashed (failure kind, detail)."""


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
    last_seqs: tuple[int | None, ...]
    """The last sequence number applied of each DP rank (None: nothing from it yet)."""
    unhashable_blocks: int
    """Stored blocks left out of the Prism view: parent not held, tokens missing or malformed."""
    prism_blocks: int
    """Distinct Prism hashes held (a block held on GPU and CPU, in two groups or by two ranks, counts once)."""

    @property
    def last_seq(self) -> int | None:
        """Rank 0's last sequence number: the only rank's without data parallelism."""
        return self.last_seqs[0]


_COUNTERS = ("batches", "events", "replayed_batches", "missed_batches", "evicted_blocks", "unhashable_blocks")
"""The fields of `KvEventStats` the subscriber counts as it goes; the others it reads off its state."""


@dataclass(frozen=True)
class KvChanges:
    """What changed in the node's Prism block set since the last `take_changes()`.

    A consumer keeping the set applies `removed` and `stored` (no hash is in both); on `reset` it first drops what
    it held for the node, then `stored` is the whole set. `block_size` is the engine's tokens per block (the
    `block_size` callers must hash prompts with), None until a block was stored.
    """

    reset: bool
    stored: tuple[int, ...]
    removed: tuple[int, ...]
    block_size: int | None


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where DP rank `rank` publishes when rank 0 publishes at `endpoint`: the port plus the rank, as vLLM offsets
    it; ValueError when that is not a tcp:// endpoint with a port in range."""
    if rank == 0:
        return endpoint
    base, colon, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not colon or not port.isdigit():
        raise ValueError(f"{endpoint!r}: DP ranks publish on ports after rank 0's, so it must be tcp://HOST:PORT")
    if int(port) + rank > 65535:
        raise ValueError(f"{endpoint!r}: DP rank {rank} would publish on port {int(port) + rank}, past 65535")
    return f"{base}:{int(port) + rank}"


class _Rank:
    """One DP rank's publisher as followed: its subscription, its replay socket and the sequence it is at."""

    def __init__(self, index: int, endpoint: str, replay_endpoint: str | None, sub: zmq.Socket) -> None:
        self.index, self.endpoint, self.replay_endpoint, self.sub = index, endpoint, replay_endpoint, sub
        self.next_seq: int | None = None
        """The sequence number expected next (None: nothing received yet); written under the subscriber's lock."""
        self.dealer: zmq.Socket | None = None

    def where(self) -> str:
        """How failures name the rank."""
        return f"DP rank {self.index} ({self.endpoint})"


class KvEventSubscriber:
    """Keeps the set of KV blocks an engine holds, from its events; `summary()` is what goes to the brain.

    `endpoint` and `replay_endpoint` are rank 0's; with `dp_ranks` above 1, ranks up to `dp_ranks - 1` are
    followed on the ports after them (ValueError when the endpoints cannot be offset, see `rank_endpoint`).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        *,
        dp_ranks: int = 1,
        max_blocks: int = MAX_BLOCKS,
        replay_timeout_s: float = 1.0,
        bloom_bits: int = BLOOM_BITS,
        bloom_hashes: int = BLOOM_HASHES,
        context: zmq.Context | None = None,
    ) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, not {max_blocks}")
        if dp_ranks < 1:
            raise ValueError(f"dp_ranks must be at least 1, not {dp_ranks}")
        endpoints = [rank_endpoint(endpoint, rank) for rank in range(dp_ranks)]
        replays = [None if replay_endpoint is None else rank_endpoint(replay_endpoint, r) for r in range(dp_ranks)]
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        ranks = f" and the {dp_ranks - 1} DP ranks after it" if dp_ranks > 1 else ""
        self.failures = RejectCounter(f"KV events from {endpoint}{ranks}", _log)
        self._max_blocks = max_blocks
        self._replay_timeout_ms = max(1, round(replay_timeout_s * 1000))
        self._ctx = context if context is not None else zmq.Context.instance()
        self._decoder = msgspec.msgpack.Decoder()
        self._lock = threading.Lock()
        self._blocks: OrderedDict[_Key, int | None] = OrderedDict()
        """Blocks held, oldest stored first, each with its Prism hash (None: not re-hashable)."""
        self._bloom = CountingBloom(bloom_bits, bloom_hashes)
        self._prism_of: dict[tuple[int, bytes], tuple[int, int]] = {}
        """(DP rank, engine hash) -> (Prism hash, blocks in `_blocks` holding it): for parents and blocks stored
        again. Per rank: each rank chains its own blocks, and may hash with a seed of its own."""
        self._held: dict[int, int] = {}
        """Prism hash -> blocks in `_blocks` holding it: the Prism set, with what it takes to leave it."""
        self._changes: dict[int, bool] = {}
        """Prism hashes stored (True) or removed (False) since the last take, in order of application."""
        self._reset = True
        """The next take is a reset: the set was cleared, the changes overflowed, or none was taken yet."""
        self._block_size: int | None = None
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._ranks: list[_Rank] = []
        self._poller = zmq.Poller()
        for rank, (rank_pub, rank_replay) in enumerate(zip(endpoints, replays, strict=True)):
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sub.setsockopt(zmq.SUBSCRIBE, topic)
            sub.connect(rank_pub)
            self._ranks.append(_Rank(rank, rank_pub, rank_replay, sub))
            self._poller.register(sub, zmq.POLLIN)

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
        for rank in self._ranks:
            rank.sub.close(linger=0)
            self._drop_replay_socket(rank)

    close = stop

    def poll(self, timeout_ms: int) -> int:
        """Wait up to `timeout_ms` for events, apply every batch waiting on every rank; returns the batches
        applied."""
        ready = dict(self._poller.poll(timeout_ms))
        applied = 0
        for rank in self._ranks:
            if rank.sub not in ready:
                continue
            for _ in range(_MAX_MESSAGES_PER_POLL):
                try:
                    frames = rank.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                applied += self._on_message(rank, frames)
        return applied

    def summary(self) -> KvSummary | None:
        """The cached blocks as a Bloom filter (empty when none); None until the first batch of any rank arrived."""
        with self._lock:
            if all(rank.next_seq is None for rank in self._ranks):
                return None
            return KvSummary(
                blocks=len(self._blocks),
                bloom=self._bloom.bits() if self._blocks else b"",
                bloom_hashes=self._bloom.k,
                block_size_tokens=self._block_size,
            )

    def stats(self) -> KvEventStats:
        with self._lock:
            return KvEventStats(
                **self._counts,
                blocks=len(self._blocks),
                last_seqs=tuple(None if r.next_seq is None else r.next_seq - 1 for r in self._ranks),
                prism_blocks=len(self._held),
            )

    def take_changes(self, full: bool = False) -> KvChanges:
        """The Prism hashes stored and removed since the last take (a reset with the whole set, see `KvChanges`);
        with `full`, a reset whatever changed (taken under the same lock as the changes, so that the changes of
        later takes apply exactly on top of it: `blocks()` then `take_changes()` could not promise that).

        Changes are kept as one entry per hash, so they never outgrow `max_blocks`: past that, the take becomes a
        reset, which is the whole set and so no larger.
        """
        with self._lock:
            if self._reset or full:
                changes = KvChanges(True, tuple(self._held), (), self._block_size)
            else:
                stored = tuple(h for h, held in self._changes.items() if held)
                removed = tuple(h for h, held in self._changes.items() if not held)
                changes = KvChanges(False, stored, removed, self._block_size)
            self._reset = False
            self._changes.clear()
            return changes

    def blocks(self) -> tuple[int, ...]:
        """The Prism hashes of the blocks the node holds now, for a snapshot; `take_changes()` is not affected."""
        with self._lock:
            return tuple(self._held)

    @property
    def block_size(self) -> int | None:
        """Tokens per block of the last block stored (what callers hash prompts with); None before any."""
        with self._lock:
            return self._block_size

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.poll(100)
            except zmq.ContextTerminated:
                return

    def _on_message(self, rank: _Rank, frames: list[bytes]) -> int:
        if len(frames) != 3:
            self.failures.count("frames", f"{rank.where()}: {len(frames)} frames, not 3 (topic, seq, payload)")
            return 0
        _, seq_bytes, payload = frames
        if len(seq_bytes) != 8:
            self.failures.count("seq", f"{rank.where()}: sequence frame of {len(seq_bytes)} bytes, not 8")
            return 0
        seq = int.from_bytes(seq_bytes, "big")
        expected = rank.next_seq
        applied = 0
        if expected is not None and seq < expected:
            self.failures.count("publisher_restart", f"{rank.where()}: sequence went back from {expected - 1} to {seq}")
            self._clear(rank.index)
            expected = None
        if expected is None:
            if seq > 0:
                applied += self._replay(rank, 0, seq)
            _log.info("KV events from %s: first batch seq %d, %d earlier batches replayed", rank.where(), seq, applied)
        elif seq > expected:
            replayed = self._replay(rank, expected, seq)
            applied += replayed
            missed = seq - expected - replayed
            if missed:
                self.failures.count("gap", f"{rank.where()}: batches {expected}..{seq - 1} missed, {replayed} replayed")
                with self._lock:
                    self._counts["missed_batches"] += missed
        with self._lock:
            rank.next_seq = seq + 1
        events = self._decode(payload)
        if events is not None:
            self._apply(rank.index, events)
            applied += 1
        return applied

    def _replay(self, rank: _Rank, start: int, stop: int) -> int:
        """Ask the rank's replay endpoint for batches `start..stop-1` and apply those it has, in order.

        The answer streams every buffered batch from `start` on; newer ones than `stop - 1` arrive on the
        subscription too and are skipped here. Silence for `replay_timeout_s` ends the replay.
        """
        if rank.replay_endpoint is None:
            return 0
        dealer = self._replay_socket(rank, rank.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            self.failures.count("replay_unavailable", f"cannot send to {rank.replay_endpoint}")
            return 0
        applied, want = 0, start
        while True:
            if not dealer.poll(self._replay_timeout_ms):
                self.failures.count(
                    "replay_timeout", f"{rank.replay_endpoint}: replay silent for {self._replay_timeout_ms} ms"
                )
                self._drop_replay_socket(rank)
                break
            frames = dealer.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.failures.count(
                    "replay_malformed", f"{rank.replay_endpoint}: replay answer of {len(frames)} frames"
                )
                self._drop_replay_socket(rank)
                break
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == _END_SEQ:
                break
            if want <= seq < stop:
                want = seq + 1
                events = self._decode(frames[2])
                if events is not None:
                    self._apply(rank.index, events)
                    applied += 1
        with self._lock:
            self._counts["replayed_batches"] += applied
        return applied

    def _replay_socket(self, rank: _Rank, replay_endpoint: str) -> zmq.Socket:
        if rank.dealer is None:
            rank.dealer = self._ctx.socket(zmq.DEALER)
            rank.dealer.setsockopt(zmq.LINGER, 0)
            rank.dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            rank.dealer.connect(replay_endpoint)
        return rank.dealer

    def _drop_replay_socket(self, rank: _Rank) -> None:
        """A replay that did not end leaves answers in flight: a fresh socket keeps them out of the next one."""
        if rank.dealer is not None:
            rank.dealer.close(linger=0)
            rank.dealer = None

    def _decode(self, payload: bytes) -> list[_Event] | None:
        """The batch's events, or None (counted) when the payload is not a batch; bad events are skipped."""
        try:
            raw = self._decoder.decode(payload)
        except (msgspec.DecodeError, RecursionError) as exc:  # msgspec's answer to arrays nested ~1,000 deep
            self.failures.count("payload", f"not msgpack: {exc}")
            return None
        raw_events = _batch_events(raw)
        if raw_events is None:
            self.failures.count("batch", f"not a KVEventBatch: {type(raw).__name__}")
            return None
        events = []
        for raw_event in raw_events:
            try:
                event = _parse_event(raw_event)
            except _Malformed as exc:
                self.failures.count(exc.kind, exc)
                continue
            if event.problem is not None:
                self.failures.count(*event.problem)
            events.append(event)
        return events

    def _clear(self, rank: int) -> None:
        with self._lock:
            self._clear_locked(rank)

    def _clear_locked(self, rank: int) -> None:
        """Forget the rank's blocks (lock held). Without data parallelism that is every block, forgotten at once,
        and the next take is a reset; the other ranks' blocks stay, and the rank's leave as removals."""
        if len(self._ranks) == 1:
            self._blocks.clear()
            self._bloom.clear()
            self._prism_of.clear()
            self._held.clear()
            self._changes.clear()
            self._reset = True
            return
        for key in [key for key in self._blocks if key[0] == rank]:
            self._drop(key, self._blocks.pop(key))

    def _apply(self, rank: int, events: list[_Event]) -> None:
        with self._lock:
            for event in events:
                if event.tag == "AllBlocksCleared":
                    self._clear_locked(rank)
                elif event.tag == "BlockStored":
                    self._store(rank, event)
                else:
                    for block in event.hashes:
                        key = (rank, block, event.medium, event.group)
                        if key in self._blocks:
                            self._drop(key, self._blocks.pop(key))
            self._counts["batches"] += 1
            self._counts["events"] += len(events)

    def _store(self, rank: int, event: _Event) -> None:
        """Add a BlockStored's blocks, each with its Prism hash when it can be had (lock held)."""
        blocks = self._blocks
        size = event.block_size
        assert size is not None
        prism: int | None = 0 if event.parent is None else self._prism_hash(rank, event.parent)
        for i, block in enumerate(event.hashes):
            parent, prism = prism, self._prism_hash(rank, block)
            if prism is None and parent is not None and event.tokens is not None:
                extra = event.extra[i] if event.extra is not None else None
                try:
                    prism = block_hash(parent, event.tokens[i * size : (i + 1) * size], extra or ())
                except ValueError as exc:
                    self.failures.count("extra_keys", f"BlockStored: {exc}")
            key = (rank, block, event.medium, event.group)
            if prism is None:
                self._counts["unhashable_blocks"] += 1
            if key in blocks:
                blocks.move_to_end(key)
                if blocks[key] is None and prism is not None:
                    blocks[key] = prism
                    self._hold(rank, block, prism)
            else:
                blocks[key] = prism
                self._bloom.add(block)
                if prism is not None:
                    self._hold(rank, block, prism)
                if len(blocks) > self._max_blocks:
                    oldest, oldest_prism = blocks.popitem(last=False)
                    self._drop(oldest, oldest_prism)
                    self._counts["evicted_blocks"] += 1
        self._block_size = size

    def _prism_hash(self, rank: int, block: bytes) -> int | None:
        held = self._prism_of.get((rank, block))
        return None if held is None else held[0]

    def _hold(self, rank: int, block: bytes, prism: int) -> None:
        """Count one more block holding `prism` (lock held)."""
        _, refs = self._prism_of.get((rank, block), (prism, 0))
        self._prism_of[rank, block] = (prism, refs + 1)
        held = self._held.get(prism, 0)
        self._held[prism] = held + 1
        if not held:
            self._note(prism, True)

    def _drop(self, key: _Key, prism: int | None) -> None:
        """Take a block out of the Bloom filter and the Prism view, `key` already out of `_blocks` (lock held)."""
        engine = key[:2]
        self._bloom.remove(key[1])
        if prism is None:
            return
        _, refs = self._prism_of[engine]
        if refs > 1:
            self._prism_of[engine] = (prism, refs - 1)
        else:
            del self._prism_of[engine]
        held = self._held[prism] - 1
        if held:
            self._held[prism] = held
        else:
            del self._held[prism]
            self._note(prism, False)

    def _note(self, prism: int, held: bool) -> None:
        """Record that `prism` entered or left the set; a change that undoes a pending one cancels it (lock held).

        A hash enters and leaves in turn, so a pending entry for it is always the opposite change.
        """
        if self._reset:
            return
        if prism in self._changes:
            del self._changes[prism]
        else:
            self._changes[prism] = held
            if len(self._changes) > self._max_blocks:
                self._changes.clear()
                self._reset = True


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
    keys = [block_key(h) for h in hashes]
    if tag == "BlockRemoved":
        return _Event(tag, keys, medium, group, None)
    if not (_is_int(size) and size > 0):
        raise _Malformed("event", f"BlockStored: block_size {size!r} is not a positive int")
    return _stored(keys, medium, group, size, fields)


def _stored(keys: list[bytes], medium: str | None, group: int | None, size: int, fields: dict[str, Any]) -> _Event:
    """A BlockStored with what re-hashing needs; a field it cannot use leaves `tokens` None (and, when the field
    is malformed rather than absent or misaligned, a `problem` to count) but keeps the event."""
    parent, tokens, extra = fields.get("parent_block_hash", _MISSING), fields.get("token_ids"), fields.get("extra_keys")
    event = _Event("BlockStored", keys, medium, group, size)
    if parent is not None and not _is_hash(parent):
        return event._replace(problem=("parent_block_hash", f"BlockStored: parent_block_hash {parent!r:.40}"))
    if not isinstance(tokens, list):
        return event._replace(problem=("token_ids", f"BlockStored: token_ids is a {type(tokens).__name__}"))
    try:
        token_ids = array("I", tokens)
    except (OverflowError, TypeError):
        return event._replace(problem=("token_ids", "BlockStored: token_ids are not all ints in [0, 2**32)"))
    if not (extra is None or (isinstance(extra, list) and len(extra) == len(keys))):
        return event._replace(problem=("extra_keys", "BlockStored: extra_keys is not one entry per block"))
    if extra is not None and not all(block_keys is None or isinstance(block_keys, list) for block_keys in extra):
        return event._replace(problem=("extra_keys", "BlockStored: a block's extra_keys is not an array"))
    parent_key = None if parent is None else block_key(parent)
    # Tokens that are not exactly one block's worth per block cannot be lined up with the blocks.
    aligned = token_ids if len(token_ids) == len(keys) * size else None
    return event._replace(parent=parent_key, tokens=aligned, extra=extra)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value: object) -> bool:
    return _is_int(value) or isinstance(value, bytes)
