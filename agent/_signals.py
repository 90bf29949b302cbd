"""What the agent learns from OTLP data: per-slice request latency and load from request spans, CPU
preprocessing P95 from the worker library's stage spans, and GPU-allocator fragmentation from its metrics
(names in prismlb.otel).

Request spans come in three shapes, all feeding the same windows:

- prismlb.otel's GenAI-named span (`chat llama-3-8b`), found by `prism.span = "request"`: e2e is its
  duration, TTFT `gen_ai.latency.time_to_first_token` in seconds;
- the worker library's earlier `prism.request` span, TTFT `prism.ttft_ms` in milliseconds (servers deployed
  before the GenAI names keep sending it);
- an engine's own request span, vLLM's `llm_request` (any span with `gen_ai.latency.e2e` or
  `gen_ai.latency.time_to_first_token`): e2e `gen_ai.latency.e2e` and TTFT in seconds, measured inside the
  engine; without `prism.slice` on it, it counts in the default slice.

A server that sends both its engine's spans and prismlb.otel's for the same requests counts them twice: turn
one of them off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from prismlb.otel._conventions import (
    ATTR_GEN_AI_E2E_S,
    ATTR_GEN_AI_TTFT_S,
    ATTR_GPU,
    ATTR_SLICE,
    ATTR_SPAN,
    ATTR_STAGE,
    CPU_PREPROCESSING_STAGES,
    LEGACY_ATTR_TTFT_MS,
    LEGACY_REQUEST_SPAN,
    METRIC_FRAGMENTATION,
    SPAN_REQUEST,
    STAGE_SPAN_PREFIX,
)
from prismlb.semantics import DEFAULT_SLICE, Slice
from prismlb.wire import ModalityLatency

from ._bounds import LATENCY_MS, RATIO, InvalidValues
from ._windows import LOAD_WINDOW_S, SliceWindows, Window

_SPAN_KEYS = frozenset({ATTR_SPAN, ATTR_SLICE, ATTR_STAGE, ATTR_GEN_AI_TTFT_S, ATTR_GEN_AI_E2E_S, LEGACY_ATTR_TTFT_MS})
"""The span attributes the signals read; the rest are skipped unread."""
_MS_PER_S = 1000.0


def _value(kv: KeyValue) -> object:
    """A scalar attribute's value (bool as bool); None for an array, a map, bytes or an empty value."""
    kind = kv.value.WhichOneof("value")
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(kv.value, kind)
    return None


def _attr(kvs: list[KeyValue] | object, key: str) -> str | int | float | None:
    for kv in kvs:  # type: ignore[attr-defined]
        if kv.key == key:
            value = _value(kv)
            return value if isinstance(value, str | int | float) and not isinstance(value, bool) else None
    return None


def _read(span: Span) -> dict[str, object]:
    """The attributes of `_SPAN_KEYS` the span carries, in one pass over its attributes."""
    return {kv.key: _value(kv) for kv in span.attributes if kv.key in _SPAN_KEYS}


def _slice(attrs: dict[str, object]) -> str:
    value = attrs.get(ATTR_SLICE)
    return value if isinstance(value, str) and value in Slice.__members__.values() else DEFAULT_SLICE.value


def _is_request(span: Span, attrs: dict[str, object]) -> bool:
    """Whether `span` is one request's span in any of the three shapes (see the module docstring)."""
    return (
        attrs.get(ATTR_SPAN) == SPAN_REQUEST
        or span.name == LEGACY_REQUEST_SPAN
        or ATTR_GEN_AI_E2E_S in attrs
        or ATTR_GEN_AI_TTFT_S in attrs
    )


class SpanSignals:
    """Windows fed by spans and metrics as they arrive; read by the sampler at each dimension's period.

    `clock` gives monotonic seconds (injectable for tests); windows: latency and load `load_window_s`,
    CPU preprocessing `preprocessing_window_s` (10 s). A latency or ratio outside its bound (a
    negative TTFT, a span ending before it started, a fragmentation of 7) is dropped and counted in `invalid`;
    the rest of the span or metric is still used."""

    def __init__(
        self,
        load_window_s: float = LOAD_WINDOW_S,
        preprocessing_window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        invalid: InvalidValues | None = None,
    ) -> None:
        self._clock = clock
        self.invalid = invalid if invalid is not None else InvalidValues()
        self._requests = SliceWindows(load_window_s)
        self._preprocessing = Window(preprocessing_window_s)
        self._fragmentation: dict[int, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def on_traces(self, request: ExportTraceServiceRequest) -> None:
        now = self._clock()
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attrs = _read(span)
                    if _is_request(span, attrs):
                        self._request(span, attrs, now)
                    elif span.name.startswith(STAGE_SPAN_PREFIX):
                        if attrs.get(ATTR_STAGE) in CPU_PREPROCESSING_STAGES:
                            stage_ms = self._duration_ms(span, "prism.stage.duration_ms")
                            if stage_ms is not None:
                                self._preprocessing.add(stage_ms, now)

    def _request(self, span: Span, attrs: dict[str, object], now: float) -> None:
        """Add one request span's e2e, error and TTFT to its slice's windows."""
        e2e_ms = self._latency_ms(attrs, ATTR_GEN_AI_E2E_S, _MS_PER_S)
        if e2e_ms is None:
            e2e_ms = self._duration_ms(span, "prism.request.duration_ms")
        ttft_ms = self._latency_ms(attrs, ATTR_GEN_AI_TTFT_S, _MS_PER_S)
        if ttft_ms is None:
            ttft_ms = self._latency_ms(attrs, LEGACY_ATTR_TTFT_MS, 1.0)
        error = span.status.code == Status.STATUS_CODE_ERROR
        self._requests.add(_slice(attrs), now, ttft_ms=ttft_ms, e2e_ms=e2e_ms, error=error)

    def _latency_ms(self, attrs: dict[str, object], field: str, to_ms: float) -> float | None:
        """Attribute `field` times `to_ms`, in milliseconds; None when absent, and (counted under `field`) when
        not a number or out of range."""
        if field not in attrs:
            return None
        value = attrs[field]
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.invalid.count("span", field, value)
            return None
        return self.invalid.check("span", field, float(value) * to_ms, LATENCY_MS)

    def _duration_ms(self, span: Span, field: str) -> float | None:
        """The span's duration in ms; None (counted under `field`) when it ends before it starts or is absurd."""
        return self.invalid.check(
            "span", field, (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6, LATENCY_MS
        )

    def on_metrics(self, request: ExportMetricsServiceRequest) -> None:
        now = self._clock()
        for resource_metrics in request.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name != METRIC_FRAGMENTATION or metric.WhichOneof("data") != "gauge":
                        continue
                    for point in metric.gauge.data_points:
                        gpu = _attr(point.attributes, ATTR_GPU)
                        if not isinstance(gpu, int):
                            continue
                        raw = point.as_double if point.WhichOneof("value") == "as_double" else float(point.as_int)
                        value = self.invalid.check("otlp_metric", METRIC_FRAGMENTATION, raw, RATIO)
                        if value is not None:
                            with self._lock:
                                self._fragmentation[gpu] = (now, value)

    def cpu_preprocessing_p95_ms(self) -> float | None:
        quantiles = self._preprocessing.quantiles(self._clock(), (0.95,))
        return quantiles[0] if quantiles else None

    def fragmentation_ratio(self, max_age_s: float) -> float | None:
        """The worst GPU's latest fragmentation ratio reported within `max_age_s`; None without one."""
        horizon = self._clock() - max_age_s
        with self._lock:
            fresh = [value for at, value in self._fragmentation.values() if at >= horizon]
        return max(fresh) if fresh else None

    def latency(self) -> dict[str, ModalityLatency]:
        """Per slice: requests, TTFT and end-to-end P50/P95/P99 over the load window."""
        return self._requests.latency(self._clock())

    def requests_per_s(self) -> float | None:
        """Completed requests per second over the load window, all slices; None before any request."""
        return self._requests.requests_per_s(self._clock())
