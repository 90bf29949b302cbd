"""The span path through the agent: received → held briefly → joined to connections → forwarded."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from ._join import SpanJoiner

_log = logging.getLogger("prism.agent.spans")

Submit = Callable[[ExportTraceServiceRequest], None]


class SpanPipeline:
    """Holds each trace request `join_delay_s` (so the kernel events of its connections have been read),
    enriches it, and hands it on. Never drops: when the holding queue is full, a request skips the join."""

    def __init__(self, joiner: SpanJoiner, submit: Submit, join_delay_s: float = 0.25, max_pending: int = 1024) -> None:
        self.joiner = joiner
        self._submit = submit
        self._delay_s = join_delay_s
        self._max_pending = max_pending
        self._pending: deque[tuple[float, ExportTraceServiceRequest]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.join_skipped = 0
        self.join_errors = 0
        self._thread = threading.Thread(target=self._run, name="prism-span-join", daemon=True)
        self._thread.start()

    def put(self, request: ExportTraceServiceRequest) -> None:
        """Take a request from the OTLP receiver; never blocks."""
        with self._cond:
            if len(self._pending) < self._max_pending and not self._stopping:
                self._pending.append((time.monotonic() + self._delay_s, request))
                self._cond.notify()
                return
            self.join_skipped += 1
        self._submit(request)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (not self._pending or self._pending[0][0] > time.monotonic()):
                    timeout = self._pending[0][0] - time.monotonic() if self._pending else None
                    self._cond.wait(timeout)
                if self._stopping and not self._pending:
                    return
                _, request = self._pending.popleft()
            self._join(request)
            self._submit(request)

    def _join(self, request: ExportTraceServiceRequest) -> None:
        try:
            self.joiner.enrich(request)
        except Exception:
            self.join_errors += 1
            if self.join_errors == 1:
                _log.exception("span join failed; spans are forwarded unjoined (further failures only counted)")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Join and hand on everything still held, then stop."""
        with self._cond:
            self._stopping = True
            self._pending = deque((0.0, request) for _, request in self._pending)
            self._cond.notify()
        self._thread.join(timeout_s)
