"""The agent's loop: sample the node every period and push a NodeVector to the brain."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prismlb.wire import (
    ConfigError,
    NodeVector,
    VectorSender,
    health,
    sd_notify,
    serve_metrics,
    watchdog_interval_s,
)

from ._bounds import InvalidValues
from ._config import AgentConfig, brain_endpoints
from ._ebpf import ConnectCounter, probe_ebpf
from ._node import NodeSampler, NodeState, metric_values
from ._signals import SpanSignals
from ._sources import node_sources
from ._tracing import TracePath

_log = logging.getLogger("prism.agent")


class Agent:
    """One node's reporter; `run` blocks until `stop` is set, then closes everything it opened."""

    def __init__(self, config: AgentConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self._sent = Counter("prism_agent_vectors_sent", "Node vectors queued for the brain.", registry=self.registry)
        self._dropped = Counter(
            "prism_agent_vectors_dropped",
            "Node vectors dropped because the queue to the brain was full.",
            registry=self.registry,
        )
        self._ebpf_up = Gauge(
            "prism_agent_ebpf_up", "1 while the eBPF program is attached.", registry=self.registry
        )
        self.registry.register(_StateCollector(self))
        self.invalid = InvalidValues(self.registry)
        self.started_unix_s = time.time()
        self.state: NodeState | None = None
        self.sampler: NodeSampler | None = None
        self.trace_path: TracePath | None = None
        self._seq = 0
        self._dropping = False

    def run(self, stop: threading.Event) -> None:
        """Report every `period_s` on a fixed monotonic schedule until `stop` is set."""
        config = self.config
        try:
            metrics = serve_metrics(config.metrics_port, self.registry, config.metrics_addr)
        except OSError as exc:
            raise ConfigError(f"cannot serve /metrics on {config.metrics_addr}:{config.metrics_port}: {exc}") from None
        counter = self._open_counter()
        ctx = zmq.Context()
        trace_path: TracePath | None = None
        try:
            signals = SpanSignals(invalid=self.invalid)
            trace_path = TracePath(
                config,
                counter.tracer if counter is not None else None,
                signals,
                self.registry,
                counter.network if counter is not None else None,
            )
            trace_path.start()
            self.trace_path = trace_path
            with node_sources(config, counter, signals, self.registry) as sources:
                sender = _FanOut([VectorSender(ctx, b, curve=config.curve) for b in brain_endpoints(config.brain)])
                sampler = NodeSampler(sources)
                self.sampler = sampler
                try:
                    self._loop(stop, sender, sampler)
                finally:
                    _log.info("stopping: %d vectors sent, %d dropped", sender.sent, sender.dropped)
                    sd_notify("STOPPING=1")
                    sender.close()
        finally:
            if trace_path is not None:
                trace_path.close()
            ctx.destroy(linger=0)
            if metrics is not None:
                metrics.close()
            if counter is not None:
                counter.close()
                self._ebpf_up.set(0)

    def _open_counter(self) -> ConnectCounter | None:
        if not self.config.ebpf:
            _log.info("eBPF off: disabled by --no-ebpf; connection tracing, connect_calls_total and tcp_* stay off")
            return None
        counter, detail = probe_ebpf(self.config.trace_ports, self.config.trace_pids)
        if counter is None:
            _log.warning("eBPF off: %s; connection tracing, connect_calls_total and tcp_* stay off", detail)
        else:
            _log.info("eBPF on: %s", detail)
            self._ebpf_up.set(1)
        return counter

    def _loop(self, stop: threading.Event, sender: _FanOut, sampler: NodeSampler) -> None:
        period = self.config.period_s
        watchdog = watchdog_interval_s()
        if watchdog is not None and watchdog < period:
            _log.warning("period %.3g s is longer than half the systemd watchdog (%.3g s)", period, watchdog)
        sd_notify("READY=1")
        _log.info(
            "started: node %s reports to %s every %.3g s%s (sources: %s)",
            self.config.node_id,
            self.config.brain,
            period,
            " over CURVE" if self.config.curve is not None else "",
            ", ".join(f"{s.name}/{s.period_s:g}s" for s in sampler.sources),
        )
        next_due = time.monotonic() + period
        while not stop.wait(max(0.0, next_due - time.monotonic())):
            self._report(sender, sampler)
            if watchdog is not None:
                sd_notify("WATCHDOG=1")
            next_due += period
            behind = time.monotonic() - next_due
            if behind > 0:  # missed slots (suspend, stall): skip them, keep the schedule's phase
                next_due += math.ceil(behind / period) * period

    def _report(self, sender: _FanOut, sampler: NodeSampler) -> None:
        state = sampler.tick(time.monotonic())
        self.state = state
        config = self.config
        vector = NodeVector(
            node_id=config.node_id,
            host=config.host,
            endpoint=config.endpoint,
            zone=config.zone,
            labels=dict(config.labels),
            seq=self._seq,
            sample_time_unix_s=time.time(),
            period_s=config.period_s,
            metrics=state.metrics,
            started_unix_s=self.started_unix_s,
            alarms=state.alarms,
            latency=state.latency,
            gpus=state.gpus,
            kv=state.kv,
        )
        self._seq += 1
        if sender.send(vector):
            self._sent.inc()
            if self._dropping:
                _log.info("queue to the brain drained: sending again")
                self._dropping = False
        else:
            self._dropped.inc()
            if not self._dropping:
                _log.warning("queue to the brain is full (brain down or slow): dropping vectors")
                self._dropping = True


class _FanOut:
    """Every vector to every brain of a highly available group; one brain's full queue costs that brain the
    vector (counted as dropped), never the others."""

    def __init__(self, senders: list[VectorSender]) -> None:
        self.senders = senders

    def send(self, vector: NodeVector) -> bool:
        """True when every brain's queue took the vector."""
        return all([sender.send(vector) for sender in self.senders])

    @property
    def sent(self) -> int:
        return sum(sender.sent for sender in self.senders)

    @property
    def dropped(self) -> int:
        return sum(sender.dropped for sender in self.senders)

    def close(self) -> None:
        for sender in self.senders:
            sender.close()


class _StateCollector(Collector):
    """The node's latest state on /metrics: every present dimension, the health score and the alarms."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        state = self._agent.state
        if state is None:
            return
        node = GaugeMetricFamily(
            "prism_agent_node_metric", "The node's latest measurements (unit in the name)", labels=["metric"]
        )
        for name, value in sorted(metric_values(state.metrics).items()):
            node.add_metric([name], value)
        alarm = GaugeMetricFamily(
            "prism_agent_alarm", "1 while a health dimension is over its alarm threshold", labels=["dimension"]
        )
        for dimension in health(state.metrics).dimensions:
            alarm.add_metric([dimension], 1.0 if dimension in state.alarms else 0.0)
        gpu = GaugeMetricFamily("prism_agent_gpu", "Per-GPU state (unit in the field name)", labels=["gpu", "field"])
        for device in state.gpus:
            for name in ("mem_used_bytes", "mem_total_bytes", "util_ratio", "nvlink_util_ratio", "pcie_util_ratio"):
                value = getattr(device, name)
                if value is not None:
                    gpu.add_metric([str(device.index), name], float(value))
        latency = GaugeMetricFamily(
            "prism_agent_latency_ms", "Observed request latency per slice", labels=["slice", "kind", "quantile"]
        )
        for slice_name, observed in sorted(state.latency.items()):
            for kind in ("ttft", "e2e"):
                for q in ("p50", "p95", "p99"):
                    value = getattr(observed, f"{kind}_{q}_ms")
                    if value is not None:
                        latency.add_metric([slice_name, kind, q], value)
        yield from (node, alarm, gpu, latency)
        sampler = self._agent.sampler
        if sampler is not None:
            failures = CounterMetricFamily("prism_agent_source_failures", "Failed source reads", labels=["source"])
            for name, count in sorted(sampler.failures_total.items()):
                failures.add_metric([name], count)
            yield failures
