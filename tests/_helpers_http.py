"""What the tests' stand-in HTTP servers share: a request handler that answers with whole responses and keeps
the test's output free of request logs."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler

from prismlb.service import reply_bytes


class QuietHandler(BaseHTTPRequestHandler):
    """A handler with `reply` for a response whose length is known, and no request log on stderr."""

    def reply(self, status: int, body: bytes, content_type: str | None = None) -> None:
        """Send `status` and `body` with its Content-Length (and `content_type` when given)."""
        reply_bytes(self, status, body, content_type)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a test's output is its failures."""
