"""The agent's loop: sample the node every period and push a NodeVector to the brain."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prismlb.service import MS_TO_S, node_families, sd_notify, serve_metrics, watchdog_interval_s
from prismlb.wire import ConfigError, NodeVector, VectorSender

from ._bounds import InvalidValues
from ._config import AgentConfig, brain_endpoints
from ._ebpf import ConnectCounter, probe_ebpf
from ._node import NodeSampler, NodeState, to_vector
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
        self._ebpf_up = Gauge("prism_agent_ebpf_up", "1 while the eBPF program is attached.", registry=self.registry)
        self.registry.register(_StateCollector(self))
        self.invalid = InvalidValues(self.registry)
        self.started_unix_s = time.time()
        self.state: NodeState | None = None
        self.sampler: NodeSampler | None = None
        self.trace_path: TracePath | None = None
        self._seq = 0
        self._dropping = False

    def run(self, stop: threading.Event) -> None:
        """Report every `period_s` on a fixed monotonic schedule until `stop` is set. Everything opened here is
        closed on the way out, in reverse order, each close taken whatever the others do."""
        config = self.config
        with ExitStack() as stack:
            try:
                metrics = serve_metrics(config.metrics_port, self.registry, config.metrics_addr)
            except OSError as exc:
                raise ConfigError(
                    f"cannot serve /metrics on {config.metrics_addr}:{config.metrics_port}: {exc}"
                ) from None
            if metrics is not None:
                stack.callback(metrics.close)
            counter = self._open_counter(stack)
            ctx = zmq.Context()
            stack.callback(ctx.destroy, linger=0)
            signals = SpanSignals(invalid=self.invalid)
            trace_path = TracePath(
                config,
                counter.tracer if counter is not None else None,
                signals,
                self.registry,
                counter.network if counter is not None else None,
            )
            stack.callback(trace_path.close)
            trace_path.start()
            self.trace_path = trace_path
            sources = stack.enter_context(node_sources(config, counter, signals, self.registry))
            sender = _FanOut(
                [
                    stack.enter_context(VectorSender(ctx, brain, curve=config.curve))
                    for brain in brain_endpoints(config.brain)
                ]
            )
            sampler = NodeSampler(sources)
            self.sampler = sampler
            try:
                self._loop(stop, sender, sampler)
            finally:
                _log.info("stopping: %d vectors sent, %d dropped", sender.sent, sender.dropped)
                sd_notify("STOPPING=1")

    def _open_counter(self, stack: ExitStack) -> ConnectCounter | None:
        """The eBPF counter, when on and it loads, closed with `stack` (`prism_agent_ebpf_up` back to 0)."""
        if not self.config.ebpf:
            _log.info("eBPF off: disabled by --no-ebpf; connection tracing, connect_calls_total and tcp_* stay off")
            return None
        counter, detail = probe_ebpf(self.config.trace_ports, self.config.trace_pids)
        if counter is None:
            _log.warning("eBPF off: %s; connection tracing, connect_calls_total and tcp_* stay off", detail)
        else:
            stack.callback(self._ebpf_up.set, 0)
            stack.callback(counter.close)
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
        vector = to_vector(
            state,
            node_id=config.node_id,
            host=config.host,
            endpoint=config.endpoint,
            zone=config.zone,
            labels=config.labels,
            seq=self._seq,
            sample_time_unix_s=time.time(),
            period_s=config.period_s,
            started_unix_s=self.started_unix_s,
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


_GPU_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("mem_used_bytes", "prism_agent_gpu_mem_used_bytes", "GPU memory in use"),
    ("mem_total_bytes", "prism_agent_gpu_mem_total_bytes", "GPU memory"),
    ("util_ratio", "prism_agent_gpu_util_ratio", "GPU utilisation, 0 to 1"),
    ("nvlink_util_ratio", "prism_agent_gpu_nvlink_util_ratio", "NVLink utilisation, 0 to 1"),
    ("pcie_util_ratio", "prism_agent_gpu_pcie_util_ratio", "PCIe utilisation, 0 to 1"),
)
"""(`GpuState` field, family, HELP) for each per-GPU family, labelled by the GPU's index."""

_LATENCY_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("ttft", "prism_agent_ttft_seconds", "Time to first token per slice over the agent's window"),
    ("e2e", "prism_agent_e2e_latency_seconds", "Request latency end to end per slice over the agent's window"),
)
"""(`ModalityLatency` field prefix, family, HELP): one family per latency, its quantiles in the `quantile` label."""

_QUANTILES: tuple[tuple[str, str], ...] = (("p50", "0.5"), ("p95", "0.95"), ("p99", "0.99"))
"""(`ModalityLatency` field infix, `quantile` label value as Prometheus writes quantiles)."""


class _StateCollector(Collector):
    """The node's latest state on /metrics: every present dimension, each GPU and each slice's latency, one family
    per quantity in base units. Health and alarms are the brain's (`prism_brain_node_health`,
    `prism_brain_node_alarm`): it alone judges the measurements."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        state = self._agent.state
        if state is None:
            return
        yield from node_families("prism_agent_node_", [], [([], state.metrics)])
        for field, name, help_text in _GPU_FAMILIES:
            gpu = GaugeMetricFamily(name, help_text, labels=["gpu"])
            for device in state.gpus:
                value = getattr(device, field)
                if value is not None:
                    gpu.add_metric([str(device.index)], float(value))
            yield gpu
        for kind, name, help_text in _LATENCY_FAMILIES:
            latency = GaugeMetricFamily(name, help_text, labels=["slice", "quantile"])
            for slice_name, observed in sorted(state.latency.items()):
                for infix, quantile in _QUANTILES:
                    value = getattr(observed, f"{kind}_{infix}_ms")
                    if value is not None:
                        latency.add_metric([slice_name, quantile], value * MS_TO_S)
            yield latency
        sampler = self._agent.sampler
        if sampler is not None:
            failures = CounterMetricFamily("prism_agent_source_failures", "Failed source reads", labels=["source"])
            for name, count in sorted(sampler.failures_total.items()):
                failures.add_metric([name], count)
            yield failures
