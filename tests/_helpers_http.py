"""What the tests' stand-in HTTP servers share: a request handler that answers with whole responses and keeps
the test's output free of request logs."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler


class QuietHandler(BaseHTTPRequestHandler):
    """A handler with `reply` for a response whose length is known, and no request log on stderr."""

    def reply(self, status: int, body: bytes, content_type: str | None = None) -> None:
        """Send `status` and `body` with its Content-Length (and `content_type` when given)."""
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a test's output is its failures."""
