"""An HTTP server instrumented with the OpenTelemetry SDK, exporting its spans over OTLP/HTTP.

Run: python otel_http_server.py HOST PORT   (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT names the collector)
Prints "ready PORT" once listening; SIGTERM flushes the spans and exits.
"""

from __future__ import annotations

import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import ProcessResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Tracer


def make_provider() -> TracerProvider:
    """A provider exporting over OTLP/HTTP to where OTEL_EXPORTER_OTLP_TRACES_ENDPOINT says."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": "test-http-server"}).merge(ProcessResourceDetector().detect())
    )
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=100, max_queue_size=20000, max_export_batch_size=512)
    )
    return provider


def make_server(host: str, port: int, tracer: Tracer) -> ThreadingHTTPServer:
    """A threading HTTP server whose requests each make one SERVER span with `tracer`."""
    handler = type("Handler", (Handler,), {"tracer": tracer})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    tracer: Tracer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        peer_addr, peer_port = self.client_address[:2]
        local_addr, local_port = self.connection.getsockname()[:2]
        attributes = {
            "http.request.method": "GET",
            "url.path": self.path,
            "server.port": local_port,
            "network.transport": "tcp",
            "network.peer.address": peer_addr,
            "network.peer.port": peer_port,
            "network.local.address": local_addr,
            "client.address": peer_addr,
            "client.port": peer_port,
            "test.client.local_port": int(self.headers.get("X-Test-Local-Port", "0")),
            "test.client.local_address": self.headers.get("X-Test-Local-Address", ""),
        }
        with self.tracer.start_as_current_span("GET", kind=SpanKind.SERVER, attributes=attributes):
            body = b"ok\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    provider = make_provider()
    server = make_server(sys.argv[1], int(sys.argv[2]), provider.get_tracer("prism.tests.server"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"ready {server.server_address[1]}", flush=True)
    stop.wait()
    server.shutdown()
    provider.shutdown()


if __name__ == "__main__":
    main()
