"""Request and stage spans.

The request span follows the OpenTelemetry GenAI conventions for an inference span: named
`{gen_ai.operation.name} {gen_ai.request.model}` (the operation alone without a model), with
`gen_ai.provider.name`, the request model and token usage, and the engine-side TTFT in seconds; the agent finds
it by `prism.span = "request"`, as the name varies. It is INTERNAL: the inference server's HTTP or gRPC
instrumentation (or the caller's propagated context) owns the SERVER span, whose 4-tuple the agent joins to the
kernel's connection; the request span is its child when one is current, a root span otherwise. Stage spans
(`prism.stage.<name>`, INTERNAL) are always direct children of their request span, whichever thread or task
opens them. An exception escaping either span sets status ERROR, records it as an event, sets `error.type` and
is re-raised.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar

from opentelemetry import trace
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

from prismlb.semantics import Slice, parse_signature

from ._conventions import (
    ATTR_GEN_AI_CACHED_TOKENS,
    ATTR_GEN_AI_INPUT_TOKENS,
    ATTR_GEN_AI_OPERATION,
    ATTR_GEN_AI_OUTPUT_TOKENS,
    ATTR_GEN_AI_PROVIDER,
    ATTR_GEN_AI_REQUEST_MODEL,
    ATTR_GEN_AI_TTFT_S,
    ATTR_SIGNATURE,
    ATTR_SLICE,
    ATTR_SPAN,
    ATTR_STAGE,
    SPAN_REQUEST,
    STAGE_SPAN_PREFIX,
    STAGES,
)

_current: ContextVar[RequestSpan | None] = ContextVar("prismlb_otel_request", default=None)


@contextmanager
def _span(
    tracer: Tracer, name: str, attributes: Mapping[str, AttributeValue], parent: Span | None = None
) -> Iterator[Span]:
    """An INTERNAL span made current; an escaping exception also sets `error.type`."""
    context = None if parent is None else trace.set_span_in_context(parent)
    with tracer.start_as_current_span(name, context=context, kind=SpanKind.INTERNAL, attributes=attributes) as span:
        try:
            yield span
        except Exception as exc:
            span.set_attribute(ERROR_TYPE, type(exc).__qualname__)
            raise


def _token_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def request_span_name(operation: str, model: str | None) -> str:
    """The GenAI span name: `{operation} {model}`, or the operation alone when the model is not known."""
    return operation if model is None else f"{operation} {model}"


def request_attributes(
    slice_: Slice, signature: str | None, *, operation: str, provider: str, model: str | None
) -> dict[str, AttributeValue]:
    """The attributes a request span starts with (the GenAI ones a sampler may read are all known then)."""
    attributes: dict[str, AttributeValue] = {
        ATTR_SPAN: SPAN_REQUEST,
        ATTR_GEN_AI_OPERATION: operation,
        ATTR_GEN_AI_PROVIDER: provider,
        ATTR_SLICE: slice_.value,
    }
    if model is not None:
        attributes[ATTR_GEN_AI_REQUEST_MODEL] = model
    if signature is not None:
        attributes[ATTR_SIGNATURE] = signature
    return attributes


class RequestSpan:
    """The open request span of one inference request."""

    def __init__(self, span: Span, slice_: Slice, tracer: Tracer) -> None:
        self.span = span
        self.slice = slice_
        self._tracer = tracer
        self._start_ns = time.monotonic_ns()
        self._lock = threading.Lock()
        self._ttft_s: float | None = None

    def stage(self, name: str) -> AbstractContextManager[Span]:
        """A `prism.stage.<name>` child span; ValueError unless `name` is one of STAGES."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages are {', '.join(STAGES)}")
        attributes = {ATTR_STAGE: name, ATTR_SLICE: self.slice.value}
        return _span(self._tracer, STAGE_SPAN_PREFIX + name, attributes, parent=self.span)

    def mark_first_token(self) -> float:
        """Seconds from the request's start to now, recorded as `gen_ai.latency.time_to_first_token`; later calls
        keep the first."""
        with self._lock:
            if self._ttft_s is None:
                self._ttft_s = (time.monotonic_ns() - self._start_ns) / 1e9
                self.span.set_attribute(ATTR_GEN_AI_TTFT_S, self._ttft_s)
            return self._ttft_s

    def set_usage(
        self,
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_input_tokens: int | None = None,
    ) -> None:
        """Set `gen_ai.usage.input_tokens` / `output_tokens` / `cache_read.input_tokens` (prompt tokens served
        from the prefix cache, counted in `input_tokens` too)."""
        for name, key, value in (
            ("input_tokens", ATTR_GEN_AI_INPUT_TOKENS, input_tokens),
            ("output_tokens", ATTR_GEN_AI_OUTPUT_TOKENS, output_tokens),
            ("cached_input_tokens", ATTR_GEN_AI_CACHED_TOKENS, cached_input_tokens),
        ):
            if value is not None:
                self.span.set_attribute(key, _token_count(name, value))


@contextmanager
def request_span(
    tracer: Tracer, signature: str | None, *, operation: str, provider: str, model: str | None
) -> Iterator[RequestSpan]:
    """A request span, current (with its RequestSpan) for the `with` body; ValueError for an empty operation."""
    if not operation:
        raise ValueError("operation must be a non-empty gen_ai.operation.name such as 'chat'")
    slice_ = parse_signature(signature)[0]
    attributes = request_attributes(slice_, signature, operation=operation, provider=provider, model=model)
    with _span(tracer, request_span_name(operation, model), attributes) as span:
        request = RequestSpan(span, slice_, tracer)
        token = _current.set(request)
        try:
            yield request
        finally:
            _current.reset(token)


def current_request() -> RequestSpan:
    """The request span current in this context; RuntimeError outside one."""
    request = _current.get()
    if request is None:
        raise RuntimeError(
            "no prism request is current here: open stages inside `with telemetry.request(...)`, "
            "or call `.stage()` on its RequestSpan from another thread"
        )
    return request
