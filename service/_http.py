"""Whole responses from an `http.server` handler: a service's endpoints (the brain's admin API, the OTLP
receiver, the emulated engine) answer with a body whose length is known, so every reply is written alike."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any


def reply_bytes(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: bytes,
    content_type: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Send `status` and `body` with its Content-Length (so a keep-alive connection knows where the next response
    starts), its `content_type` when given, then `headers`."""
    handler.send_response(status)
    if content_type is not None:
        handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


def reply_json(
    handler: BaseHTTPRequestHandler,
    status: int,
    payload: object,
    headers: Mapping[str, str] | None = None,
    *,
    default: Callable[[Any], Any] | None = None,
) -> None:
    """Send `payload` as JSON (`default` as in `json.dumps`, for values JSON has no type for), as `reply_bytes`."""
    reply_bytes(handler, status, json.dumps(payload, default=default).encode(), "application/json", headers)
