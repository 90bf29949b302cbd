"""The brain's admin interface: a small JSON-over-HTTP API on a local port, used by `prism ctl` and `prism top`.

GET  /v1/status                      nodes (health, weights, prediction, alarms), table version, guardian
GET  /v1/table                       the current routing table
POST /v1/nodes/{id}/drain            stop routing to a node (kept out of every slice until undrained)
POST /v1/nodes/{id}/undrain
GET  /v1/experiments                 the A/B experiments
PUT  /v1/experiments/{name}          body {"slice": "llm", "arms": {"v1": 0.9, "v2": 0.1}}
DELETE /v1/experiments/{name}
GET  /v1/events                      recent drift events and guardian transitions

Access (`AdminAccess`): with a token file every request needs `Authorization: Bearer <token>`, except reads
(GET) when `public_reads` is set. Without a token file the server binds only to loopback, serves reads, and
refuses mutations unless `insecure` is set. Every request must name this server in `Host` (loopback names
with the port, the bind address, or `allowed_hosts`) so a DNS-rebound name is refused, and an `Origin` that is
not this server is refused so a browser page cannot post here cross-site.

Bodies: at most 64 KiB, framed only by one decimal Content-Length (no Transfer-Encoding), read within the
handler timeout; anything else is refused before it is read. At most `max_connections` connections are served
at once (one thread each); the rest get 503. Every refusal is counted by kind (`prism_rejected_messages_total`,
receiver "admin") and the first of each kind is logged.

Mutations are handed to the brain's loop thread (a bounded queue) and answered when applied; reads use the
loop's last published snapshot.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import queue
import re
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from prismlb.service import NoDelayHandler, reply_json
from prismlb.wire import ConfigError, RejectCounter

_log = logging.getLogger("prism.brain.admin")
MAX_BODY = 64 * 1024
MAX_CONNECTIONS = 16  # one thread each; an admin API has a handful of operators, not a crowd
TIMEOUT_S = 10.0  # per request: headers and body must arrive within this, so a slow client frees its slot
_TOKEN = re.compile(r"[\x21-\x7e]{16,4096}")  # visible ASCII, so it fits a header; 16+ so it is not guessable
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_REALM = 'Bearer realm="prism-admin"'


class AdminError(Exception):
    """A request the brain refuses; becomes an HTTP error with this status, counted under `kind`."""

    def __init__(
        self, status: HTTPStatus, message: str, kind: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind or status.phrase.lower().replace(" ", "_")
        self.headers = headers or {}


@dataclass(frozen=True)
class AdminAccess:
    """Who may call the admin API; see the module docstring for the policy these fields select."""

    token: str | None = field(default=None, repr=False)  # repr=False: configs get logged, secrets must not
    public_reads: bool = False
    insecure: bool = False
    allowed_hosts: tuple[str, ...] = ()


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the admin API on this machine (the only safe place without a token)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def admin_access(
    host: str, token_file: str | None, public_reads: bool, insecure: bool, allowed_hosts: str | None
) -> AdminAccess:
    """Access settings from the brain's flags, refusing contradictions at start rather than guessing."""
    if token_file is None:
        if not is_loopback(host):
            raise ConfigError(f"admin address {host} is not loopback: beyond this machine needs --admin-token-file")
        if public_reads:
            raise ConfigError("--admin-public-reads needs --admin-token-file (without one, reads are open on loopback)")
        token = None
    else:
        if insecure:
            raise ConfigError("--admin-insecure contradicts --admin-token-file")
        token = load_token(Path(token_file))
    hosts = tuple(h.strip() for h in (allowed_hosts or "").split(",") if h.strip())
    return AdminAccess(token, public_reads, insecure, hosts)


def load_token(path: Path) -> str:
    """The admin token in `path`; refuses a file that other users could read or change, since either lets
    them act as the operator."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise ConfigError(f"admin token file {path} is not a regular file")
            if mode & 0o077:
                raise ConfigError(
                    f"admin token file {path} has mode {stat.S_IMODE(mode):04o}: group and others must have no "
                    f"access (chmod 600 {path})"
                )
            raw = f.read(4097)
    except OSError as exc:
        raise ConfigError(f"cannot read the admin token file {path}: {exc.strerror}") from None
    token = raw.decode("ascii", errors="replace").strip()
    if not _TOKEN.fullmatch(token):
        raise ConfigError(
            f"admin token file {path} must hold one token of 16 to 4096 visible ASCII characters "
            "(e.g. from `openssl rand -hex 32`)"
        )
    return token


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
    """Serves the admin API for `backend` on host:port (port 0 picks a free one; see `.port`) under `access`.

    Refusals are counted on `registry` (when given) as `prism_rejected_messages_total{receiver="admin"}`, and
    body bytes read as `prism_brain_admin_body_bytes_total`, so an operator can see a flood and its size."""

    def __init__(
        self,
        backend: AdminBackend,
        mutations: AdminQueue,
        access: AdminAccess | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        registry: CollectorRegistry | None = None,
        timeout_s: float = TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._backend = backend
        self._mutations = mutations
        self.access = access or AdminAccess()
        if self.access.token is None and not is_loopback(host):
            raise ConfigError(f"the admin API on {host} needs a token file: without one it binds only to loopback")
        self.timeout_s = timeout_s
        self.rejects = RejectCounter("admin", _log, registry)
        self.body_bytes = Counter(
            "prism_brain_admin_body_bytes", "Request body bytes the admin API read", registry=registry
        )
        handler = type("Handler", (_Handler,), {"admin": self, "timeout": timeout_s})
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._server = _Server((host.strip("[]"), port), handler, family, self, max_connections)
        except OSError as exc:
            raise ConfigError(f"cannot serve the admin API on {host}:{port}: {exc.strerror}") from None
        self.port = int(self._server.server_address[1])
        self._hosts, self._any_port = _accepted_hosts(host, self.port, self.access.allowed_hosts)
        self._thread = threading.Thread(target=self._server.serve_forever, name="prism-admin", daemon=True)

    def start(self) -> None:
        self._thread.start()
        access = self.access
        if access.token is not None:
            policy = "token required" + (" for mutations, reads public" if access.public_reads else "")
        else:
            policy = "no token: reads only" if not access.insecure else "no token: mutations ALLOWED (--admin-insecure)"
        _log.info("admin API on http://%s:%d/v1/status (%s)", self._server.server_address[0], self.port, policy)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def check(self, method: str, headers: Message) -> None:
        """Refuses a request from a name that is not this server, from another site's page, or without the
        credentials `access` asks for."""
        hosts = headers.get_all("Host") or []
        host = hosts[0].strip().lower() if len(hosts) == 1 else ""
        if host not in self._hosts and _host_name(host) not in self._any_port:
            raise AdminError(HTTPStatus.MISDIRECTED_REQUEST, f"Host {host!r} is not this admin API", "bad_host")
        origin = headers.get("Origin")
        if origin is not None:
            scheme, sep, netloc = origin.strip().lower().partition("://")
            if not sep or scheme not in ("http", "https") or netloc.rstrip("/") != host:
                raise AdminError(HTTPStatus.FORBIDDEN, f"cross-origin request from {origin!r}", "cross_origin")
        access = self.access
        if access.token is None:
            if method != "GET" and not access.insecure:
                raise AdminError(
                    HTTPStatus.FORBIDDEN,
                    "changes are off: start the brain with --admin-token-file (or --admin-insecure)",
                    "mutations_off",
                )
            return
        if method == "GET" and access.public_reads:
            return
        given = headers.get("Authorization")
        if given is None:
            raise AdminError(
                HTTPStatus.UNAUTHORIZED,
                "needs Authorization: Bearer <token> (prism ctl --token-file)",
                "no_token",
                {"WWW-Authenticate": _REALM},
            )
        scheme, _, credential = given.strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(credential.strip().encode(), access.token.encode()):
            raise AdminError(
                HTTPStatus.UNAUTHORIZED,
                "wrong admin token",
                "bad_token",
                {"WWW-Authenticate": f'{_REALM}, error="invalid_token"'},
            )

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


def _host_name(host: str) -> str:
    """`host` (a Host header value) without its port: `[::1]:9470` -> `[::1]`, `brain:9470` -> `brain`."""
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.partition(":")[0]


def _accepted_hosts(bind: str, port: int, allowed: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """Host header values this server answers: (exact values, names accepted with any port).

    Loopback names and the bind address need this port (Host omits it only for port 80); an allowed name
    given without a port is accepted with any, as a reverse proxy in front may forward its own port."""
    names = list(_LOOPBACK_NAMES)
    if bind not in ("0.0.0.0", "::", "[::]", ""):  # a wildcard is no name a client uses
        names.append(f"[{bind}]" if ":" in bind and not bind.startswith("[") else bind)
    exact = {f"{name.lower()}:{port}" for name in names} | ({n.lower() for n in names} if port == 80 else set())
    any_port = set()
    for entry in (a.strip().lower() for a in allowed):
        (exact if _host_name(entry) != entry else any_port).add(entry)
    return frozenset(exact), frozenset(any_port)


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once: the rest get 503 from the accept thread,
    so a connection flood costs sockets briefly, not threads and memory."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        family: socket.AddressFamily,
        admin: AdminServer,
        max_connections: int,
    ) -> None:
        self.address_family = family
        self._admin = admin
        self._max = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._admin.rejects.count("too_many_connections", f"{client_address[0]}: over {self._max} connections")
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        body = b'{"error": "too many admin connections"}'
        head = (
            "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        request.settimeout(1.0)
        try:
            request.sendall(head.encode() + body)
        except OSError:  # the client is gone or not reading; the refusal is counted already
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that broke mid-reply (client gone); logged quietly instead of a traceback on stderr."""
        _log.debug("admin connection from %s failed", client_address[0], exc_info=True)


class _Handler(NoDelayHandler):
    admin: AdminServer

    def _serve(self, method: str) -> None:
        path = self.path.split("?")[0]
        try:
            self.admin.check(method, self.headers)
            body = self._body()
            result = self.admin.handle(method, path, body)
            reply_json(self, HTTPStatus.OK, result, default=str)
        except AdminError as exc:
            self._refuse(method, path, exc)
        except (ValueError, KeyError, TypeError) as exc:
            self._refuse(method, path, AdminError(HTTPStatus.BAD_REQUEST, str(exc)))

    def _refuse(self, method: str, path: str, exc: AdminError) -> None:
        self.admin.rejects.count(exc.kind, f"{method} {path!r} from {self.client_address[0]}: {exc}")
        reply_json(self, exc.status, {"error": str(exc)}, exc.headers, default=str)

    def _body(self) -> dict[str, Any] | None:
        """The JSON body, refused before any of it is read when its framing is not one sane Content-Length."""
        if "Transfer-Encoding" in self.headers:
            raise AdminError(
                HTTPStatus.LENGTH_REQUIRED, "Transfer-Encoding is not accepted: send Content-Length", "chunked"
            )
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            return None
        if len(lengths) > 1:
            raise AdminError(HTTPStatus.BAD_REQUEST, "more than one Content-Length", "bad_length")
        text = lengths[0].strip()
        if not (text.isascii() and text.isdigit()):
            raise AdminError(HTTPStatus.BAD_REQUEST, f"Content-Length {text!r} is not a byte count", "bad_length")
        if len(text) > len(str(MAX_BODY)) or int(text) > MAX_BODY:
            raise AdminError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes", "body_too_large")
        raw = self._read(int(text))
        if not raw:
            return None
        try:
            return json.loads(raw)  # type: ignore[no-any-return]
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdminError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}", "bad_json") from None

    def _read(self, length: int) -> bytes:
        """`length` bytes within the handler timeout in all, so a client dripping bytes cannot hold a slot."""
        deadline = time.monotonic() + self.admin.timeout_s
        data = bytearray()
        while len(data) < length:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(left)
                chunk = self.rfile.read1(length - len(data))
            except TimeoutError:
                raise AdminError(HTTPStatus.REQUEST_TIMEOUT, "body not received in time", "slow_body") from None
            if not chunk:
                raise AdminError(HTTPStatus.BAD_REQUEST, "body shorter than its Content-Length", "short_body")
            data += chunk
            self.admin.body_bytes.inc(len(chunk))
        self.connection.settimeout(self.admin.timeout_s)  # the reply gets the full timeout, not what is left
        return bytes(data)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (malformed request line, oversized headers, unknown method) are counted
        like ours."""
        self.admin.rejects.count(f"http_{code}", f"from {self.client_address[0]}: {message or code}")
        super().send_error(code, message, explain)

    def log_error(self, format: str, *args: Any) -> None:
        """http.server reports a request line or headers that did not arrive in time only here: counted."""
        if args and isinstance(args[0], TimeoutError):
            self.admin.rejects.count("slow_headers", f"from {self.client_address[0]}: headers not received in time")

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
