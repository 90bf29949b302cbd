"""Versioned routing tables: a new version only when routing changes beyond a threshold.

A table holds all four slices in `Slice` order; an empty slice names its fallback (`_slices.fallback`). A new version is
issued when any entry joins, leaves or changes its endpoint, zone, model version, NUMA node or prefill speed (held in
steps with its own hysteresis), when a fallback, the experiments or the guardian's flags change, or when any weight
moves at least `weight_threshold` (one weight step, 0.05) from the value last published. Load and predicted P99 ride
along with the next table but never cause one by themselves.

The builder clamps what it is given rather than refusing it: a weight outside (0, 1] or not finite becomes
the floor or 1.0, a load or prediction that is negative, not finite or over the wire's bound is left out or
capped, so one node's odd numbers can never make the table unpublishable.

Epochs: a brain with a state folder persists a counter there and takes the next one at every start, so a
restarted brain's tables order after its earlier ones without trusting the wall clock. Without a state folder
the epoch is 0; routers then recognise a restart by the brain's version going back (`wire.TableSubscriber`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import msgspec

from prismlb.semantics import Slice
from prismlb.wire import MAX_TABLE_VALUE, Experiment, RoutingTable, SliceTable, TableNode, ZoneRoute

from ._slices import fallback

WEIGHT_THRESHOLD = 0.05
WEIGHT_FLOOR = 0.05
_log = logging.getLogger("prism.brain")

_Identity = tuple[str, int | None, str, str, str, int | None, str, float | None, bool, float | None, float | None]


def _identity(node: TableNode) -> _Identity:
    """What makes a new table when it changes; the prefill speed is in it, being held with its own hysteresis
    (`_weights.prefill_rates`), and so are the network stall and the wait for cache room, published in steps
    (`_weights.published_stall`, `published_admit`): a router would otherwise keep a node's last published wait
    until something else changed, and pass over a node whose cache has long had room."""
    return (
        node.node_id,
        node.gpu,
        node.endpoint,
        node.zone,
        node.model_version,
        node.numa_node,
        node.gpu_class,
        node.prefill_tokens_per_s,
        node.overflow,
        node.stall_ms,
        node.admit_ms,
    )


def next_epoch(state_dir: Path | None) -> int:
    """The persisted epoch + 1 (1 the first time), written back before it is used; 0 without a state folder."""
    if state_dir is None:
        return 0
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "epoch"
    epoch = 1
    try:
        epoch = int(path.read_text().strip()) + 1
    except FileNotFoundError:
        pass
    except ValueError as exc:
        raise ValueError(f"{path} does not hold an epoch number ({exc}); fix or remove it") from None
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{epoch}\n")
    os.replace(tmp, path)
    return epoch


class TableBuilder:
    """Turns per-slice entries into versioned tables; `build` returns None when routing did not change enough."""

    def __init__(
        self, epoch: int, weight_threshold: float = WEIGHT_THRESHOLD, *, brain_id: str = "", priority: int = 0
    ) -> None:
        self.epoch = epoch
        self.brain_id = brain_id
        self.priority = priority
        self.clamped = 0
        """Entries whose values had to be clamped (counted; the brain exports it)."""
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
        drained: Collection[str] = (),
        zones: Sequence[ZoneRoute] = (),
    ) -> RoutingTable | None:
        """The next table from `compute_weights`-style entries (a missing slice is empty), or None."""
        slices = {s: [self._clamp(n) for n in entries.get(s, ())] for s in Slice}
        nonempty = {s for s, nodes in slices.items() if nodes}
        fallbacks = {s: None if s in nonempty else fallback(s, nonempty) for s in Slice}
        weights = {(s, _identity(n)): n.weight for s, nodes in slices.items() for n in nodes}
        routing = (
            frozenset(weights),
            fallbacks,
            tuple(experiments),
            tuple(shed_classes),
            guardian,
            frozenset(drained),
            tuple(zones),
        )
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
            brain_id=self.brain_id,
            priority=self.priority,
            drained=sorted(drained),
            zones=list(zones),
        )

    def _clamp(self, node: TableNode) -> TableNode:
        """`node` with every number inside what the wire accepts (counted in `clamped` when one was not)."""
        weight = node.weight if math.isfinite(node.weight) else WEIGHT_FLOOR
        weight = min(1.0, max(WEIGHT_FLOOR, weight))
        load, predicted = _bounded(node.load), _bounded(node.predicted_p99_ms)
        rate = _bounded(node.prefill_tokens_per_s)
        if (
            weight == node.weight
            and load == node.load
            and predicted == node.predicted_p99_ms
            and rate == node.prefill_tokens_per_s
        ):
            return node
        self.clamped += 1
        if self.clamped == 1:
            _log.warning("table entry %s had values out of range; clamped (further ones only counted)", node.node_id)
        return msgspec.structs.replace(
            node, weight=weight, load=load, predicted_p99_ms=predicted, prefill_tokens_per_s=rate
        )

    def _moved(self, weights: Mapping[tuple[Slice, _Identity], float]) -> bool:
        return any(round(abs(w - self._weights[key]), 9) >= self.weight_threshold for key, w in weights.items())


def _bounded(value: float | None) -> float | None:
    """A table value within [0, MAX_TABLE_VALUE]; None when it is absent, negative or not a number."""
    if value is None or not value >= 0.0:
        return None
    return min(value, MAX_TABLE_VALUE)
