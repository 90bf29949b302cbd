"""Weighted consistent hashing: a ring built once per table, then looked up without locks."""

from __future__ import annotations

import hashlib
import threading
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prismlb.semantics import numa_factor
from prismlb.wire import TableNode

from ._keys import position

_INDEX_BITS = 20  # entries per ring: a fleet of 20,000 eight-GPU hosts fits with room


def label(node: TableNode) -> str:
    """A table entry's identity on the ring: the node id, or `node/gpuN` for one GPU of a node."""
    return node.node_id if node.gpu is None else f"{node.node_id}/gpu{node.gpu}"


def entry_numa_factor(node: TableNode, caller_numa: int | None) -> float:
    """`semantics.numa_factor` for a per-GPU entry; a whole-node entry always weighs 1.0."""
    return 1.0 if node.gpu is None else numa_factor(caller_numa, node.numa_node)


_POINTS: OrderedDict[str, array[int]] = OrderedDict()
_POINTS_KEPT = 1 << 23
"""Ring points `_points` keeps (32 MiB at 4 bytes a point), least recently used entries dropped first: eight
rings of `Settings.max_ring_points`, every entry of the largest fleet a ring indexes."""
_points_held = 0


def _points(entry: str, count: int) -> array[int]:
    """The ring positions of an entry's first `count` points: the first 32 bits of blake2b(`entry#i`).

    An entry's points for fewer are a prefix of its points for more, so each entry keeps one array, grown when its
    weight asks for more. Weights move with every table and entries come and go with the fleet: a cache keyed by
    (entry, count) would keep a tuple of Python ints per weight an entry ever had, up to a gigabyte in a router
    that runs for weeks. Called under `_LAYOUTS_LOCK`."""
    global _points_held
    known = _POINTS.get(entry)
    if known is None:
        known = _POINTS[entry] = array("I")
    else:
        _POINTS.move_to_end(entry)
    if len(known) < count:
        _points_held += count - len(known)
        known.extend(
            int.from_bytes(hashlib.blake2b(f"{entry}#{i}".encode(), digest_size=4).digest(), "big")
            for i in range(len(known), count)
        )
    while _points_held > _POINTS_KEPT and len(_POINTS) > 1:
        _points_held -= len(_POINTS.popitem(last=False)[1])
    return known[:count]


def bucket_index(points: Sequence[int], owners: Sequence[int]) -> tuple[int, list[int | None]]:
    """(shift, slots), a constant-time index of a ring whose sorted `points` are owned by `owners`.

    The 32-bit ring space is cut into 2^k buckets, at least 8 per point; `slots[pos >> shift]` is the owner
    of every position in the bucket when no point falls inside it, else None (then bisect `points`).
    """
    bits = max(8, (8 * len(points) - 1).bit_length())
    shift = max(0, 32 - bits)
    slots: list[int | None] = []
    previous = -1
    for point, owner in zip(points, owners, strict=True):
        bucket = point >> shift
        if bucket != previous:
            slots.extend([owner] * (bucket - previous - 1))  # buckets before this point's: owned by this point
            slots.append(None)
            previous = bucket
    slots.extend([owners[0]] * ((1 << (32 - shift)) - previous - 1))  # past the last point: wraps to the first
    return shift, slots


@dataclass(frozen=True, slots=True)
class _Layout:
    points: list[int]
    owners: list[int]
    shift: int
    slots: list[int | None]


_LAYOUTS: OrderedDict[tuple[tuple[str, int], ...], _Layout] = OrderedDict()
_LAYOUTS_KEPT = 8
_LAYOUTS_LOCK = threading.Lock()


def _layout(counts: tuple[tuple[str, int], ...]) -> _Layout:
    """The ring of entries given as (label, points) in label order, built once per process and shared by every
    ring with the same points: routers in one process, and tables that change only loads, versions or addresses.
    Builds hold a process-wide lock (they never run on the routing path), so concurrent routers build once."""
    with _LAYOUTS_LOCK:
        layout = _LAYOUTS.get(counts)
        if layout is not None:
            _LAYOUTS.move_to_end(counts)
            return layout
        packed = sorted(
            point << _INDEX_BITS | index for index, (name, count) in enumerate(counts) for point in _points(name, count)
        )
        mask = (1 << _INDEX_BITS) - 1
        points = [p >> _INDEX_BITS for p in packed]
        owners = [p & mask for p in packed]
        shift, slots = bucket_index(points, owners)
        layout = _LAYOUTS[counts] = _Layout(points, owners, shift, slots)
        if len(_LAYOUTS) > _LAYOUTS_KEPT:
            _LAYOUTS.popitem(last=False)
        return layout


class Ring:
    """An immutable weighted consistent-hash ring over one slice's entries.

    An entry of effective weight w (its table weight times its NUMA factor) gets `max(1, round(base_points * w))`
    points, so its points depend on its own weight alone: adding, removing or reweighting one entry moves only
    keys to or from that entry. Shares follow weights as in nginx (`weight=2` takes twice `weight=1`'s keys).

    Entries are kept sorted by label; `points` (sorted) and `owners` (entry index of each point) are the ring,
    and `slots[pos >> shift]` (`bucket_index`) its constant-time index. Callers may inline the lookup.
    """

    __slots__ = ("entries", "labels", "owners", "points", "shift", "slots", "weights")

    entries: tuple[TableNode, ...]
    labels: tuple[str, ...]
    weights: tuple[float, ...]
    points: list[int]
    owners: list[int]
    shift: int
    slots: list[int | None]

    @classmethod
    def build(
        cls,
        nodes: Sequence[TableNode],
        base_points: int = 128,
        *,
        numa_node: int | None = None,
        max_points: int | None = None,
    ) -> Ring:
        """Validate `nodes` (non-empty, unique labels, weights in (0, 1]) and lay out their points.

        `numa_node` is the caller's NUMA node, for the weight factor of GPU entries. With `max_points`, a ring
        that would have more points has every entry's points scaled down by the same factor (as Envoy's ring
        hash caps its ring size): shares still follow weights, and only a change of the ring's total across the
        cap moves keys between unchanged entries. Raises ValueError for nodes that do not form a valid ring.
        """
        if not nodes:
            raise ValueError("a ring needs at least one node")
        if base_points < 1:
            raise ValueError(f"base_points must be at least 1, got {base_points}")
        if len(nodes) >= 1 << _INDEX_BITS:
            raise ValueError(f"a ring holds fewer than {1 << _INDEX_BITS} entries, got {len(nodes)}")
        by_label: dict[str, TableNode] = {}
        for node in nodes:
            name = label(node)
            if name in by_label:
                raise ValueError(f"node id {name!r} appears more than once")
            if not 0.0 < node.weight <= 1.0:
                raise ValueError(f"node {name!r} has weight {node.weight}, outside (0, 1]")
            by_label[name] = node
        ring = cls.__new__(cls)
        ring.labels = tuple(sorted(by_label))
        ring.entries = tuple(by_label[name] for name in ring.labels)
        ring.weights = tuple(node.weight * entry_numa_factor(node, numa_node) for node in ring.entries)
        scale = float(base_points)
        if max_points is not None and scale * sum(ring.weights) > max_points:
            scale = max_points / sum(ring.weights)
        layout = _layout(
            tuple((name, max(1, round(scale * w))) for name, w in zip(ring.labels, ring.weights, strict=True))
        )
        ring.points, ring.owners, ring.shift, ring.slots = layout.points, layout.owners, layout.shift, layout.slots
        return ring

    @property
    def nodes(self) -> tuple[TableNode, ...]:
        """The entries, sorted by label."""
        return self.entries

    def index(self, pos: int) -> int:
        """The point index owning ring position `pos`: the first point at or after it, wrapping to 0."""
        i = bisect_left(self.points, pos)
        return i if i < len(self.points) else 0

    def owner(self, pos: int) -> int:
        """The index of the entry owning ring position `pos`."""
        index = self.slots[pos >> self.shift]
        return self.owners[self.index(pos)] if index is None else index

    def lookup(self, key: str | bytes | int) -> TableNode:
        """The entry that owns `key`."""
        return self.entries[self.owner(position(key))]

    def probe(self, start: int) -> Iterator[int]:
        """Entry indices in probe order from point index `start`: each entry once, in ring order."""
        owners = self.owners
        seen: set[int] = set()
        remaining = len(self.entries)
        i = start
        while remaining:
            owner = owners[i]
            if owner not in seen:
                seen.add(owner)
                remaining -= 1
                yield owner
            i += 1
            if i == len(owners):
                i = 0

    def __repr__(self) -> str:
        return f"Ring({len(self.entries)} nodes, {len(self.points)} points)"
