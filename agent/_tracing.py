"""The agent's trace path: kernel connections in, OTLP spans, metrics and logs in (spans and metrics also
feeding the node's signals), joined spans out to the collector, metrics and logs passed on to it unchanged."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import ExitStack

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._config import AgentConfig
from ._connections import Connection
from ._conntrack import ConnectionTracer
from ._join import ConnectionIndex, SpanJoiner
from ._network import NetworkWindow
from ._otlp_forward import Passed, RequestForwarder, SpanForwarder, passthrough_forwarders, upstream_exporter
from ._otlp_receiver import OtlpReceiver
from ._signals import SpanSignals
from ._spans import SpanPipeline

_log = logging.getLogger("prism.agent")


class TracePath:
    """Owns the connection index fed by the tracer (when there is one), the OTLP receiver, the join and the
    forwarder. Spans flow without eBPF too: they are then forwarded unjoined. The tracer's ESTABLISHED events
    also go to `network` (the TCP health window's handshake times), when given."""

    def __init__(
        self,
        config: AgentConfig,
        tracer: ConnectionTracer | None,
        signals: SpanSignals,
        registry: CollectorRegistry,
        network: NetworkWindow | None = None,
    ) -> None:
        self.tracer = tracer
        self.network = network
        self.signals = signals
        self.index = ConnectionIndex()
        self.joiner = SpanJoiner(self.index, stats=tracer.stats if tracer is not None else None)
        self._stop = threading.Event()
        self._kernel = threading.Thread(target=self._poll_kernel, name="prism-kernel-events", daemon=True)
        self.receiver: OtlpReceiver | None = None
        self.forwarder: SpanForwarder | None = None
        self.passthrough: dict[Passed, RequestForwarder] = {}
        self.pipeline = SpanPipeline(self.joiner, self._forward, join_delay_s=config.join_delay_s)
        try:
            if config.otlp_grpc_port or config.otlp_http_port:
                self.receiver = OtlpReceiver(
                    self._on_traces,
                    self._on_metrics,
                    on_logs=self._on_logs,
                    host=config.otlp_host,
                    grpc_port=config.otlp_grpc_port,
                    http_port=config.otlp_http_port,
                    max_connections=config.otlp_max_connections,
                    max_inflight_bytes=config.otlp_max_inflight_bytes,
                    read_timeout_s=config.otlp_read_timeout_s,
                    max_grpc_rpcs=config.otlp_max_grpc_rpcs,
                    registry=registry,
                )
                exporter = upstream_exporter(self.receiver.addresses)
                if exporter is not None:
                    self.forwarder = SpanForwarder(exporter, registry=registry)
                self.passthrough = passthrough_forwarders(self.receiver.addresses, registry)
        except BaseException:  # e.g. an upstream that is the receiver itself: free its ports, end the threads
            self.close()
            raise
        registry.register(_TraceCollector(self))

    def start(self) -> None:
        if self.tracer is not None:
            self.tracer.on_established = self._established
            self.tracer.on_closed = self.index.closed
            self._kernel.start()
        if self.receiver is not None:
            self.receiver.start()
            _log.info(
                "OTLP receiver on %s",
                ", ".join(f"{host}:{port}" for host, port in self.receiver.addresses),
            )

    def _established(self, connection: Connection) -> None:
        self.index.established(connection)
        if self.network is not None:
            self.network.established(connection)

    def _on_traces(self, request: ExportTraceServiceRequest) -> None:
        self.signals.on_traces(request)
        self.pipeline.put(request)

    def _on_metrics(self, request: ExportMetricsServiceRequest) -> None:
        self.signals.on_metrics(request)
        self._pass_on("metrics", request)

    def _on_logs(self, request: ExportLogsServiceRequest) -> None:
        self._pass_on("logs", request)

    def _pass_on(self, signal: Passed, request: ExportMetricsServiceRequest | ExportLogsServiceRequest) -> None:
        forwarder = self.passthrough.get(signal)
        if forwarder is not None:
            forwarder.submit(request)

    def _poll_kernel(self) -> None:
        assert self.tracer is not None
        while not self._stop.is_set():
            self.tracer.poll(100)

    def _forward(self, request: ExportTraceServiceRequest) -> None:
        if self.forwarder is not None:
            self.forwarder.submit(request)

    def close(self) -> None:
        """Stop receiving, join and forward what is held, then stop reading kernel events: in that order (what
        is still flowing reaches the upstream), each step taken whatever the others do. Closes a path whose
        making failed part way too."""
        with ExitStack() as stack:  # it runs the last registered first: the steps go in from last to first
            stack.callback(self._stop_kernel)
            for forwarder in reversed(self.passthrough.values()):
                stack.callback(forwarder.shutdown, timeout_s=5.0)
            if self.forwarder is not None:
                stack.callback(self.forwarder.shutdown, timeout_s=5.0)
            stack.callback(self.pipeline.shutdown)
            if self.receiver is not None:
                stack.callback(self.receiver.shutdown)

    def _stop_kernel(self) -> None:
        self._stop.set()
        if self._kernel.is_alive():
            self._kernel.join(timeout=5)


class _TraceCollector(Collector):
    def __init__(self, path: TracePath) -> None:
        self._path = path

    def collect(self) -> Iterator[Metric]:
        counts = self._path.joiner.counts
        for name, help_text, value in (
            ("prism_agent_join_server_spans", "Server spans received", counts.server_spans),
            (
                "prism_agent_join_server_spans_with_peer",
                "Server spans naming a TCP peer",
                counts.server_spans_with_peer,
            ),
            ("prism_agent_join_server_spans_joined", "Server spans joined to a connection", counts.server_spans_joined),
            ("prism_agent_join_client_spans", "Client spans received", counts.client_spans),
            ("prism_agent_join_client_spans_joined", "Client spans joined to a connection", counts.client_spans_joined),
            (
                "prism_agent_join_skipped",
                "Span requests forwarded unjoined (join queue full)",
                self._path.pipeline.join_skipped,
            ),
        ):
            yield CounterMetricFamily(name, help_text, value=value)
        if counts.coverage is not None:
            yield GaugeMetricFamily(
                "prism_agent_join_coverage_ratio",
                "Joined server spans / server spans that had a TCP connection",
                value=counts.coverage,
            )
        yield GaugeMetricFamily(
            "prism_agent_connections_indexed", "Connections kept for the join", value=len(self._path.index)
        )
        tracer = self._path.tracer
        if tracer is not None:
            yield CounterMetricFamily(
                "prism_agent_ebpf_events", "Connection events read from the kernel", value=tracer.events_total
            )
            yield CounterMetricFamily(
                "prism_agent_ebpf_lost_events", "Connection events the ring buffer lost (it was full)", value=tracer.lost_events
            )
