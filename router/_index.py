"""Which nodes hold which prompt blocks: the router's view of every engine's prefix cache.

Two sources fill it. The engines' KV events, relayed by the agents and the brain (`stored`, `removed`,
`reset`, `drop`), say what each node's cache holds. Between a placement and the events that confirm it (the
engine publishes a block once it has prefilled it, seconds later under load), the router's own placements
(`placed`) stand in for them, each for `placed_ttl_s`: the second request of a burst that shares a prefix
follows the first one instead of being spread before the cache exists. An event that removes a block clears
the placement's claim on it too.

Blocks are the prompt's chained block hashes (`block_hashes`): a block's hash names the whole prefix up to
it, so an engine can reuse block `i` only when it holds blocks `0..i-1` too. `match` relies on that: it
finds each node's leading run of held blocks by binary search (a node that holds block `i` is taken to hold
the ones before it), a handful of lookups for a prompt of any length. The rare node that evicted an inner
block while keeping a later one is credited with more than its engine will reuse until the events catch up.

The tables live in C (`_fastroute.BlockIndex`) where the extension is built: a million cached blocks take about
32 MiB there, against several hundred MiB of Python dicts and sets, and `match` does its binary searches without
creating Python objects. The pure-Python tables below are the fallback for builds without a C compiler; both
implement the semantics above exactly (tests/test_router_index.py runs them side by side).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

try:
    from . import _fastroute as fastroute
except ImportError:  # no C compiler at install: the pure-Python tables
    fastroute = None  # type: ignore[assignment]

PLACED_TTL_S = 30.0
MAX_PLACED = 1_000_000
"""Blocks the router's own placements may claim at once; past it the oldest claims are dropped."""


class PrefixIndex:
    """Block hash → the nodes whose prefix cache holds it, from KV events and this router's placements.

    Block hashes are ints in [0, 2**64) (the C tables raise TypeError or OverflowError for anything else); node
    ids are str. Every method is safe to call from several threads.
    """

    __slots__ = ("_tables",)

    def __init__(self, placed_ttl_s: float = PLACED_TTL_S, max_placed: int = MAX_PLACED) -> None:
        if placed_ttl_s < 0 or max_placed < 0:
            raise ValueError("placed_ttl_s and max_placed must not be negative")
        tables = _PyTables if fastroute is None else fastroute.BlockIndex
        self._tables: _PyTables | fastroute.BlockIndex = tables(placed_ttl_s, max_placed)

    @property
    def placed_ttl_s(self) -> float:
        """How long a placement's claims stand in for the events (fixed at construction)."""
        return self._tables.placed_ttl_s

    @property
    def max_placed(self) -> int:
        """Blocks placements may claim at once (fixed at construction)."""
        return self._tables.max_placed

    def stored(self, node: str, blocks: Iterable[int]) -> None:
        """The node's engine cached `blocks`."""
        self._tables.stored(node, blocks)

    def removed(self, node: str, blocks: Iterable[int]) -> None:
        """The node's engine evicted `blocks`: neither its events nor this router's placements claim them."""
        self._tables.removed(node, blocks)

    def reset(self, node: str, blocks: Iterable[int]) -> None:
        """The node's whole cache is `blocks` (a snapshot, or an engine that restarted with an empty cache).

        The blocks it held before lose their claims too, as if removed; claims on blocks it did not hold stay.
        """
        self._tables.reset(node, blocks)

    def drop(self, node: str) -> None:
        """Forget a node that left the cluster: its blocks and its claims."""
        self._tables.drop(node)

    def placed(self, node: str, blocks: Sequence[int], now: float) -> None:
        """This router sent a prompt of `blocks` to `node` at `now`: claim them there for `placed_ttl_s`.

        A claim holds while `now` is before its end; a later placement of the same block on the same node
        renews it. Claims are dropped lazily: here, those past their end (oldest first), then the oldest
        placements while more than `max_placed` blocks are claimed.
        """
        self._tables.placed(node, blocks, now)

    def match(self, blocks: Sequence[int], now: float) -> dict[str, int]:
        """Per node holding the prompt's first block: how many of its leading blocks the node holds."""
        return self._tables.match(blocks, now)

    def size(self, node: str) -> int:
        """Blocks the node's events say it holds."""
        return self._tables.size(node)

    def __len__(self) -> int:
        """Distinct blocks some node's events say it holds."""
        return len(self._tables)


class _PyTables:
    """`PrefixIndex`'s tables in Python: dicts of sets. Reads (`match`) take no lock: each lookup reads one
    dict entry, which CPython keeps consistent while another thread writes; writers serialise on a lock."""

    def __init__(self, placed_ttl_s: float, max_placed: int) -> None:
        self.placed_ttl_s = placed_ttl_s
        self.max_placed = max_placed
        self._held: dict[int, set[str]] = {}
        self._sizes: dict[str, int] = {}
        self._placed: dict[int, dict[str, float]] = {}  # block -> node -> until
        self._claims: deque[tuple[float, str, Sequence[int]]] = deque()
        self._claimed = 0
        self._lock = threading.Lock()

    # --- from the engines' events --------------------------------------------------------------------------

    def stored(self, node: str, blocks: Iterable[int]) -> None:
        with self._lock:
            held = self._held
            added = 0
            for block in blocks:
                holders = held.get(block)
                if holders is None:
                    held[block] = {node}
                    added += 1
                elif node not in holders:
                    holders.add(node)
                    added += 1
            if added:
                self._sizes[node] = self._sizes.get(node, 0) + added

    def removed(self, node: str, blocks: Iterable[int]) -> None:
        with self._lock:
            self._remove(node, blocks)

    def reset(self, node: str, blocks: Iterable[int]) -> None:
        with self._lock:
            self._forget(node)
            self._sizes.pop(node, None)
        self.stored(node, blocks)

    def drop(self, node: str) -> None:
        with self._lock:
            self._forget(node)
            self._sizes.pop(node, None)
            for block in [b for b, claims in self._placed.items() if node in claims]:
                self._unclaim(block, node)

    def _remove(self, node: str, blocks: Iterable[int]) -> None:
        held = self._held
        gone = 0
        for block in blocks:
            holders = held.get(block)
            if holders is not None and node in holders:
                gone += 1
                if len(holders) == 1:
                    del held[block]
                else:
                    holders.discard(node)
            self._unclaim(block, node)
        if gone:
            self._sizes[node] -= gone

    def _forget(self, node: str) -> None:
        if self._sizes.get(node):
            self._remove(node, [b for b, holders in self._held.items() if node in holders])

    def _unclaim(self, block: int, node: str) -> None:
        claims = self._placed.get(block)
        if claims is not None and claims.pop(node, None) is not None and not claims:
            del self._placed[block]

    # --- from this router's placements ---------------------------------------------------------------------

    def placed(self, node: str, blocks: Sequence[int], now: float) -> None:
        if not blocks or not self.placed_ttl_s or not self.max_placed:
            return
        until = now + self.placed_ttl_s
        with self._lock:
            self._expire(now)
            for block in blocks:
                self._placed.setdefault(block, {})[node] = until
            self._claims.append((until, node, blocks))
            self._claimed += len(blocks)
            while self._claimed > self.max_placed:
                self._drop_claim()

    def _expire(self, now: float) -> None:
        while self._claims and self._claims[0][0] <= now:
            self._drop_claim()

    def _drop_claim(self) -> None:
        until, node, blocks = self._claims.popleft()
        self._claimed -= len(blocks)
        for block in blocks:
            claims = self._placed.get(block)
            if claims is not None and claims.get(node) == until:
                del claims[node]
                if not claims:
                    del self._placed[block]

    # --- reading -----------------------------------------------------------------------------------------

    def match(self, blocks: Sequence[int], now: float) -> dict[str, int]:
        if not blocks:
            return {}
        held, placed = self._held, self._placed

        def holds(node: str, block: int) -> bool:
            holders = held.get(block)
            if holders is not None and node in holders:
                return True
            claims = placed.get(block)
            until = None if claims is None else claims.get(node)
            return until is not None and until > now

        first = blocks[0]
        nodes = set(held.get(first, ()))
        claims = placed.get(first)
        if claims:
            nodes.update(node for node, until in list(claims.items()) if until > now)
        depths: dict[str, int] = {}
        last = len(blocks)
        for node in nodes:
            low, high = 1, last  # holds blocks[:low]; the answer is within [low, high]
            while low < high:
                mid = (low + high + 1) >> 1
                if holds(node, blocks[mid - 1]):
                    low = mid
                else:
                    high = mid - 1
            depths[node] = low
        return depths

    def size(self, node: str) -> int:
        return self._sizes.get(node, 0)

    def __len__(self) -> int:
        return len(self._held)
