"""The brain service loop: ingest node vectors, keep history, predict, weigh, and publish routing tables."""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

from prismlb.semantics import Slice
from prismlb.service import sd_notify, serve_metrics, watchdog_interval_s
from prismlb.wire import (
    KvBlocks,
    NodeVector,
    RejectCounter,
    RoutingTable,
    TableNode,
    TablePublisher,
    VectorReceiver,
    WireError,
    ZoneRoute,
)

from ._admin import AdminQueue, AdminServer
from ._backend import Backend
from ._config import BrainConfig
from ._control import Control
from ._drift import DriftDetector
from ._experiments import Experiments
from ._exporter import PredictorCollector, RegistryCollector, TallyCollector
from ._failover import FailoverScheduler
from ._features import node_features, series_p99_ms, slice_predictions
from ._guardian import Guardian, GuardianConfig
from ._history import History
from ._holddown import KnownNodes, StartupHold
from ._identity import start_curve
from ._kv_relay import KvRelay, KvRelayCollector
from ._load_relay import LoadRelay, LoadRelayCollector
from ._predictor import Predictor
from ._registry import NodeState, Registry
from ._scale_hook import parse_hook
from ._shards import ShardedReceiver, tune_gc_for_ingest
from ._tables import TableBuilder, next_epoch
from ._weights import Predictions, compute_weights
from ._zone_view import ZoneView, ZoneViewCollector

_log = logging.getLogger("prism.brain")
CHECKPOINT = "predictor.pt"
PREDICTION_SMOOTHING_S = 30.0


def default_brain_id(config: BrainConfig) -> str:
    """The host's name and the updates endpoint: distinct for brains on different hosts or ports."""
    return f"{socket.gethostname()}/{config.updates}"[:256]


class Brain:
    """One brain process; `run(stop)` blocks until `stop` is set, then closes everything.

    Isolation: a failure while handling one node's vector or weights is counted (`faults`, by stage), logged
    once per stage, and costs that node (its vector, or its place until its next vector), never the loop; a
    failure of a whole step (prediction, control, a table build) keeps the last table and is retried next time.
    """

    def __init__(
        self,
        config: BrainConfig,
        registry: CollectorRegistry | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.metrics = registry or CollectorRegistry()
        self.registry = Registry(stale_periods=config.stale_periods, wall_clock=wall_clock)
        self.tables = TableBuilder(
            next_epoch(config.state_dir), brain_id=config.brain_id or default_brain_id(config), priority=config.priority
        )
        if config.state_dir is None:
            _log.warning("no state folder: epoch 0, no known nodes across restarts (set --state-dir for both)")
        self.known = KnownNodes(config.state_dir)
        self.hold = StartupHold(self.known.ids, config.restart_quorum, config.holddown_s)
        self.rejects = RejectCounter("brain", _log, self.metrics)
        self.faults = RejectCounter("brain_fault", _log, self.metrics)
        self.history = History.load(config.state_dir) if config.state_dir is not None else History(None)
        self.experiments = Experiments(config.state_dir)
        hook = parse_hook(config.scale_hook) if config.scale_hook else None
        self.control = Control(DriftDetector(), Guardian(GuardianConfig(scale_hook=hook), self.metrics))
        self.predictor = Predictor()
        self._load_checkpoint()
        self.predictions: Predictions = {}
        self.drained: set[str] = set()
        self.current: RoutingTable | None = None
        self.admin_queue = AdminQueue()
        self._next_cycle = self._next_predict = self._next_control = -math.inf
        self._vectors = Counter("prism_brain_vectors", "Node vectors accepted", registry=self.metrics)
        self._lost = Counter(
            "prism_brain_vectors_lost", "Node vectors missing from an agent's sequence numbers", registry=self.metrics
        )
        self._receiver: VectorReceiver | ShardedReceiver | None = None
        Gauge(
            "prism_brain_ingest_backlog",
            "Consecutive ingest drains that stopped at their limit with vectors still waiting (0: keeping up)",
            registry=self.metrics,
        ).set_function(lambda: self._receiver.backlog if self._receiver is not None else 0)
        self._published = Counter("prism_brain_tables_published", "Routing tables published", registry=self.metrics)
        self._cycles = Counter(
            "prism_brain_cycles", "Routing cycles run, held ones included (the brain is alive)", registry=self.metrics
        )
        Gauge("prism_brain_nodes", "Live nodes", registry=self.metrics).set_function(lambda: len(self.registry.nodes))
        Gauge("prism_brain_table_version", "Version of the current table", registry=self.metrics).set_function(
            lambda: self.tables.version
        )
        Gauge("prism_brain_epoch", "This brain's epoch", registry=self.metrics).set_function(lambda: self.tables.epoch)
        Gauge(
            "prism_brain_holding", "1 while the first table is held back after a start", registry=self.metrics
        ).set_function(lambda: 0 if self.hold.released else 1)
        self.metrics.register(
            TallyCollector(
                [
                    (
                        "prism_brain_table_entries_clamped",
                        "Table entries whose values were clamped",
                        lambda: self.tables.clamped,
                    ),
                    (
                        "prism_brain_predictor_trained_steps",
                        "Optimiser steps so far",
                        lambda: self.predictor.trained_steps,
                    ),
                ]
            )
        )
        self.kv = KvRelay(self.tables.brain_id, self.tables.epoch)
        """The engines' KV blocks, relayed to the routers as they come (`_kv_relay`)."""
        self.metrics.register(KvRelayCollector(self.kv))
        self.loads = LoadRelay(self.tables.brain_id)
        """The routers' queued prefill work, summed for every router (`_load_relay`)."""
        self.zones = ZoneView(FailoverScheduler(config.failover_model, config.failover_reload_s))
        """The zones' state and the split routers in each zone follow (`_zone_view`, `_failover`)."""
        self.metrics.register(ZoneViewCollector(self.zones))
        self.metrics.register(LoadRelayCollector(self.loads))
        self.metrics.register(RegistryCollector(self.registry))
        self.metrics.register(PredictorCollector(self.predictor))

    def _checkpoint_path(self) -> Path | None:
        return self.config.state_dir / CHECKPOINT if self.config.state_dir is not None else None

    def _load_checkpoint(self) -> None:
        path = self._checkpoint_path()
        if path is not None and path.exists():
            try:
                self.predictor.load(path)
                _log.info("predictor checkpoint loaded from %s", path)
            except Exception as exc:  # a bad checkpoint must not keep the brain down: train afresh
                _log.warning("predictor checkpoint %s unusable (%s); training from scratch", path, exc)

    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set; a failure of the loop sets it too (it ends the trainer). Everything opened
        here is closed on the way out, in reverse order, each close taken whatever the others do, and so is the
        brain (`close`)."""
        cfg = self.config
        with ExitStack() as stack:
            stack.callback(lambda: _log.info("brain stopped at table version %d", self.tables.version))
            stack.callback(self.close)
            ctx = zmq.Context()
            stack.callback(ctx.destroy, linger=0)
            auth, identity = start_curve(ctx, cfg, self.metrics)  # CURVE off: warns of a plaintext public bind
            if auth is not None:
                stack.callback(auth.stop)
            tune_gc_for_ingest()
            receiver: VectorReceiver | ShardedReceiver
            if cfg.ingest_workers:
                receiver = ShardedReceiver(ctx, cfg.ingest, self.rejects, cfg.ingest_workers)
            else:
                receiver = VectorReceiver(ctx, cfg.ingest, self.rejects, curve=cfg.curve, identity=identity)
            self._receiver = receiver
            stack.callback(self._close_receiver)
            publisher = TablePublisher(ctx, cfg.updates, cfg.snapshot, self.rejects, curve=cfg.curve_routers)
            stack.callback(publisher.close)
            publisher.kv_snapshot = self.kv.snapshot
            publisher.on_router_load = lambda report: self.loads.accept(report, time.monotonic())
            metrics = serve_metrics(cfg.metrics_port, self.metrics, cfg.metrics_addr)
            if metrics is not None:
                stack.callback(metrics.close)
            if cfg.admin_port:
                admin = AdminServer(
                    Backend(self), self.admin_queue, cfg.admin_access, cfg.admin_addr, cfg.admin_port, self.metrics
                )
                admin.start()  # closing waits for its serving loop: registered once that runs
                stack.callback(admin.close)
            _log.info(
                "brain epoch %d up: ingest %s, tables %s, snapshots %s, CURVE %s",
                self.tables.epoch,
                cfg.ingest,
                cfg.updates,
                cfg.snapshot,
                "on (node ids bound to keys)" if cfg.curve else "off",
            )
            if cfg.train_budget_s > 0:
                trainer = threading.Thread(target=self._train, args=(stop,), name="prism-predictor-train", daemon=True)
                trainer.start()
                stack.callback(trainer.join, timeout=10)
            stack.callback(stop.set)  # ends the trainer's wait, and tells whoever else waits on `stop`
            stack.callback(sd_notify, "STOPPING=1")
            sd_notify("READY=1")
            self._loop(stop, receiver, publisher)

    def _close_receiver(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def close(self) -> None:
        """Release what the brain holds beyond `run`'s sockets: the guardian's hook thread, the history's unsaved
        rows and the predictor's checkpoint (both written to the state folder, when there is one). `run` calls
        it on the way out; a brain driven without `run` (a replay) calls it when done. Each step is taken
        whatever the others do."""
        with ExitStack() as stack:  # it runs the last registered first: the hook thread, history, checkpoint
            stack.callback(self._save_checkpoint)
            stack.callback(self.history.close)
            stack.callback(self.control.close)

    def _save_checkpoint(self) -> None:
        path = self._checkpoint_path()
        if path is not None and self.predictor.trained_steps:
            self.predictor.checkpoint(path)

    def _train(self, stop: threading.Event) -> None:
        """Online training in the background: `train_budget_s` CPU seconds every `train_interval_s`."""
        cfg = self.config
        while not stop.wait(cfg.train_interval_s):
            try:
                self.predictor.train_step(cfg.train_budget_s)
            except Exception:
                _log.exception("predictor training step failed; the weights keep the last good predictor")

    def _loop(
        self, stop: threading.Event, receiver: VectorReceiver | ShardedReceiver, publisher: TablePublisher
    ) -> None:
        """Ingest (vectors, and KV blocks relayed at once), snapshots, admin, the periodic tick and heartbeats.

        KV blocks come through either receiver (the sharded ingest's workers forward them in their batches)."""
        cfg = self.config
        poller = zmq.Poller()
        poller.register(receiver.socket, zmq.POLLIN)
        poller.register(publisher.snapshot_socket, zmq.POLLIN)
        watchdog = watchdog_interval_s()
        next_heartbeat = next_watchdog = next_retain = time.monotonic()
        while not stop.is_set():
            wait = max(0.0, min(self._next_cycle, next_heartbeat, self.loads.next_due()) - time.monotonic())
            poller.poll(timeout=wait * 1000)
            now = time.monotonic()
            kv: list[KvBlocks] = []
            self._guarded("ingest", lambda: self.ingest(receiver.drain(kv=kv), now))
            if kv:
                self._guarded("kv", lambda: publisher.publish_kv(self.kv.accept(kv, now)))
            if now >= next_retain:
                next_retain = now + cfg.cycle_s
                live = [n for n in self.registry.nodes if n not in self.drained]
                self._guarded("kv", lambda: publisher.publish_kv(self.kv.retain(live, now)))
            self._guarded("snapshots", publisher.serve_snapshots)
            self._guarded("loads", lambda: self._publish_load(publisher, now))
            self._guarded("admin", self.admin_queue.apply_pending)
            _, table = self._guarded("tick", lambda: self.tick(now, time.time()))
            if isinstance(table, RoutingTable) and self._guarded("publish", lambda: publisher.publish(table))[0]:
                self._published.inc()
                next_heartbeat = now + cfg.heartbeat_s
            if now >= next_heartbeat:
                next_heartbeat = now + cfg.heartbeat_s
                publisher.heartbeat()
            if watchdog is not None and now >= next_watchdog:
                next_watchdog = now + watchdog
                sd_notify("WATCHDOG=1")

    def _publish_load(self, publisher: TablePublisher, now: float) -> None:
        load = self.loads.due(now)
        if load is not None:
            publisher.publish_load(load)

    def _guarded(self, stage: str, step: Callable[[], object]) -> tuple[bool, object]:
        """Run one step of the loop: (True, its result), or (False, None) after a failure, which is counted
        and logged once per stage, never fatal."""
        try:
            return True, step()
        except WireError as exc:
            self.faults.count(stage, exc)
        except Exception as exc:
            self.faults.count(stage, repr(exc))
            _log.debug("brain step %s failed", stage, exc_info=True)
        return False, None

    def tick(self, now: float, wall_s: float) -> RoutingTable | None:
        """The periodic work due at monotonic `now`: predict, control, and build the next table (returned when
        routing changed). The service loop calls it with real time, a cluster replay with simulated time."""
        cfg = self.config
        if self._next_cycle == -math.inf:
            self._next_cycle = self._next_predict = now
            self._next_control = now + cfg.control_period_s
        if now >= self._next_predict:
            self._next_predict = now + cfg.predict_period_s
            self.predict()
        if now >= self._next_control:
            self._next_control = now + cfg.control_period_s
            self.observe_window()
            self.control.step(wall_s, self.registry.nodes, self.experiments.snapshot())
        if now < self._next_cycle:
            return None
        self._next_cycle = now + cfg.cycle_s
        table = self.cycle(now)
        if table is not None:
            self.current = table
        return table

    def ingest(self, vectors: list[NodeVector], now: float) -> None:
        """Registry for every vector, then history and the counters once per batch (at 20,000 vectors/s the
        per-vector lock, clock call and counter increment were a tenth of the brain's ingest time).

        A gap in an agent's `seq` is counted as lost vectors (after a restart, a new `started_unix_s`, the
        sequence starts again at 0): they were dropped on the way, by the agent's full queue or the network,
        where the brain cannot see them. Vectors lost while the brain itself was down are not counted."""
        nodes = self.registry.nodes
        accepted: list[NodeVector] = []
        lost = 0
        for vector in vectors:
            before = nodes.get(vector.node_id)
            previous = before.vector if before is not None else None
            try:
                if not self.registry.update(vector, now):
                    continue
            except WireError as exc:
                self.rejects.record(exc)
                continue
            except Exception as exc:  # one node's odd vector must not cost the others theirs
                self.faults.count("node_ingest", f"{vector.node_id}: {exc!r}")
                continue
            accepted.append(vector)
            if previous is None:
                continue
            if vector.started_unix_s == previous.started_unix_s:
                lost += max(0, vector.seq - previous.seq - 1)
            else:  # the agent restarted, and its sequence with it
                lost += vector.seq
        if not accepted:
            return
        self._vectors.inc(len(accepted))
        if lost:
            self._lost.inc(lost)
        try:
            self.history.extend(accepted)
        except Exception:  # a batch adds nothing when one vector fails: add the others one by one
            for vector in accepted:
                try:
                    self.history.append(vector)
                except Exception as exc:
                    self.faults.count("history", f"{vector.node_id}: {exc!r}")

    def observe_window(self) -> None:
        """One predictor time step per node per control period (5 s), from its latest vector: the agent's
        latency is a sliding window, so sampling every vector would feed the model overlapping windows."""
        for node_id, state in self.registry.nodes.items():
            try:
                self.predictor.observe(node_id, node_features(state.vector), self._series(state.vector))
            except Exception as exc:
                self.faults.count("node_observe", f"{node_id}: {exc!r}")

    def _series(self, vector: NodeVector) -> dict[str, float | None]:
        """The node's latency series and this window's P99 of each, by key: each slice's own latency entry and
        the engine's (`series_p99_ms`). `predict` gives a slice its own series' forecast, else the engine
        series' (`slice_predictions`), so a subclass that returns one engine-keyed series has that one forecast
        serve every slice."""
        return series_p99_ms(vector)

    def predict(self) -> None:
        """One batched inference for every series of every live node, with the predictor that did best on
        recent data; each slice's forecast (`slice_predictions`) averaged with the node's earlier prediction for
        that slice (time constant PREDICTION_SMOOTHING_S). A slice without a forecast is absent."""
        predicted = self.predictor.predict(list(self.registry.nodes))
        alpha = 1 - math.exp(-self.config.predict_period_s / PREDICTION_SMOOTHING_S)
        smoothed: dict[str, dict[Slice, float]] = {}
        for node_id, series in predicted.items():
            before = self.predictions.get(node_id, {})
            per_slice: dict[Slice, float] = {}
            for slice_, p99 in slice_predictions(series).items():
                earlier = before.get(slice_)
                per_slice[slice_] = p99 if earlier is None else earlier + alpha * (p99 - earlier)
            if per_slice:
                smoothed[node_id] = per_slice
        self.predictions = smoothed

    def cycle(self, now: float) -> RoutingTable | None:
        """Expire silent nodes and build a new table if routing changed."""
        self._cycles.inc()
        for node_id in self.registry.expire(now):
            self.predictor.forget(node_id)
        if not self.hold.check(now, self.registry.nodes):
            return None
        states = {n: s for n, s in self.registry.nodes.items() if n not in self.drained}
        state, shed = self.control.guardian.flags()
        entries = self._weights(states)
        table = self.tables.build(
            entries,
            experiments=self.experiments.snapshot(),
            shed_classes=shed,
            guardian=state,
            drained=self.drained,
            zones=self._zone_split(states, entries, now),
        )
        if table is not None:
            summary = "; ".join(
                f"{s.name}: " + (", ".join(f"{n.node_id}={n.weight:.2f}" for n in s.nodes) or f"-> {s.fallback}")
                for s in table.slices
            )
            _log.info("table %d.%d: %s", table.epoch, table.version, summary)
            self.known.remember({node.node_id for s in table.slices for node in s.nodes})
        return table

    def _zone_split(
        self, states: dict[str, NodeState], entries: dict[Slice, list[TableNode]], now: float
    ) -> list[ZoneRoute]:
        """The zone split for this table; when the scheduler fails, none (counted): routers then place over every
        zone, as they do without one, rather than on a split that no longer matches the nodes."""
        weights: dict[str, float] = {}
        for nodes in entries.values():
            for node in nodes:
                weights[node.node_id] = max(weights.get(node.node_id, 0.0), node.weight)
        try:
            return self.zones.routes(states, weights, self.loads.demand_by_zone(), now)
        except Exception as exc:
            self.faults.count("zone_split", repr(exc))
            return []

    def _weights(self, states: dict[str, NodeState]) -> dict[Slice, list[TableNode]]:
        """`compute_weights`; when it fails, the nodes that make it fail are found one by one, counted and
        left out until their next vector (the rest are weighed without them)."""
        latency = self.config.latency_weights
        try:
            return compute_weights(states, self.predictions, latency=latency)
        except Exception as first:
            culprits = []
            for node_id, state in states.items():
                try:
                    compute_weights({node_id: state}, self.predictions, latency=latency)
                except Exception as exc:
                    culprits.append(node_id)
                    self.faults.count("node_weights", f"{node_id}: {exc!r}")
            if not culprits:
                raise first
            for node_id in culprits:
                self.registry.nodes.pop(node_id, None)
                self.predictor.forget(node_id)
            return compute_weights(
                {n: s for n, s in states.items() if n not in culprits}, self.predictions, latency=latency
            )
