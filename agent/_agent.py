"""The agent's loop: sample the node every period and push a NodeVector to the brain."""

from __future__ import annotations

import logging
import math
import threading
import time

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge

from prismlb.wire import (
    ConfigError,
    NodeMetrics,
    NodeVector,
    VectorSender,
    sd_notify,
    serve_metrics,
    watchdog_interval_s,
)

from ._config import AgentConfig
from ._ebpf import ConnectCounter, probe_ebpf
from ._host import HostSampler
from ._tracing import TracePath

_log = logging.getLogger("prism.agent")


class Agent:
    """One node's reporter; `run` blocks until `stop` is set, then closes everything it opened."""

    def __init__(self, config: AgentConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self._sent = Counter(
            "prism_agent_vectors_sent", "Node vectors queued for the brain.", registry=self.registry
        )
        self._dropped = Counter(
            "prism_agent_vectors_dropped",
            "Node vectors dropped because the queue to the brain was full.",
            registry=self.registry,
        )
        self._ebpf_up = Gauge(
            "prism_agent_ebpf_up", "1 while the eBPF connect() counter is attached.", registry=self.registry
        )
        self._connect_calls = Gauge(
            "prism_agent_connect_calls",
            "connect() calls on this host since the eBPF counter was attached.",
            registry=self.registry,
        )
        self._cpu = Gauge("prism_agent_cpu_util_ratio", "Host CPU utilisation, 0 to 1.", registry=self.registry)
        self._mem_used = Gauge(
            "prism_agent_mem_used_bytes", "Host memory in use (total minus available).", registry=self.registry
        )
        self._mem_total = Gauge("prism_agent_mem_total_bytes", "Host memory in total.", registry=self.registry)
        self._seq = 0
        self._dropping = False
        self.trace_path: TracePath | None = None

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
            trace_path = TracePath(config, counter.tracer if counter is not None else None, self.registry)
            trace_path.start()
            self.trace_path = trace_path
            sender = VectorSender(ctx, config.brain, curve=config.curve)
            try:
                self._loop(stop, sender, HostSampler(), counter)
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
            _log.info("eBPF off: disabled by --no-ebpf; connect_calls_total stays absent")
            return None
        counter, detail = probe_ebpf(self.config.trace_ports, self.config.trace_pids)
        if counter is None:
            _log.warning("eBPF off: %s; connect_calls_total stays absent", detail)
        else:
            _log.info("eBPF on: %s", detail)
            self._ebpf_up.set(1)
        return counter

    def _loop(
        self, stop: threading.Event, sender: VectorSender, sampler: HostSampler, counter: ConnectCounter | None
    ) -> None:
        period = self.config.period_s
        watchdog = watchdog_interval_s()
        if watchdog is not None and watchdog < period:
            _log.warning("period %.3g s is longer than half the systemd watchdog (%.3g s)", period, watchdog)
        sd_notify("READY=1")
        _log.info(
            "started: node %s reports to %s every %.3g s%s",
            self.config.node_id,
            self.config.brain,
            period,
            " over CURVE" if self.config.curve is not None else "",
        )
        next_due = time.monotonic() + period
        while not stop.wait(max(0.0, next_due - time.monotonic())):
            self._report(sender, sampler, counter)
            if watchdog is not None:
                sd_notify("WATCHDOG=1")
            next_due += period
            behind = time.monotonic() - next_due
            if behind > 0:  # missed slots (suspend, stall): skip them, keep the schedule's phase
                next_due += math.ceil(behind / period) * period

    def _report(self, sender: VectorSender, sampler: HostSampler, counter: ConnectCounter | None) -> None:
        host = sampler.sample()
        connect_calls = counter.total() if counter is not None else None
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
            metrics=NodeMetrics(
                cpu_util_ratio=host.cpu_util_ratio,
                mem_used_bytes=host.mem_used_bytes,
                mem_total_bytes=host.mem_total_bytes,
                connect_calls_total=connect_calls,
            ),
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
        if host.cpu_util_ratio is not None:
            self._cpu.set(host.cpu_util_ratio)
        self._mem_used.set(host.mem_used_bytes)
        self._mem_total.set(host.mem_total_bytes)
        if connect_calls is not None:
            self._connect_calls.set(connect_calls)
