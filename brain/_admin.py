"""The brain's admin interface: a small JSON-over-HTTP API on a local port, used by `prism ctl` and `prism top`.

GET  /v1/status                      nodes (health, weights, prediction, alarms), table version, guardian
GET  /v1/table                       the current routing table
POST /v1/nodes/{id}/drain            stop routing to a node (kept out of every slice until undrained)
POST /v1/nodes/{id}/undrain
GET  /v1/experiments                 the A/B experiments
PUT  /v1/experiments/{name}          body {"slice": "llm", "arms": {"v1": 0.9, "v2": 0.1}}
DELETE /v1/experiments/{name}
GET  /v1/events                      recent drift events and guardian transitions

Mutations are handed to the brain's loop thread (a bounded queue) and answered when applied; reads use the
loop's last published snapshot. Bodies over 64 KiB, bad JSON and unknown paths get 4xx with a JSON error.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prismlb.wire import ConfigError

_log = logging.getLogger("prism.brain.admin")
MAX_BODY = 64 * 1024


class AdminError(Exception):
    """A request the brain refuses; becomes an HTTP error with this status."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdminBackend(Protocol):
    """What the admin server needs from the brain; reads run in server threads, `apply` in the loop."""

    def status(self) -> dict[str, Any]: ...

    def table(self) -> dict[str, Any] | None: ...

    def events(self) -> list[dict[str, Any]]: ...

    def experiments(self) -> list[dict[str, Any]]: ...

    def drain(self, node_id: str, drained: bool) -> dict[str, Any]: ...

    def set_experiment(self, name: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def remove_experiment(self, name: str) -> dict[str, Any]: ...


@dataclass
class _Call:
    run: Callable[[], dict[str, Any]]
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None
    error: Exception | None = None


class AdminQueue:
    """Mutations waiting for the loop thread; the loop calls `apply_pending()` each turn."""

    def __init__(self, max_pending: int = 64) -> None:
        self._calls: queue.Queue[_Call] = queue.Queue(max_pending)

    def submit(self, run: Callable[[], dict[str, Any]], timeout_s: float = 5.0) -> dict[str, Any]:
        call = _Call(run)
        try:
            self._calls.put_nowait(call)
        except queue.Full:
            raise AdminError(HTTPStatus.SERVICE_UNAVAILABLE, "too many admin requests pending") from None
        if not call.done.wait(timeout_s):
            raise AdminError(HTTPStatus.GATEWAY_TIMEOUT, "the brain did not apply the change in time")
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    def apply_pending(self) -> None:
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                call.result = call.run()
            except Exception as exc:  # handed back to the waiting HTTP thread
                call.error = exc
            call.done.set()


_NODE = re.compile(r"^/v1/nodes/([A-Za-z0-9][A-Za-z0-9._:@-]{0,127})/(drain|undrain)$")
_EXPERIMENT = re.compile(r"^/v1/experiments/([A-Za-z0-9][A-Za-z0-9._-]{0,63})$")


class AdminServer:
    """Serves the admin API for `backend` on host:port (port 0 picks a free one; see `.port`)."""

    def __init__(self, backend: AdminBackend, mutations: AdminQueue, host: str = "127.0.0.1", port: int = 0) -> None:
        self._backend = backend
        self._mutations = mutations
        handler = type("Handler", (_Handler,), {"admin": self})
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve the admin API on {host}:{port}: {exc.strerror}") from None
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="prism-admin", daemon=True)

    def start(self) -> None:
        self._thread.start()
        _log.info("admin API on http://%s:%d/v1/status", self._server.server_address[0], self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def handle(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any] | list[Any]:
        b = self._backend
        if method == "GET":
            if path == "/v1/status":
                return b.status()
            if path == "/v1/table":
                table = b.table()
                if table is None:
                    raise AdminError(HTTPStatus.NOT_FOUND, "no routing table yet")
                return table
            if path == "/v1/events":
                return b.events()
            if path == "/v1/experiments":
                return b.experiments()
        elif method == "POST" and (m := _NODE.match(path)):
            node_id, action = m.groups()
            return self._mutations.submit(lambda: b.drain(node_id, action == "drain"))
        elif method == "PUT" and (m := _EXPERIMENT.match(path)):
            if not isinstance(body, dict):
                raise AdminError(HTTPStatus.BAD_REQUEST, "expected a JSON object body")
            name = m.group(1)
            return self._mutations.submit(lambda: b.set_experiment(name, body))
        elif method == "DELETE" and (m := _EXPERIMENT.match(path)):
            name = m.group(1)
            return self._mutations.submit(lambda: b.remove_experiment(name))
        raise AdminError(HTTPStatus.NOT_FOUND, f"no such endpoint: {method} {path}")


class _Handler(BaseHTTPRequestHandler):
    admin: AdminServer

    def _serve(self, method: str) -> None:
        try:
            body = self._body() if method in ("PUT", "POST") else None
            result = self.admin.handle(method, self.path.split("?")[0], body)
            self._reply(HTTPStatus.OK, result)
        except AdminError as exc:
            self._reply(exc.status, {"error": str(exc)})
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})

    def _body(self) -> dict[str, Any] | None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise AdminError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes")
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw)  # type: ignore[no-any-return]
        except json.JSONDecodeError as exc:
            raise AdminError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from None

    def _reply(self, status: HTTPStatus, payload: object) -> None:
        data = json.dumps(payload, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._serve("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def log_message(self, format: str, *args: object) -> None:
        pass
