"""Versioned routing tables: a new version only when routing changes beyond a threshold.

A table holds all four slices in `Slice` order; an empty slice names its fallback (`_slices.fallback`).
A new version is issued when any entry joins, leaves or changes its endpoint, zone, model version or NUMA
node, when a fallback, the experiments or the guardian's flags change, or when any weight moves at least
`weight_threshold` (one weight step, 0.05) from the value last published. Load and predicted P99 ride along
with the next table but never cause one by themselves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from prismlb.wire import Experiment, RoutingTable, Slice, SliceTable, TableNode

from ._slices import fallback

WEIGHT_THRESHOLD = 0.05

_Identity = tuple[str, int | None, str, str, str, int | None]


def _identity(node: TableNode) -> _Identity:
    return (node.node_id, node.gpu, node.endpoint, node.zone, node.model_version, node.numa_node)


def next_epoch(state_dir: Path | None) -> int:
    """A brain epoch greater than any earlier one: wall-clock seconds, or the persisted epoch + 1 if larger."""
    epoch = int(time.time())
    if state_dir is None:
        return epoch
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "epoch"
    try:
        epoch = max(epoch, int(path.read_text().strip()) + 1)
    except (FileNotFoundError, ValueError):
        pass
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{epoch}\n")
    os.replace(tmp, path)
    return epoch


class TableBuilder:
    """Turns per-slice entries into versioned tables; `build` returns None when routing did not change enough."""

    def __init__(self, epoch: int, weight_threshold: float = WEIGHT_THRESHOLD) -> None:
        self.epoch = epoch
        self.version = 0
        self.weight_threshold = weight_threshold
        self._routing: tuple[object, ...] | None = None
        self._weights: dict[tuple[Slice, _Identity], float] = {}

    def build(
        self,
        entries: Mapping[Slice, Sequence[TableNode]],
        *,
        experiments: Sequence[Experiment] = (),
        shed_classes: Sequence[str] = (),
        guardian: str = "normal",
    ) -> RoutingTable | None:
        """The next table from `compute_weights`-style entries (a missing slice is empty), or None."""
        slices = {s: list(entries.get(s, ())) for s in Slice}
        nonempty = {s for s, nodes in slices.items() if nodes}
        fallbacks = {s: None if s in nonempty else fallback(s, nonempty) for s in Slice}
        weights = {(s, _identity(n)): n.weight for s, nodes in slices.items() for n in nodes}
        routing = (frozenset(weights), fallbacks, tuple(experiments), tuple(shed_classes), guardian)
        if routing == self._routing and not self._moved(weights):
            return None
        self._routing, self._weights = routing, weights
        self.version += 1
        return RoutingTable(
            epoch=self.epoch,
            version=self.version,
            issued_unix_s=time.time(),
            slices=[SliceTable(name=s.value, nodes=slices[s], fallback=fallbacks[s]) for s in Slice],
            experiments=list(experiments),
            shed_classes=list(shed_classes),
            guardian=guardian,
        )

    def _moved(self, weights: Mapping[tuple[Slice, _Identity], float]) -> bool:
        return any(round(abs(w - self._weights[key]), 9) >= self.weight_threshold for key, w in weights.items())
