"""The cluster's prefix index on the wire: agents' KV changes to the brain, the brain's deltas to the routers.

Agents send `KvBlocks` (their engine's Prism block hashes stored and removed) over the PUSH connection they send
vectors on; the brain's `KvRelay` keeps each node's set and forwards every accepted change at once as a `KvDelta`
on the table PUB socket, under its own topic, so routers that do not keep an index never receive them. A router
follows the deltas of the brain whose tables it follows (`KvFollower`), by the brain's sequence numbers; a lost
delta, a late start or a new leader makes it ask that brain's snapshot socket for the whole index (`KvDelta`
resets per node, then `KvSnapshotEnd`), as the clone pattern does for tables. Meanwhile it keeps what it has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._messages import MAX_KV_BLOCKS, KvBlocks, KvDelta, KvSnapshotEnd


def split_kv_changes(
    node_id: str,
    first_seq: int,
    *,
    reset: bool,
    stored: Sequence[int],
    removed: Sequence[int],
    block_size: int | None,
    chunk: int = MAX_KV_BLOCKS,
) -> list[KvBlocks]:
    """One node's change as `KvBlocks` of at most `chunk` hashes each, numbered from `first_seq`.

    A reset larger than one message is marked on its first part only; the others are plain `stored` parts, so a
    receiver that loses one sees a sequence gap rather than a short set. Removals go first: they all belong to
    a delta, which removes before it stores. No change at all (and no reset) is no message."""
    if not 1 <= chunk <= MAX_KV_BLOCKS:
        raise ValueError(f"chunk must be 1 to {MAX_KV_BLOCKS}, got {chunk}")
    if not reset and not stored and not removed:
        return []
    hashes = [(False, h) for h in removed] + [(True, h) for h in stored]
    parts = [hashes[i : i + chunk] for i in range(0, len(hashes), chunk)] or [[]]
    return [
        KvBlocks(
            node_id=node_id,
            seq=first_seq + i,
            reset=reset and i == 0,
            block_size_tokens=block_size,
            stored=[h for is_stored, h in part if is_stored],
            removed=[h for is_stored, h in part if not is_stored],
        )
        for i, part in enumerate(parts)
    ]


KvApply = Callable[[str, bool, Sequence[int], Sequence[int], int | None], None]
"""(node_id, reset, stored, removed, block_size): what a router does with one node's change (reset: `stored` is the
set; block_size: the tokens per block of the node's KV events, None when unknown)."""


@dataclass
class KvFollowerStats:
    """A `KvFollower`'s counts since it was made."""

    deltas: int = 0
    """Deltas applied, live or from the buffer after a snapshot."""
    gaps: int = 0
    """Times a delta did not follow the last one (lost, or from a restarted brain): each asks for a snapshot."""
    snapshots: int = 0
    """Snapshots taken."""
    buffer_dropped: int = 0
    """Deltas dropped because too many arrived while a snapshot was awaited (the snapshot is asked again)."""


class KvFollower:
    """Router side: one brain's delta stream applied in order, snapshots when it cannot be.

    It follows one (brain_id, epoch) at a time, set by `follow`. Deltas are applied while their seq follows the
    last one; a skip, an epoch change or a new brain makes `wants_snapshot` true. While a snapshot is awaited
    deltas are buffered (at most `max_buffer`, the excess dropped and counted); the snapshot's resets are applied
    as they come, and its end applies the buffered deltas that come after it and clears the nodes it does not name.
    Runs on the subscriber loop's thread only."""

    def __init__(self, apply: KvApply, *, max_buffer: int = 10_000) -> None:
        self._apply = apply
        self._max_buffer = max_buffer
        self.brain_id: str | None = None
        self.epoch: int | None = None
        self.next_seq: int | None = None
        self.wants_snapshot = False
        self._buffer: list[KvDelta] = []
        self._overflowed = False
        self.nodes: set[str] = set()
        """Nodes whose blocks this follower put in the index (cleared when a snapshot leaves them out)."""
        self.stats = KvFollowerStats()

    def follow(self, brain_id: str) -> None:
        """Follow `brain_id`'s stream (a no-op when already following it): its snapshot is needed first."""
        if brain_id != self.brain_id:
            self.brain_id, self.epoch, self.next_seq = brain_id, None, None
            self._await()

    def _await(self) -> None:
        self.wants_snapshot = True
        self._buffer.clear()
        self._overflowed = False

    def delta(self, delta: KvDelta) -> None:
        """A live delta from the PUB socket."""
        if delta.brain_id != self.brain_id:
            return
        if self.wants_snapshot:
            if len(self._buffer) < self._max_buffer:
                self._buffer.append(delta)
            else:
                self._overflowed = True
                self.stats.buffer_dropped += 1
            return
        if delta.epoch != self.epoch or delta.seq != self.next_seq:  # lost, or a brain restarted (seq went back)
            self.stats.gaps += 1
            self._await()
            self._buffer.append(delta)
            return
        self._take(delta)

    def _take(self, delta: KvDelta) -> None:
        self._apply(delta.node_id, delta.reset, delta.stored, delta.removed, delta.block_size_tokens)
        self.nodes.add(delta.node_id)
        self.next_seq = delta.seq + 1
        self.stats.deltas += 1

    def snapshot_part(self, delta: KvDelta) -> None:
        """One node's reset (or a later part of it) from the snapshot socket; ignored unless one is awaited."""
        if self.wants_snapshot and delta.brain_id == self.brain_id:
            self._apply(delta.node_id, delta.reset, delta.stored, (), delta.block_size_tokens)
            self.nodes.add(delta.node_id)

    def snapshot_end(self, end: KvSnapshotEnd) -> None:
        """The snapshot is complete as of `end.seq`: clear the nodes it left out, then go on from there."""
        if not self.wants_snapshot or end.brain_id != self.brain_id:
            return
        listed = set(end.nodes)
        for node in self.nodes - listed:
            self._apply(node, True, (), (), None)
        self.nodes = listed
        self.epoch, self.next_seq = end.epoch, end.seq + 1
        self.wants_snapshot = False
        self.stats.snapshots += 1
        buffered, overflowed = self._buffer, self._overflowed
        self._buffer, self._overflowed = [], False
        if overflowed:  # what came after the buffer filled is lost: ask again
            self.stats.gaps += 1
            self._await()
            return
        for delta in buffered:
            if delta.epoch != end.epoch or delta.seq > end.seq:  # the others were in the snapshot
                self.delta(delta)
