"""What the tests' stand-in HTTP servers share: a request handler that answers with whole responses and keeps
the test's output free of request logs."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar

from prismlb.service import reply_bytes

_Server = TypeVar("_Server", bound=ThreadingHTTPServer)


class LoopbackServer(ThreadingHTTPServer):
    """A test's HTTP server on a free loopback port, a daemon thread per connection; `address` is its base URL."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.address = f"http://127.0.0.1:{self.server_address[1]}"


def refused_address() -> str:
    """A loopback base URL whose port was free a moment ago and is not listened on: connects there are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


class QuietHandler(BaseHTTPRequestHandler):
    """A handler with `reply` for a response whose length is known, and no request log on stderr."""

    def reply(self, status: int, body: bytes, content_type: str | None = None) -> None:
        """Send `status` and `body` with its Content-Length (and `content_type` when given)."""
        reply_bytes(self, status, body, content_type)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a test's output is its failures."""


@contextlib.contextmanager
def serving_http(*servers: _Server, poll_s: float = 0.05) -> Iterator[tuple[_Server, ...]]:
    """`servers` each served on a daemon thread (polling for shutdown every `poll_s`), shut down and closed on the
    way out."""
    for server in servers:
        threading.Thread(target=server.serve_forever, args=(poll_s,), daemon=True).start()
    try:
        yield servers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
