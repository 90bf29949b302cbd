"""Request and stage spans.

`prism.request` is an INTERNAL span: the inference server's HTTP or gRPC instrumentation (or the caller's
propagated context) owns the SERVER span, whose 4-tuple the agent joins to the kernel's connection; the
request span is its child when one is current, a root span otherwise. Stage spans (`prism.stage.<name>`,
INTERNAL) are always direct children of their request span, whichever thread or task opens them.
An exception escaping either span sets status ERROR, records it as an event, sets `error.type` and is
re-raised.
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

from prismlb.wire import Slice, parse_signature

from ._conventions import (
    ATTR_GEN_AI_INPUT_TOKENS,
    ATTR_GEN_AI_OPERATION,
    ATTR_GEN_AI_OUTPUT_TOKENS,
    ATTR_GEN_AI_REQUEST_MODEL,
    ATTR_SIGNATURE,
    ATTR_SLICE,
    ATTR_STAGE,
    ATTR_TTFT_MS,
    REQUEST_SPAN,
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


class RequestSpan:
    """The open `prism.request` span of one inference request."""

    def __init__(self, span: Span, slice_: Slice, tracer: Tracer) -> None:
        self.span = span
        self.slice = slice_
        self._tracer = tracer
        self._start_ns = time.monotonic_ns()
        self._lock = threading.Lock()
        self._ttft_ms: float | None = None

    def stage(self, name: str) -> AbstractContextManager[Span]:
        """A `prism.stage.<name>` child span; ValueError unless `name` is one of STAGES."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages are {', '.join(STAGES)}")
        attributes = {ATTR_STAGE: name, ATTR_SLICE: self.slice.value}
        return _span(self._tracer, STAGE_SPAN_PREFIX + name, attributes, parent=self.span)

    def mark_first_token(self) -> float:
        """Milliseconds from the request's start to now, recorded as `prism.ttft_ms`; later calls keep the first."""
        with self._lock:
            if self._ttft_ms is None:
                self._ttft_ms = (time.monotonic_ns() - self._start_ns) / 1e6
                self.span.set_attribute(ATTR_TTFT_MS, self._ttft_ms)
            return self._ttft_ms

    def set_usage(self, *, input_tokens: int | None = None, output_tokens: int | None = None) -> None:
        """Set `gen_ai.usage.input_tokens` / `gen_ai.usage.output_tokens`."""
        if input_tokens is not None:
            self.span.set_attribute(ATTR_GEN_AI_INPUT_TOKENS, _token_count("input_tokens", input_tokens))
        if output_tokens is not None:
            self.span.set_attribute(ATTR_GEN_AI_OUTPUT_TOKENS, _token_count("output_tokens", output_tokens))


@contextmanager
def request_span(tracer: Tracer, signature: str | None, model: str | None, operation: str) -> Iterator[RequestSpan]:
    """A `prism.request` span, current (with its RequestSpan) for the `with` body."""
    slice_ = parse_signature(signature)[0]
    attributes: dict[str, AttributeValue] = {ATTR_SLICE: slice_.value, ATTR_GEN_AI_OPERATION: operation}
    if signature is not None:
        attributes[ATTR_SIGNATURE] = signature
    if model is not None:
        attributes[ATTR_GEN_AI_REQUEST_MODEL] = model
    with _span(tracer, REQUEST_SPAN, attributes) as span:
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
