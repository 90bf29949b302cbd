"""The embedded router: follows the brain's routing tables and routes each request locally."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import zmq
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from prismlb.wire import (
    BrainAddress,
    ClientCurve,
    ConfigError,
    InvalidFieldError,
    NoRouteError,
    RejectCounter,
    RoutingTable,
    TableSubscriber,
)

from ._ring import Ring

_log = logging.getLogger("prism.router")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where to send a request: the node's id and the address its inference server listens on."""

    node_id: str
    address: str


@dataclass(frozen=True, slots=True)
class _Slice:
    ring: Ring
    endpoints: Mapping[str, Endpoint]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """Everything route() reads, swapped as one attribute so readers never see half a table."""

    table: RoutingTable
    slices: Mapping[str, _Slice | None]
    applied_monotonic: float


def _build_snapshot(table: RoutingTable) -> _Snapshot:
    """Build the rings of every slice; ValueError when the table cannot be routed on."""
    slices: dict[str, _Slice | None] = {}
    for slice_table in table.slices:
        if slice_table.name in slices:
            raise ValueError(f"slice {slice_table.name!r} appears more than once")
        if not slice_table.nodes:
            slices[slice_table.name] = None
            continue
        try:
            ring = Ring.build(slice_table.nodes)
        except ValueError as exc:
            raise ValueError(f"slice {slice_table.name!r}: {exc}") from None
        endpoints = {node.node_id: Endpoint(node.node_id, node.endpoint) for node in slice_table.nodes}
        slices[slice_table.name] = _Slice(ring, endpoints)
    return _Snapshot(table, slices, time.monotonic())


def _check_config(
    ctx: zmq.Context[zmq.Socket[bytes]], brains: Sequence[BrainAddress], curve: ClientCurve | None
) -> None:
    """Fail in the caller's thread on what would otherwise silently stop the subscriber's thread."""
    probe = ctx.socket(zmq.DEALER)
    try:
        if curve is not None:
            curve.apply(probe)
        for endpoint in (e for brain in brains for e in (brain.updates, brain.snapshot)):
            try:
                probe.connect(endpoint)
            except zmq.ZMQError as exc:
                raise ConfigError(f"cannot use brain endpoint {endpoint!r}: {exc}") from None
    finally:
        probe.close(linger=0)


def _describe(table: RoutingTable) -> str:
    return f"epoch {table.epoch} version {table.version}"


class Router:
    """Routes keys on the newest routing table it has seen; with no brain it keeps the last one.

    `route()` reads one immutable snapshot and never locks or does I/O. `Router()` starts empty and
    without network (feed it with `apply`); `Router.connect` follows one or more brains.
    """

    def __init__(self, *, registry: CollectorRegistry | None = None) -> None:
        self.rejects = RejectCounter("router", _log, registry)
        self._snapshot: _Snapshot | None = None
        self._apply_lock = threading.Lock()
        self._has_table = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._subscriber: TableSubscriber | None = None
        self._closed = False
        if registry is not None:
            registry.register(_RouterCollector(self))

    @classmethod
    def from_table(cls, table: RoutingTable) -> Router:
        """A router fixed on `table`, with no network; ValueError when the table cannot be routed on."""
        router = cls()
        router.apply(table)
        return router

    @classmethod
    def connect(
        cls,
        brains: BrainAddress | Sequence[BrainAddress],
        *,
        curve: ClientCurve | None = None,
        registry: CollectorRegistry | None = None,
    ) -> Router:
        """Subscribe to the brains' tables (asking for a snapshot first) in a background thread.

        Raises ConfigError at once for an unusable CURVE key file or a malformed endpoint.
        """
        addresses = [brains] if isinstance(brains, BrainAddress) else list(brains)
        if not addresses:
            raise ValueError("at least one brain address is needed")
        ctx = zmq.Context()
        try:
            _check_config(ctx, addresses, curve)
        except BaseException:
            ctx.term()
            raise
        router = cls(registry=registry)
        router._ctx = ctx
        router._subscriber = TableSubscriber(ctx, addresses, router._on_table, router.rejects, curve=curve)
        router._subscriber.start()
        _log.info("following routing tables from %s", ", ".join(a.updates for a in addresses))
        return router

    def apply(self, table: RoutingTable) -> bool:
        """Make `table` current if its (epoch, version) is newer; False when it is not.

        Raises ValueError (and keeps the current table) when `table` cannot be routed on.
        """
        current = self._snapshot
        if current is not None and table.order <= current.table.order:
            return False
        snapshot = _build_snapshot(table)
        with self._apply_lock:
            current = self._snapshot
            if current is not None and table.order <= current.table.order:
                return False
            self._snapshot = snapshot
        self._has_table.set()
        first_of_epoch = current is None or current.table.epoch != table.epoch
        _log.log(
            logging.INFO if first_of_epoch else logging.DEBUG,
            "routing on table %s (%d slices)",
            _describe(table),
            len(table.slices),
        )
        return True

    def _on_table(self, table: RoutingTable) -> bool:
        try:
            return self.apply(table)
        except ValueError as exc:
            self.rejects.record(InvalidFieldError(f"table {_describe(table)}: {exc}"))
            return False

    def route(self, key: str | bytes, slice_name: str = "default") -> Endpoint:
        """The endpoint that owns `key` in `slice_name`; NoRouteError without a table or nodes."""
        snapshot = self._snapshot
        if snapshot is None:
            raise NoRouteError("no routing table yet")
        try:
            entry = snapshot.slices[slice_name]
        except KeyError:
            names = ", ".join(sorted(snapshot.slices)) or "none"
            raise NoRouteError(
                f"no slice {slice_name!r} in table {_describe(snapshot.table)} (slices: {names})"
            ) from None
        if entry is None:
            raise NoRouteError(f"slice {slice_name!r} has no nodes in table {_describe(snapshot.table)}")
        return entry.endpoints[entry.ring.lookup(key).node_id]

    @property
    def table(self) -> RoutingTable | None:
        snapshot = self._snapshot
        return None if snapshot is None else snapshot.table

    @property
    def table_age_s(self) -> float | None:
        """Seconds since the current table was applied; None without a table."""
        snapshot = self._snapshot
        return None if snapshot is None else time.monotonic() - snapshot.applied_monotonic

    @property
    def last_heard_age_s(self) -> float | None:
        """Seconds since any brain was last heard; None when none has been (or there is no network)."""
        heard = None if self._subscriber is None else self._subscriber.last_heard_monotonic
        return None if heard is None else time.monotonic() - heard

    def wait_for_table(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for a first table; True when there is one."""
        return self._has_table.wait(timeout_s)

    def close(self) -> None:
        """Stop following the brains; the last table stays usable."""
        if self._closed:
            return
        self._closed = True
        if self._subscriber is not None:
            self._subscriber.stop()
        if self._ctx is not None:
            self._ctx.term()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RouterCollector:
    """Exports the table the router routes on; each gauge is absent while its value is unknown."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def describe(self) -> list[Metric]:
        return self._families(None, None, None, None)

    def collect(self) -> list[Metric]:
        snapshot = self._router._snapshot
        if snapshot is None:
            return self._families(None, None, None, self._router.last_heard_age_s)
        return self._families(
            snapshot.table.epoch,
            snapshot.table.version,
            time.monotonic() - snapshot.applied_monotonic,
            self._router.last_heard_age_s,
        )

    @staticmethod
    def _families(epoch: int | None, version: int | None, age_s: float | None, heard_s: float | None) -> list[Metric]:
        gauges = (
            ("prism_router_table_epoch", "Epoch of the routing table in use", epoch),
            ("prism_router_table_version", "Version of the routing table in use", version),
            ("prism_router_table_age_seconds", "Seconds since the routing table in use was applied", age_s),
            ("prism_router_last_heard_age_seconds", "Seconds since a brain was last heard", heard_s),
        )
        families: list[Metric] = []
        for name, help_text, value in gauges:
            family = GaugeMetricFamily(name, help_text)
            if value is not None:
                family.add_metric([], value)
            families.append(family)
        return families
