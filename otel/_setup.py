"""`setup()`: providers, OTLP exporters and a Resource with the process id."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import get_args
from urllib.parse import urlsplit

from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_METRICS_PROTOCOL,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, ProcessResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from prismlb.wire import ConfigError

from ._conventions import SCOPE
from ._metrics import AllocatorGauges, SnapshotProvider, cuda_snapshot_provider
from ._reservation import ReservationMode
from ._telemetry import PrismTelemetry

_PROTOCOLS = ("grpc", "http/protobuf")
_DEFAULT_PROTOCOL = "grpc"  # as the agent's forwarder and opentelemetry-distro


def _protocol(given: str | None, signal_variable: str) -> str:
    env = os.environ.get(signal_variable) or os.environ.get(OTEL_EXPORTER_OTLP_PROTOCOL)
    protocol = (given or env or _DEFAULT_PROTOCOL).strip()
    if protocol not in _PROTOCOLS:
        raise ConfigError(f"OTLP protocol {protocol!r} is not supported; use grpc or http/protobuf")
    return protocol


def _endpoint(endpoint: str | None) -> str | None:
    """The base URL without a trailing slash; ConfigError unless it is http(s)://host:port."""
    if endpoint is None:
        return None
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"OTLP endpoint {endpoint!r} must be a URL such as http://127.0.0.1:4317")
    return endpoint.rstrip("/")


def _span_exporter(endpoint: str | None, protocol: str) -> SpanExporter:
    if protocol == "grpc":
        return GrpcSpanExporter(endpoint=endpoint)
    return HttpSpanExporter(endpoint=None if endpoint is None else f"{endpoint}/v1/traces")


def _metric_exporter(endpoint: str | None, protocol: str) -> MetricExporter:
    if protocol == "grpc":
        return GrpcMetricExporter(endpoint=endpoint)
    return HttpMetricExporter(endpoint=None if endpoint is None else f"{endpoint}/v1/metrics")


def setup(
    service_name: str,
    *,
    endpoint: str | None = None,
    protocol: str | None = None,
    gpu_devices: Iterable[int] | None = None,
    export_interval_s: float = 2.0,
    snapshot_provider: SnapshotProvider | None = None,
    reservation: ReservationMode = "dynamic",
    provider_name: str | None = None,
) -> PrismTelemetry:
    """Export this process's request/stage spans and GPU-allocator gauges over OTLP (to the local agent).

    endpoint: base URL (`http://127.0.0.1:4317` for grpc, `http://127.0.0.1:4318` for http/protobuf); None
    leaves it to the standard OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT variables and the exporters'
    localhost default. protocol: grpc or http/protobuf; None reads OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL,
    else grpc. gpu_devices: device indices to report (None: every device the allocator holds memory on).
    export_interval_s: how often the gauges are collected and exported (the design samples fragmentation
    every 2 s). snapshot_provider: the allocator snapshot in torch's format; None uses
    `torch.cuda.memory_snapshot` when CUDA is available and exports no allocator gauges otherwise.
    reservation: the ReservationAdvisor mode behind `prism.gpu.allocator.reserve_advice_bytes`.
    provider_name: the request spans' `gen_ai.provider.name` (see PrismTelemetry).
    The Resource carries `service.name` and the process attributes (`process.pid`, by which the agent joins
    client spans): call this in the process that serves, after any fork.
    """
    if not service_name:
        raise ConfigError("service_name must not be empty")
    if not (math.isfinite(export_interval_s) and export_interval_s > 0):
        raise ConfigError(f"export_interval_s must be a positive number of seconds, got {export_interval_s}")
    devices = None if gpu_devices is None else tuple(gpu_devices)
    if devices is not None and any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices):
        raise ConfigError(f"gpu_devices must be device indices (ints ≥ 0), got {devices!r}")
    base = _endpoint(endpoint)
    traces_protocol = _protocol(protocol, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)
    metrics_protocol = _protocol(protocol, OTEL_EXPORTER_OTLP_METRICS_PROTOCOL)
    if reservation not in get_args(ReservationMode):
        raise ConfigError(f"reservation must be 'dynamic' or 'static', got {reservation!r}")

    resource = Resource.create({SERVICE_NAME: service_name}).merge(ProcessResourceDetector().detect())
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(_span_exporter(base, traces_protocol)))
    reader = PeriodicExportingMetricReader(
        _metric_exporter(base, metrics_protocol), export_interval_millis=export_interval_s * 1000
    )
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    provider = snapshot_provider if snapshot_provider is not None else cuda_snapshot_provider()
    if provider is not None:
        AllocatorGauges(meter_provider.get_meter(SCOPE), provider, devices, reservation)
    return PrismTelemetry(tracer_provider, meter_provider, provider_name=provider_name)
