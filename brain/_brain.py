"""The brain service loop: ingest node vectors, keep the registry, publish tables and heartbeats."""

from __future__ import annotations

import logging
import threading
import time

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

from prismlb.wire import (
    RejectCounter,
    RoutingTable,
    TablePublisher,
    VectorReceiver,
    sd_notify,
    serve_metrics,
    start_authenticator,
    watchdog_interval_s,
)

from ._config import BrainConfig
from ._exporter import RegistryCollector
from ._registry import Registry
from ._tables import TableBuilder, next_epoch
from ._weights import compute_weights

_log = logging.getLogger("prism.brain")


class Brain:
    """One brain process; `run(stop)` blocks until `stop` is set, then closes everything."""

    def __init__(self, config: BrainConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.metrics = registry or CollectorRegistry()
        self.registry = Registry(stale_periods=config.stale_periods)
        self.tables = TableBuilder(next_epoch(config.state_dir))
        self.rejects = RejectCounter("brain", _log, self.metrics)
        self._vectors = Counter("prism_brain_vectors", "Node vectors accepted", registry=self.metrics)
        self._published = Counter("prism_brain_tables_published", "Routing tables published", registry=self.metrics)
        Gauge("prism_brain_nodes", "Live nodes", registry=self.metrics).set_function(
            lambda: len(self.registry.nodes)
        )
        Gauge("prism_brain_table_version", "Version of the current table", registry=self.metrics).set_function(
            lambda: self.tables.version
        )
        self.metrics.register(RegistryCollector(self.registry))
        Gauge("prism_brain_epoch", "This brain's epoch", registry=self.metrics).set_function(
            lambda: self.tables.epoch
        )

    def run(self, stop: threading.Event) -> None:
        cfg = self.config
        ctx = zmq.Context()
        auth = start_authenticator(ctx, cfg.curve) if cfg.curve is not None else None
        metrics = None
        try:
            receiver = VectorReceiver(ctx, cfg.ingest, self.rejects, curve=cfg.curve)
            publisher = TablePublisher(ctx, cfg.updates, cfg.snapshot, self.rejects, curve=cfg.curve)
            metrics = serve_metrics(cfg.metrics_port, self.metrics, cfg.metrics_addr)
            _log.info(
                "brain epoch %d up: ingest %s, tables %s, snapshots %s, CURVE %s",
                self.tables.epoch,
                cfg.ingest,
                cfg.updates,
                cfg.snapshot,
                "on" if cfg.curve else "off",
            )
            sd_notify("READY=1")
            self._loop(stop, receiver, publisher)
        finally:
            sd_notify("STOPPING=1")
            if auth is not None:
                auth.stop()
            if metrics is not None:
                metrics.close()
            ctx.destroy(linger=0)
            _log.info("brain stopped at table version %d", self.tables.version)

    def _loop(self, stop: threading.Event, receiver: VectorReceiver, publisher: TablePublisher) -> None:
        cfg = self.config
        poller = zmq.Poller()
        poller.register(receiver.socket, zmq.POLLIN)
        poller.register(publisher.snapshot_socket, zmq.POLLIN)
        watchdog = watchdog_interval_s()
        next_cycle = next_heartbeat = next_watchdog = time.monotonic()
        while not stop.is_set():
            wait = max(0.0, min(next_cycle, next_heartbeat) - time.monotonic())
            poller.poll(timeout=wait * 1000)
            now = time.monotonic()
            for vector in receiver.drain():
                self.registry.update(vector, now)
                self._vectors.inc()
            publisher.serve_snapshots()
            if now >= next_cycle:
                next_cycle = now + cfg.cycle_s
                table = self.cycle(now)
                if table is not None:
                    publisher.publish(table)
                    self._published.inc()
                    next_heartbeat = now + cfg.heartbeat_s
            if now >= next_heartbeat:
                next_heartbeat = now + cfg.heartbeat_s
                publisher.heartbeat()
            if watchdog is not None and now >= next_watchdog:
                next_watchdog = now + watchdog
                sd_notify("WATCHDOG=1")

    def cycle(self, now: float) -> RoutingTable | None:
        """Expire silent nodes and build a new table if routing changed."""
        self.registry.expire(now)
        table = self.tables.build(compute_weights(self.registry.nodes, {}))
        if table is not None:
            _log.info(
                "table %d.%d: %s",
                table.epoch,
                table.version,
                "; ".join(
                    f"{s.name}: " + (", ".join(f"{n.node_id}={n.weight:.2f}" for n in s.nodes) or f"→ {s.fallback}")
                    for s in table.slices
                ),
            )
        return table
