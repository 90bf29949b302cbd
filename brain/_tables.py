"""Routing tables from the registry: a new version only when membership or a published weight changes."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from prismlb.wire import RoutingTable, SliceTable, TableNode

from ._registry import NodeState

DEFAULT_SLICE = "default"


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
    """Turns node states into versioned tables; `build` returns None when nothing routing-relevant changed."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.version = 0
        self._last: tuple[tuple[str, str, float, str], ...] | None = None

    def build(self, nodes: Mapping[str, NodeState]) -> RoutingTable | None:
        entries = tuple(
            sorted((node_id, s.vector.endpoint, s.weight, s.vector.zone) for node_id, s in nodes.items())
        )
        if entries == self._last:
            return None
        self._last = entries
        self.version += 1
        slice_nodes = [TableNode(node_id=n, endpoint=e, weight=w, zone=z) for n, e, w, z in entries]
        return RoutingTable(
            epoch=self.epoch,
            version=self.version,
            issued_unix_s=time.time(),
            slices=[SliceTable(name=DEFAULT_SLICE, nodes=slice_nodes)],
        )
