"""Weighted consistent hashing: a ring built once per table, then looked up without locks."""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Sequence

from prismlb.wire import TableNode


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Ring:
    """An immutable weighted consistent-hash ring over one slice's nodes.

    A node of weight w gets `max(1, round(base_points * w))` points, so its points depend on its own
    weight alone: adding, removing or reweighting one node moves only keys to or from that node.
    """

    __slots__ = ("_nodes", "_owners", "_points")

    _points: list[int]
    _owners: list[TableNode]
    _nodes: tuple[TableNode, ...]

    @classmethod
    def build(cls, nodes: Sequence[TableNode], base_points: int = 128) -> Ring:
        """Validate `nodes` (non-empty, unique ids, weights in (0, 1]) and lay out their points.

        Raises ValueError for nodes that do not form a valid ring.
        """
        if not nodes:
            raise ValueError("a ring needs at least one node")
        if base_points < 1:
            raise ValueError(f"base_points must be at least 1, got {base_points}")
        seen: set[str] = set()
        placed: list[tuple[int, str, TableNode]] = []
        for node in nodes:
            if node.node_id in seen:
                raise ValueError(f"node id {node.node_id!r} appears more than once")
            seen.add(node.node_id)
            if not 0.0 < node.weight <= 1.0:
                raise ValueError(f"node {node.node_id!r} has weight {node.weight}, outside (0, 1]")
            count = max(1, round(base_points * node.weight))
            placed.extend((_hash(f"{node.node_id}#{i}".encode()), node.node_id, node) for i in range(count))
        placed.sort(key=lambda p: (p[0], p[1]))
        ring = cls.__new__(cls)
        ring._points = [point for point, _, _ in placed]
        ring._owners = [node for _, _, node in placed]
        ring._nodes = tuple(nodes)
        return ring

    @property
    def nodes(self) -> tuple[TableNode, ...]:
        """The nodes the ring was built from, in the order given."""
        return self._nodes

    def lookup(self, key: str | bytes) -> TableNode:
        """The owner of the first point at or after the key's hash, wrapping to the first point."""
        data = key.encode() if isinstance(key, str) else key
        index = bisect_left(self._points, _hash(data))
        return self._owners[index if index < len(self._points) else 0]

    def __repr__(self) -> str:
        return f"Ring({len(self._nodes)} nodes, {len(self._points)} points)"
