"""Sends N GET requests, a new connection for most, a few kept alive; reports each connection's 4-tuple.

Run: python http_client.py HOST PORT N   -> prints one JSON summary line
With OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set, each request is also a CLIENT span (OTel SDK, OTLP/HTTP).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import sys
from collections.abc import Iterator

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import ProcessResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind

PROVIDER: TracerProvider | None = None
if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
    PROVIDER = TracerProvider(
        resource=Resource.create({"service.name": "test-http-client"}).merge(ProcessResourceDetector().detect())
    )
    PROVIDER.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=100, max_queue_size=20000))


@contextlib.contextmanager
def client_span(host: str, port: int, path: str, local: tuple[str, int]) -> Iterator[None]:
    if PROVIDER is None:
        yield
        return
    attributes = {
        "http.request.method": "GET",
        "server.address": host,
        "server.port": port,
        "url.full": f"http://{host}:{port}{path}",
        "test.client.local_address": local[0],
        "test.client.local_port": local[1],
    }
    with PROVIDER.get_tracer("prism.tests.client").start_as_current_span("GET", kind=SpanKind.CLIENT, attributes=attributes):
        yield


def main() -> None:
    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tuples: list[list[object]] = []
    failures = 0
    sent = 0
    while sent < count:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            conn.connect()
            local = conn.sock.getsockname()[:2]
            remote = conn.sock.getpeername()[:2]
            per_connection = 3 if sent % 50 == 0 else 1  # some connections carry several requests
            for _ in range(min(per_connection, count - sent)):
                path = f"/r{sent}"
                with client_span(host, port, path, local):
                    conn.request("GET", path, headers={"X-Test-Local-Port": str(local[1]), "X-Test-Local-Address": local[0]})
                    conn.getresponse().read()
                tuples.append([local[0], local[1], remote[0], remote[1]])
                sent += 1
        except OSError:
            failures += 1
            sent += 1
        finally:
            conn.close()
    if PROVIDER is not None:
        PROVIDER.shutdown()
    print(json.dumps({"requests": len(tuples), "failures": failures, "tuples": tuples}), flush=True)


if __name__ == "__main__":
    main()
