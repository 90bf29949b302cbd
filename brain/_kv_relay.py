"""The brain's relay of the engines' KV caches: agents' `KvBlocks` in, routers' `KvDelta`s out, at once.

Each accepted `KvBlocks` becomes one `KvDelta` published in the same turn of the brain's loop, not at the next table
cycle: a cached prefix is worth the most to the requests that follow it within the second. The relay keeps every
node's current set, only to answer routers' snapshots (late joiners, routers that lost a delta).

An agent numbers its messages (`KvBlocks.seq`, +1 each). One that comes early is held until the ones before it
arrive, for `REORDER_S` at most (the sharded ingest can reorder them). When one is missing past that (dropped by a
full queue) or the numbers go back (the agent restarted), the brain no longer knows the node's set: it tells the
routers the set is empty (a reset with no blocks: routers fall back to their own placements for that node) and
ignores the node's changes until its next reset, which agents send at start and every `kv_full_every_s`. A node
that leaves the brain's registry (stale, drained) is dropped the same way, once it has had `grace_s` to send its
first vector (an agent's KV stream can start before its first vector arrives).

Bounded: at most `max_blocks` hashes over all nodes and `max_nodes` nodes. A change that would pass either is
refused and counted (`overflow`), and the node's set is unknown until a reset that fits.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prismlb.service import kind_counter
from prismlb.wire import MAX_KV_DELTA_BLOCKS, KvBlocks, KvDelta, KvSnapshotEnd, encode

_log = logging.getLogger("prism.brain.kv")

MAX_BLOCKS = 4_000_000
"""Hashes held over all nodes (about 60 bytes each in Python sets: 250 MB at most)."""
MAX_NODES = 100_000
"""Nodes held: a snapshot's end names them all, in 13 MB at most, under the 16 MiB table frame limit."""
GRACE_S = 10.0
REORDER_MAX = 16
REORDER_S = 0.5
"""A node's messages may come out of order (the sharded ingest's workers, `_shards`): up to this many that come
early are held for up to this long for the ones before them, before those count as lost."""


@dataclass
class _Node:
    blocks: set[int]
    next_seq: int | None
    """The agent seq expected next; None: the set is unknown until the agent's next reset."""
    first_heard: float
    block_size: int | None = None
    early: dict[int, tuple[float, KvBlocks]] = field(default_factory=dict)
    """Messages that came ahead of `next_seq` (by seq: when, message), held until the ones before them come."""


class KvRelay:
    """Every node's Prism block set, kept from its agent's `KvBlocks`, forwarded to routers as `KvDelta`s.

    `accept` and `retain` return the deltas to publish (numbered by `seq`, +1 each, within `epoch`); `snapshot`
    is the whole index as snapshot messages, consistent with the last delta returned. Single-threaded: the
    brain's loop calls everything."""

    def __init__(
        self,
        brain_id: str,
        epoch: int,
        *,
        max_blocks: int = MAX_BLOCKS,
        max_nodes: int = MAX_NODES,
        grace_s: float = GRACE_S,
        snapshot_chunk: int = MAX_KV_DELTA_BLOCKS,
    ) -> None:
        if max_blocks < 1 or max_nodes < 1 or not 1 <= snapshot_chunk <= MAX_KV_DELTA_BLOCKS:
            raise ValueError("max_blocks, max_nodes and snapshot_chunk must be positive (snapshot_chunk bounded)")
        self.brain_id, self.epoch = brain_id, epoch
        self.max_blocks, self.max_nodes, self.grace_s = max_blocks, max_nodes, grace_s
        self._chunk = snapshot_chunk
        self._nodes: dict[str, _Node] = {}
        self.total = 0
        """Hashes held over all nodes."""
        self.seq = 0
        """The last delta's number (0: none yet)."""
        self._snapshot: tuple[int, list[list[bytes]]] | None = None  # (seq, messages): reused until the next delta
        self.counts = {
            "messages": 0,  # KvBlocks applied
            "lost": 0,  # KvBlocks missing from agents' sequences
            "restarts": 0,  # agents' sequences that went back
            "awaiting_reset": 0,  # KvBlocks ignored because the node's set is unknown until a reset
            "overflow": 0,  # changes refused because they would pass max_blocks or max_nodes
            "dropped_nodes": 0,  # nodes dropped because they left the registry
            "deltas": 0,  # KvDeltas published
            "reordered": 0,  # KvBlocks that came ahead of their node's next one and were held
            "late": 0,  # KvBlocks that came after a later one had been applied, dropped
        }

    @property
    def nodes(self) -> int:
        return len(self._nodes)

    def blocks(self, node_id: str) -> frozenset[int] | None:
        """The node's set as the relay holds it; None when the node is not held."""
        node = self._nodes.get(node_id)
        return None if node is None else frozenset(node.blocks)

    def accept(self, messages: Collection[KvBlocks], now: float) -> list[KvDelta]:
        """Apply the agents' messages in order; the deltas routers need for them."""
        out: list[KvDelta] = []
        for message in messages:
            self._accept(message, now, out)
        return out

    def _accept(self, message: KvBlocks, now: float, out: list[KvDelta]) -> None:
        """One message in its node's order: one that comes early is held (`REORDER_MAX`, `REORDER_S`) until the
        ones before it arrive, and one that comes late after that is dropped."""
        node = self._nodes.get(message.node_id)
        expected = None if node is None else node.next_seq
        if node is not None and expected is not None:
            if not message.reset and expected < message.seq and len(node.early) < REORDER_MAX:
                node.early[message.seq] = (now, message)
                self.counts["reordered"] += 1
                return
            if not message.reset and expected - REORDER_MAX <= message.seq < expected:
                self.counts["late"] += 1
                return
        self._apply(message, node, now, out)
        node = self._nodes.get(message.node_id)
        while node is not None and node.next_seq is not None and node.next_seq in node.early:
            _, held = node.early.pop(node.next_seq)
            self._apply(held, node, now, out)
        if node is not None and node.early:
            node.early = {} if node.next_seq is None else {s: m for s, m in node.early.items() if s > node.next_seq}

    def _apply(self, message: KvBlocks, node: _Node | None, now: float, out: list[KvDelta]) -> None:
        if message.reset:
            if node is not None and node.next_seq is not None and message.seq != node.next_seq:
                self._note_skip(node, message)
            self._reset(message, node, now, out)
            return
        if node is None or node.next_seq is None:
            self.counts["awaiting_reset"] += 1
            return
        if message.seq != node.next_seq:
            self._note_skip(node, message)
            self._unknown(message.node_id, node, out)
            return
        node.next_seq += 1
        removed = [h for h in dict.fromkeys(message.removed) if h in node.blocks]
        node.blocks.difference_update(removed)
        self.total -= len(removed)
        stored = [h for h in dict.fromkeys(message.stored) if h not in node.blocks]
        if self.total + len(stored) > self.max_blocks:
            self.counts["overflow"] += 1
            _log.warning(
                "KV index full (%d blocks): node %s's set is unknown until its next reset", self.total, message.node_id
            )
            self._unknown(message.node_id, node, out)
            return
        node.blocks.update(stored)
        self.total += len(stored)
        self.counts["messages"] += 1
        changed_size = message.block_size_tokens is not None and message.block_size_tokens != node.block_size
        if message.block_size_tokens is not None:
            node.block_size = message.block_size_tokens
        if stored or removed or changed_size:
            out.append(self._delta(message.node_id, False, stored, removed, node.block_size))

    def _note_skip(self, node: _Node, message: KvBlocks) -> None:
        assert node.next_seq is not None
        if message.seq < node.next_seq:
            self.counts["restarts"] += 1
        else:
            self.counts["lost"] += message.seq - node.next_seq

    def _reset(self, message: KvBlocks, node: _Node | None, now: float, out: list[KvDelta]) -> None:
        blocks = set(message.stored)
        held = 0 if node is None else len(node.blocks)
        if self.total - held + len(blocks) > self.max_blocks or (node is None and len(self._nodes) >= self.max_nodes):
            self.counts["overflow"] += 1
            _log.warning(
                "KV index full (%d blocks, %d nodes): node %s's reset refused", self.total, self.nodes, message.node_id
            )
            if node is not None:
                self._unknown(message.node_id, node, out)
            return
        if node is None:
            node = self._nodes[message.node_id] = _Node(set(), None, now)
        self.total += len(blocks) - held
        node.blocks, node.next_seq = blocks, message.seq + 1
        if message.block_size_tokens is not None:
            node.block_size = message.block_size_tokens
        self.counts["messages"] += 1
        out.append(self._delta(message.node_id, True, list(blocks), [], node.block_size))

    def _unknown(self, node_id: str, node: _Node, out: list[KvDelta]) -> None:
        """The node's set is unknown until its agent's next reset: empty it here and at the routers."""
        self.total -= len(node.blocks)
        node.blocks, node.next_seq = set(), None
        out.append(self._delta(node_id, True, [], [], node.block_size))

    def retain(self, live: Collection[str], now: float) -> list[KvDelta]:
        """Drop the nodes not in `live` (the registry's, less drained ones) heard first more than `grace_s` ago,
        and give up on messages missing for more than `REORDER_S` (the node's set is then unknown until its next
        reset, as after any lost message)."""
        out: list[KvDelta] = []
        for node_id, node in self._nodes.items():
            if node.early and node.next_seq is not None and min(t for t, _ in node.early.values()) < now - REORDER_S:
                self.counts["lost"] += min(node.early) - node.next_seq
                node.early = {}
                self._unknown(node_id, node, out)
        for node_id in [
            n for n, node in self._nodes.items() if n not in live and now - node.first_heard > self.grace_s
        ]:
            node = self._nodes.pop(node_id)
            self.total -= len(node.blocks)
            self.counts["dropped_nodes"] += 1
            out.append(self._delta(node_id, True, [], [], None))
        return out

    def _delta(self, node_id: str, reset: bool, stored: list[int], removed: list[int], size: int | None) -> KvDelta:
        """The next delta (its number taken, and counted)."""
        self.seq += 1
        self.counts["deltas"] += 1
        return self._message(node_id, reset, stored, removed, size)

    def _message(self, node_id: str, reset: bool, stored: list[int], removed: list[int], size: int | None) -> KvDelta:
        """A delta of this relay's brain and epoch at the current number: a new one, or a part of the snapshot."""
        return KvDelta(
            brain_id=self.brain_id,
            epoch=self.epoch,
            seq=self.seq,
            node_id=node_id,
            reset=reset,
            block_size_tokens=size,
            stored=stored,
            removed=removed,
        )

    def snapshot(self) -> list[list[bytes]]:
        """The whole index as of delta `seq`: per node a reset (in parts past `snapshot_chunk` hashes, the later
        ones plain stored), then the end naming every node. Made once per delta number, then reused."""
        if self._snapshot is not None and self._snapshot[0] == self.seq:
            return self._snapshot[1]
        messages: list[list[bytes]] = []
        for node_id, node in self._nodes.items():
            blocks = list(node.blocks)
            for i in range(0, max(1, len(blocks)), self._chunk):
                part = blocks[i : i + self._chunk]
                messages.append(encode(self._message(node_id, i == 0, part, [], node.block_size)))
        messages.append(
            encode(KvSnapshotEnd(brain_id=self.brain_id, epoch=self.epoch, seq=self.seq, nodes=list(self._nodes)))
        )
        self._snapshot = (self.seq, messages)
        return messages


class KvRelayCollector(Collector):
    """The relay's counters and size on /metrics."""

    def __init__(self, relay: KvRelay) -> None:
        self._relay = relay

    def collect(self) -> Iterator[Metric]:
        yield kind_counter("prism_brain_kv", "KV relay events by kind (see brain/_kv_relay.py)", self._relay.counts)
        yield GaugeMetricFamily(
            "prism_brain_kv_blocks", "Prism block hashes held over all nodes", value=self._relay.total
        )
        yield GaugeMetricFamily("prism_brain_kv_nodes", "Nodes whose KV blocks are held", value=self._relay.nodes)
