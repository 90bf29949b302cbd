"""PrismTelemetry: what `setup()` hands an inference server."""

from __future__ import annotations

import sys
import threading
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Final

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span

from prismlb.wire import ConfigError

from ._conventions import PROVIDER_OTHER, SCOPE
from ._spans import RequestSpan, current_request, request_span

ENGINES: Final = ("sglang", "vllm")
"""Self-hosted engines recognised by their package; SGLang first, as it may import vLLM's kernels."""


def serving_engine() -> str:
    """The engine whose package this process has imported (the one it serves with), else `_OTHER`."""
    return next((engine for engine in ENGINES if engine in sys.modules), PROVIDER_OTHER)


def _provider(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"provider_name must be a non-empty string such as 'vllm', got {name!r}")
    return name


class PrismTelemetry:
    """Request and stage spans, and the providers that export them and the allocator gauges over OTLP.

    The providers are not made global; an application that wants its own instrumentation exported the same
    way passes them on (`opentelemetry.trace.set_tracer_provider(telemetry.tracer_provider)`).
    """

    def __init__(
        self, tracer_provider: TracerProvider, meter_provider: MeterProvider, *, provider_name: str | None = None
    ) -> None:
        """`provider_name` is the request spans' `gen_ai.provider.name` (ConfigError when empty); None: the
        engine this process has imported by the time each request starts (`vllm`, `sglang`), else `_OTHER`, so
        a server may set up telemetry before it imports its engine. The attribute changes it later."""
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self._provider_name = None if provider_name is None else _provider(provider_name)
        self._tracer = tracer_provider.get_tracer(SCOPE)
        self._lock = threading.Lock()
        self._shut_down = False

    @property
    def provider_name(self) -> str:
        """`gen_ai.provider.name` of the request spans opened from now on."""
        return self._provider_name if self._provider_name is not None else serving_engine()

    @provider_name.setter
    def provider_name(self, name: str) -> None:
        self._provider_name = _provider(name)

    def request(
        self, signature: str | None, *, model: str | None = None, operation: str = "chat"
    ) -> AbstractContextManager[RequestSpan]:
        """A request span for one request with this `X-Modality-Signature` (None: header absent).

        `operation` sets `gen_ai.operation.name`, `model` `gen_ai.request.model`; the span is named
        `{operation} {model}` (`{operation}` without a model) as the GenAI conventions name inference spans.
        """
        return request_span(self._tracer, signature, operation=operation, provider=self.provider_name, model=model)

    def stage(self, name: str) -> AbstractContextManager[Span]:
        """A `prism.stage.<name>` span in the current request; see RequestSpan.stage."""
        return current_request().stage(name)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export every finished span and a collection of the metrics now; False if that timed out or failed."""
        millis = int(timeout_s * 1000)
        spans = self.tracer_provider.force_flush(millis)
        return self.meter_provider.force_flush(millis) and spans

    def shutdown(self) -> None:
        """Flush and stop both providers; later calls do nothing."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        self.meter_provider.shutdown()
        self.tracer_provider.shutdown()

    def __enter__(self) -> PrismTelemetry:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.shutdown()
