"""Routing tables on the wire as per-slice deltas after a snapshot, so an update's size follows what changed.

The brain's `TableEncoder` turns each new `RoutingTable` into one `SliceUpdate` per slice that changed
(entries added or changed, entries removed; in parts of at most MAX_UPDATE_ENTRIES) followed by a small
`TableHead` naming the version every slice is at. Slice updates go out on their own topic
(`prism.slice/<name>/`), so a router that routes only some slices subscribes to those alone.

The router's `TableAssembler` (one per brain) applies the updates to its copy of each slice and, when a head
arrives whose slice versions its copies match, gives back the whole `RoutingTable`. A copy that missed an
update (a dropped message, a late start) cannot match: the head is then reported as a gap and the router asks
that brain for a snapshot (the head and every wanted slice's full state, `base_version` 0), as in ZeroMQ's
clone pattern. A full state replaces the copy whatever it held, which is also how a restarted brain's first
table, whose versions start again, is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ._codec import MAX_TABLE_BYTES, decode, encode
from ._exceptions import OversizedError
from ._messages import (
    MAX_UPDATE_ENTRIES,
    EntryRef,
    RoutingTable,
    SliceHead,
    SliceTable,
    SliceUpdate,
    TableHead,
    TableNode,
)

EntryKey = tuple[str, int | None]
Frames = list[bytes]


def entry_key(node: TableNode | EntryRef) -> EntryKey:
    return (node.node_id, node.gpu)


def _sort_key(key: EntryKey) -> tuple[str, int]:
    """Entries in the brain's order: by node, the whole-node entry before its GPUs."""
    return (key[0], -1 if key[1] is None else key[1])


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)] or [[]]


_TABLE_WIDE = tuple(f.name for f in msgspec.structs.fields(TableHead) if f.name != "slices")
"""What a head carries of its table, taken from the table and given back to it: every field but the slices."""


def _table_wide(message: RoutingTable | TableHead) -> dict[str, Any]:
    return {name: getattr(message, name) for name in _TABLE_WIDE}


def _head(table: RoutingTable, versions: dict[str, int]) -> TableHead:
    return TableHead(
        **_table_wide(table),
        slices=[
            SliceHead(name=s.name, version=versions[s.name], entries=len(s.nodes), fallback=s.fallback)
            for s in table.slices
        ],
    )


def _updates(
    brain: RoutingTable | TableHead,
    version: int,
    name: str,
    base_version: int,
    upserts: list[TableNode],
    removes: list[EntryRef],
    chunk: int,
) -> list[SliceUpdate]:
    """One slice's change to `version` (its full state when `base_version` is 0) in parts of at most `chunk`
    upserts and `chunk` removals each; `brain` names the brain and epoch."""
    upsert_parts, removal_parts = _chunks(upserts, chunk), _chunks(removes, chunk)
    count = max(len(upsert_parts), len(removal_parts))
    upsert_parts += [[] for _ in range(count - len(upsert_parts))]
    removal_parts += [[] for _ in range(count - len(removal_parts))]
    return [
        SliceUpdate(
            brain_id=brain.brain_id,
            epoch=brain.epoch,
            version=version,
            slice=name,
            base_version=base_version,
            part=i,
            parts=count,
            upserts=part,
            removes=removal,
        )
        for i, (part, removal) in enumerate(zip(upsert_parts, removal_parts, strict=True))
    ]


@dataclass
class _Published:
    version: int
    entries: dict[EntryKey, TableNode]
    full: list[Frames] | None = None  # encoded full state, made when a snapshot first asks for it


class TableEncoder:
    """Brain side: the messages that carry each new table, and snapshots of the current one.

    `update` checks every message it makes the way a router will decode it and raises the `WireError` a
    router would, leaving the published state as it was, so a table routers would refuse is never half sent.
    """

    def __init__(self, chunk_entries: int = MAX_UPDATE_ENTRIES) -> None:
        if not 1 <= chunk_entries <= MAX_UPDATE_ENTRIES:
            raise ValueError(f"chunk_entries must be 1 to {MAX_UPDATE_ENTRIES}, got {chunk_entries}")
        self._chunk = chunk_entries
        self._slices: dict[str, _Published] = {}
        self._epoch: int | None = None
        self.head: TableHead | None = None
        self._head_frames: Frames = []

    def update(self, table: RoutingTable) -> list[Frames]:
        """The slice updates then the head that take a router from the last table to `table`."""
        if len({s.name for s in table.slices}) != len(table.slices):
            raise ValueError("a slice appears twice in the table")
        same_epoch = self._epoch == table.epoch
        slices: dict[str, _Published] = {}
        messages: list[Frames] = []
        for slice_table in table.slices:
            entries = {entry_key(node): node for node in slice_table.nodes}
            if len(entries) != len(slice_table.nodes):
                raise ValueError(f"slice {slice_table.name!r} lists an entry twice")
            before = self._slices.get(slice_table.name) if same_epoch else None
            if before is not None and before.entries == entries:
                slices[slice_table.name] = before
                continue
            if before is None:
                base, upserts, removes = 0, list(entries.values()), []
            else:
                base = before.version
                upserts = [n for key, n in entries.items() if before.entries.get(key) != n]
                removes = [EntryRef(node_id=k[0], gpu=k[1]) for k in before.entries if k not in entries]
            messages.extend(
                _fitted(
                    lambda chunk: _updates(table, table.version, slice_table.name, base, upserts, removes, chunk),
                    self._chunk,
                )
            )
            slices[slice_table.name] = _Published(table.version, entries)
        head = _head(table, {name: published.version for name, published in slices.items()})
        head_frames = _checked(head, None)
        messages.append(head_frames)
        self._slices, self._epoch, self.head, self._head_frames = slices, table.epoch, head, head_frames
        return messages

    def snapshot(self, wanted: Collection[str] | None) -> list[Frames]:
        """The full state of the wanted slices (all when None) then the head; nothing before a first table."""
        if self.head is None:
            return []
        messages: list[Frames] = []
        for name, published in self._slices.items():
            if wanted is not None and name not in wanted:
                continue
            if published.full is None:
                head = self.head
                nodes = list(published.entries.values())
                published.full = _fitted(
                    lambda chunk: _updates(head, published.version, name, 0, nodes, [], chunk), self._chunk
                )
            messages.extend(published.full)
        messages.append(self._head_frames)
        return messages


def _fitted(make: Callable[[int], list[SliceUpdate]], chunk: int) -> list[Frames]:
    """One slice's update in parts of `chunk` entries, or of fewer where entries are so long (labels of up to
    256 characters) that a part would pass the frame limit: each part is checked as a router decodes it."""
    while True:
        try:
            return [_checked(update, update.slice) for update in make(chunk)]
        except OversizedError:
            if chunk == 1:
                raise
            chunk = max(1, chunk // 2)


def _checked(message: SliceUpdate | TableHead, topic: str | None) -> Frames:
    frames = encode(message, topic=topic)
    decode(frames, (type(message),), MAX_TABLE_BYTES)
    return frames


@dataclass
class _Copy:
    """A router's copy of one slice of one brain's table."""

    epoch: int
    version: int
    entries: dict[EntryKey, TableNode]
    table: SliceTable | None = None  # the materialised slice, made once per version and fallback


@dataclass
class _Pending:
    """Parts of one slice update seen so far."""

    parts: int
    received: dict[int, SliceUpdate] = field(default_factory=dict)


class TableAssembler:
    """Router side, one per brain: slice copies kept current by updates, whole tables made from heads.

    `wanted` names the slices this router routes (None: all); others are neither kept nor put in tables.
    """

    MAX_PENDING = 64

    def __init__(self, wanted: Collection[str] | None = None) -> None:
        self.wanted = None if wanted is None else frozenset(wanted)
        self._copies: dict[str, _Copy] = {}
        self._pending: dict[tuple[str, int, int, int], _Pending] = {}
        self.gaps = 0

    def wants(self, name: str) -> bool:
        return self.wanted is None or name in self.wanted

    def slice_update(self, update: SliceUpdate, *, snapshot: bool = False) -> None:
        """Take one part of a slice update; the update applies when its last part has come. A `snapshot` answer's
        full state older than the copy held (same epoch, lower version) is dropped: it was asked for before the
        stream brought the copy past it, and taking it would set the copy back, so that the stream's next head
        would find a gap. (A brain restarted without its state starts its versions again: the subscriber has the
        copies past its new order forgotten when it sees the restart, `forget_after`.)"""
        if not self.wants(update.slice):
            return
        held = self._copies.get(update.slice)
        if snapshot and held is not None and held.epoch == update.epoch and held.version > update.version:
            return
        if update.parts == 1:
            self._apply([update])
            return
        key = (update.slice, update.epoch, update.version, update.base_version)
        pending = self._pending.get(key)
        if pending is None or pending.parts != update.parts:
            while len(self._pending) >= self.MAX_PENDING:  # parts of updates that never completed
                del self._pending[next(iter(self._pending))]
            pending = self._pending[key] = _Pending(update.parts)
        pending.received[update.part] = update
        if len(pending.received) == pending.parts:
            del self._pending[key]
            self._apply([pending.received[i] for i in range(pending.parts)])

    def forget_after(self, order: tuple[int, int]) -> None:
        """Drop the copies newer than (epoch, version) `order`: the brain went back to it (restarted without its
        state), so what it said after it is void, and its snapshots of lower versions are to be taken again."""
        for name in [n for n, c in self._copies.items() if (c.epoch, c.version) > order]:
            del self._copies[name]

    def _apply(self, parts: list[SliceUpdate]) -> None:
        first = parts[0]
        upserts: Iterable[TableNode] = (node for part in parts for node in part.upserts)
        if first.base_version == 0:
            self._copies[first.slice] = _Copy(first.epoch, first.version, {entry_key(n): n for n in upserts})
            return
        copy = self._copies.get(first.slice)
        if copy is None or copy.epoch != first.epoch or copy.version != first.base_version:
            return  # not the state this delta was made against: the head will show the gap
        entries = dict(copy.entries)
        for part in parts:
            for ref in part.removes:
                entries.pop(entry_key(ref), None)
        entries.update((entry_key(n), n) for n in upserts)
        self._copies[first.slice] = _Copy(first.epoch, first.version, entries)

    def head(self, head: TableHead) -> RoutingTable | None:
        """The whole table `head` completes, or None (a gap: ask for a snapshot) when a wanted slice's copy is
        not at the version the head names."""
        slices: list[SliceTable] = []
        for slice_head in head.slices:
            if not self.wants(slice_head.name):
                continue
            copy = self._copies.get(slice_head.name)
            if (
                copy is None
                or copy.epoch != head.epoch
                or copy.version != slice_head.version
                or len(copy.entries) != slice_head.entries
            ):
                self.gaps += 1
                return None
            if copy.table is None or copy.table.fallback != slice_head.fallback:
                nodes = [copy.entries[key] for key in sorted(copy.entries, key=_sort_key)]
                copy.table = SliceTable(name=slice_head.name, nodes=nodes, fallback=slice_head.fallback)
            slices.append(copy.table)
        return RoutingTable(**_table_wide(head), slices=slices)
