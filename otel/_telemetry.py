"""PrismTelemetry: what `setup()` hands an inference server."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from types import TracebackType

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span

from ._conventions import SCOPE
from ._spans import RequestSpan, current_request, request_span


class PrismTelemetry:
    """Request and stage spans, and the providers that export them and the allocator gauges over OTLP.

    The providers are not made global; an application that wants its own instrumentation exported the same
    way passes them on (`opentelemetry.trace.set_tracer_provider(telemetry.tracer_provider)`).
    """

    def __init__(self, tracer_provider: TracerProvider, meter_provider: MeterProvider) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self._tracer = tracer_provider.get_tracer(SCOPE)
        self._lock = threading.Lock()
        self._shut_down = False

    def request(
        self, signature: str | None, *, model: str | None = None, operation: str = "chat"
    ) -> AbstractContextManager[RequestSpan]:
        """A `prism.request` span for one request with this `X-Modality-Signature` (None: header absent).

        `model` sets `gen_ai.request.model`; `operation` sets `gen_ai.operation.name`.
        """
        return request_span(self._tracer, signature, model, operation)

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
