"""OTLP spans from the emulated engine, shaped as an instrumented inference server sends them to its agent.

For each finished request, once it is done, with the model's times as explicit timestamps:

    POST /v1/chat/completions          SERVER    HTTP semantic conventions, the TCP 4-tuple (the agent's join)
    └── chat <model>                   INTERNAL  prismlb.otel's request span (GenAI conventions, prism.span =
        │                                        "request"): slice, signature, provider `vllm`, model,
        │                                        input/output/cached tokens, TTFT in seconds
        ├── prism.stage.queue          INTERNAL  arrival → admitted into prefill
        ├── prism.stage.encode         INTERNAL  the media encoder's share of prefill (only with media parts)
        ├── prism.stage.prefill        INTERNAL  → first token
        └── prism.stage.decode         INTERNAL  first token → last token

Names and attributes come from `prismlb.otel` (`_conventions`, and the request span's name and first
attributes from `_spans`), so the agent reads them as the worker library's. The provider is `vllm`: the
emulated engine stands in for vLLM (its `/metrics` are vLLM's).
`queue` and `encode` are GPU-side stages of the library's STAGES; the agent forwards them and, as they are not
CPU preprocessing, leaves them out of that dimension.

Times are the emulator's model time: the spans start at the request's arrival on the wall clock and last what
the model says (`time_scale` 1: the wall clock), as the engine's `/metrics` histograms do.

Export: a TracerProvider of its own (never the global one), a BatchSpanProcessor with a bounded queue (spans
past it are dropped and counted by the SDK, never held), and the OTLP exporter of `prismlb.otel.setup`:
gRPC or HTTP/protobuf from `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`, gRPC by default.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.environment_variables import OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
from opentelemetry.sdk.resources import SERVICE_NAME, ProcessResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from prismlb.otel._conventions import (
    ATTR_GEN_AI_CACHED_TOKENS,
    ATTR_GEN_AI_INPUT_TOKENS,
    ATTR_GEN_AI_OUTPUT_TOKENS,
    ATTR_GEN_AI_TTFT_S,
    ATTR_SLICE,
    ATTR_STAGE,
    SCOPE,
    STAGE_SPAN_PREFIX,
)
from prismlb.otel._setup import _endpoint, _protocol
from prismlb.otel._spans import request_attributes, request_span_name
from prismlb.semantics import parse_signature

from ._model import GpuProfile, Job

SERVICE = "prism-emulated-engine"
ROUTE = "/v1/chat/completions"
OPERATION = "chat"
PROVIDER = "vllm"
ATTR_GPU_CLASS = "prism.sim.gpu_class"
ATTR_TIME_SCALE = "prism.sim.time_scale"
MAX_QUEUE_SPANS = 4096
"""Spans held for export at most (six per request); more are dropped by the processor."""
EXPORT_TIMEOUT_S = 2.0


def _exporter(base: str, protocol: str) -> SpanExporter:
    if protocol == "grpc":
        return GrpcSpanExporter(endpoint=base, insecure=True, timeout=EXPORT_TIMEOUT_S)
    return HttpSpanExporter(endpoint=f"{base}/v1/traces", timeout=EXPORT_TIMEOUT_S)


class EngineSpans:
    """Spans of the emulated engine's finished requests, exported over OTLP to `endpoint` (the local agent).

    `endpoint` is a base URL (`http://127.0.0.1:4317` for gRPC, `:4318` for HTTP/protobuf); `protocol`
    `grpc` or `http/protobuf`, None: as `prismlb.otel.setup` (environment, else gRPC). `time_scale` is the
    engine's: model seconds are `time.monotonic()` / `time_scale`. Raises `prismlb.wire.ConfigError` for a
    malformed endpoint or an unknown protocol.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        gpu_class: str,
        profile: GpuProfile,
        time_scale: float = 1.0,
        model: str | None = None,
        protocol: str | None = None,
        max_queue_spans: int = MAX_QUEUE_SPANS,
        exporter: SpanExporter | None = None,
    ) -> None:
        base = _endpoint(endpoint)
        assert base is not None
        self.endpoint = base
        self.protocol = _protocol(protocol, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)
        self.profile = profile
        self.time_scale = time_scale
        self.model = model
        resource = Resource.create(
            {SERVICE_NAME: SERVICE, ATTR_GPU_CLASS: gpu_class, ATTR_TIME_SCALE: time_scale}
        ).merge(ProcessResourceDetector().detect())
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter if exporter is not None else _exporter(base, self.protocol),
                max_queue_size=max_queue_spans,
                max_export_batch_size=min(512, max_queue_spans),
                schedule_delay_millis=500,
                export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
            )
        )
        self._tracer = self.provider.get_tracer(SCOPE)
        # Model time → Unix time: monotonic and wall clocks read together once.
        self._unix_minus_monotonic_ns = time.time_ns() - time.monotonic_ns()
        self._lock = threading.Lock()
        self.emitted = 0
        """Requests whose spans were recorded."""

    def _unix_ns(self, arrival_s: float) -> int:
        return self._unix_minus_monotonic_ns + round(arrival_s * self.time_scale * 1e9)

    def request_done(
        self,
        job: Job,
        *,
        signature: str | None,
        peer: tuple[Any, ...] | None = None,
        local: tuple[Any, ...] | None = None,
        status: int = 200,
        media: Mapping[str, int] | None = None,
    ) -> None:
        """Record a finished request's spans (never blocks: export happens on the processor's thread).

        `peer` and `local` are the connection's (address, port) as the HTTP server sees them; `media` the
        media parts by modality, named on the encode stage.
        """
        arrival, admitted, first, finish = job.arrival_s, job.admitted_s, job.first_token_s, job.finish_s
        if admitted is None or first is None or finish is None:
            return  # not finished: nothing to report
        start_ns = self._unix_ns(arrival)

        def at(model_s: float) -> int:
            return start_ns + round((model_s - arrival) * 1e9)

        slice_ = parse_signature(signature)[0]
        server_attrs: dict[str, AttributeValue] = {
            "http.request.method": "POST",
            "http.route": ROUTE,
            "url.path": ROUTE,
            "url.scheme": "http",
            "http.response.status_code": status,
            "network.protocol.version": "1.1",
            "network.transport": "tcp",
        }
        if peer is not None:
            server_attrs["network.peer.address"] = str(peer[0])
            server_attrs["network.peer.port"] = int(peer[1])
            server_attrs["client.address"] = str(peer[0])
        if local is not None:
            server_attrs["network.local.address"] = str(local[0])
            server_attrs["network.local.port"] = int(local[1])
            server_attrs["server.address"] = str(local[0])
            server_attrs["server.port"] = int(local[1])
        end_ns = at(finish)
        server = self._tracer.start_span(
            f"POST {ROUTE}", kind=SpanKind.SERVER, attributes=server_attrs, start_time=start_ns
        )
        request_attrs = request_attributes(slice_, signature, operation=OPERATION, provider=PROVIDER, model=self.model)
        request_attrs[ATTR_GEN_AI_INPUT_TOKENS] = job.prompt_tokens
        request_attrs[ATTR_GEN_AI_OUTPUT_TOKENS] = job.output_tokens
        request_attrs[ATTR_GEN_AI_CACHED_TOKENS] = job.cached_tokens
        request_attrs[ATTR_GEN_AI_TTFT_S] = first - arrival
        request = self._tracer.start_span(
            request_span_name(OPERATION, self.model),
            context=trace.set_span_in_context(server),
            kind=SpanKind.INTERNAL,
            attributes=request_attrs,
            start_time=start_ns,
        )
        inside = trace.set_span_in_context(request)
        encode_end = admitted + self._encode_share(job) * (first - admitted)
        stages: list[tuple[str, float, float, dict[str, AttributeValue]]] = [("queue", arrival, admitted, {})]
        if job.encoder_s > 0:
            extra: dict[str, AttributeValue] = {"prism.sim.media": sorted(media)} if media else {}
            stages.append(("encode", admitted, encode_end, extra))
        stages.append(("prefill", encode_end, first, {}))
        stages.append(("decode", first, finish, {}))
        for name, begin, end, extra in stages:
            stage = self._tracer.start_span(
                STAGE_SPAN_PREFIX + name,
                context=inside,
                kind=SpanKind.INTERNAL,
                attributes={ATTR_STAGE: name, ATTR_SLICE: slice_.value, **extra},
                start_time=at(begin),
            )
            stage.end(end_time=at(end))
        request.end(end_time=end_ns)
        server.end(end_time=end_ns)
        with self._lock:
            self.emitted += 1

    def _encode_share(self, job: Job) -> float:
        """The encoder's part of the prefill stage (the model stretches both parts alike)."""
        if job.encoder_s <= 0:
            return 0.0
        tokens_s = (job.prompt_tokens - job.cached_tokens) / self.profile.prefill_tokens_per_s
        return job.encoder_s / (job.encoder_s + tokens_s)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export every recorded span now; False if that did not finish in time."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def close(self) -> None:
        """Export what is held (bounded by the exporter's timeout) and stop."""
        self.provider.shutdown()
