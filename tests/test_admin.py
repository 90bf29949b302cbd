"""The brain's admin API over real HTTP on loopback: tokens, Host and Origin checks, body framing, connection cap."""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from prismlb.brain import resolve_config
from prismlb.brain._admin import MAX_BODY, AdminAccess, AdminQueue, AdminServer, load_token
from prismlb.cli import main as prism
from prismlb.wire import ConfigError

from .conftest import wait_for

TOKEN = "s3cret-admin-token-0123456789abcdef"


class FakeBackend:
    """Records what the server asked of it, so a test can tell a refused mutation never reached the brain."""

    def __init__(self) -> None:
        self.drained: list[tuple[str, bool]] = []
        self.experiments_set: list[tuple[str, dict[str, Any]]] = []

    def status(self) -> dict[str, Any]:
        return {"nodes": [], "epoch": 1, "version": 2}

    def table(self) -> dict[str, Any] | None:
        return None

    def events(self) -> list[dict[str, Any]]:
        return []

    def experiments(self) -> list[dict[str, Any]]:
        return []

    def drain(self, node_id: str, drained: bool) -> dict[str, Any]:
        self.drained.append((node_id, drained))
        return {"node_id": node_id, "drained": drained}

    def set_experiment(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.experiments_set.append((name, body))
        return {"experiment": name}

    def remove_experiment(self, name: str) -> dict[str, Any]:
        return {"removed": name}


class Served:
    """An AdminServer on a free loopback port with a thread standing in for the brain's loop."""

    def __init__(self, access: AdminAccess, **kwargs: Any) -> None:
        self.backend = FakeBackend()
        self.registry = CollectorRegistry()
        mutations = AdminQueue()
        self.server = AdminServer(self.backend, mutations, access, registry=self.registry, **kwargs)
        self.port = self.server.port
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._apply, args=(mutations,), daemon=True)
        self._loop.start()
        self.server.start()

    def _apply(self, mutations: AdminQueue) -> None:
        while not self._stop.wait(0.01):
            mutations.apply_pending()

    def close(self) -> None:
        self._stop.set()
        self.server.close()

    def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None
    ) -> tuple[int, dict[str, str], Any]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            data = response.read()
            return response.status, dict(response.getheaders()), json.loads(data) if data.startswith(b"{") else data
        finally:
            connection.close()

    def raw(self, head: bytes, then: bytes = b"") -> bytes:
        """Sends `head` (and `then`, ignoring a server that hangs up first); returns the status line."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(head)
            try:
                s.sendall(then)
            except OSError:  # the server refused without reading: what these tests want
                pass
            try:
                return s.makefile("rb").readline()
            except (ConnectionResetError, TimeoutError):
                return b""

    def rejected(self, kind: str) -> float:
        value = self.registry.get_sample_value("prism_rejected_messages_total", {"receiver": "admin", "kind": kind})
        return value or 0.0

    def body_bytes(self) -> float:
        return self.registry.get_sample_value("prism_brain_admin_body_bytes_total") or 0.0


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(access: AdminAccess | None = None, **kwargs: Any) -> Served:
        served = Served(access or AdminAccess(token=TOKEN), **kwargs)
        started.append(served)
        return served

    yield start
    for served in started:
        served.close()


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def token_file(tmp_path: Path, mode: int = 0o600, token: str = TOKEN) -> Path:
    path = tmp_path / "admin.token"
    path.write_text(token + "\n")
    path.chmod(mode)
    return path


def test_mutation_without_a_token_is_401_and_never_reaches_the_brain(
    serve: Callable[..., Served], caplog: pytest.LogCaptureFixture
) -> None:
    admin = serve()
    with caplog.at_level(logging.WARNING, logger="prism.brain.admin"):
        for _ in range(2):
            status, headers, body = admin.request("POST", "/v1/nodes/a/drain")
            assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
            assert "Authorization" in body["error"]
    assert admin.backend.drained == []
    assert admin.rejected("no_token") == 2
    assert len([r for r in caplog.records if "no_token" in r.getMessage()]) == 1, "logged once per kind"
    assert admin.request("GET", "/v1/status")[0] == 401, "reads need the token too by default"


def test_wrong_token_is_401(serve: Callable[..., Served], caplog: pytest.LogCaptureFixture) -> None:
    admin = serve()
    with caplog.at_level(logging.WARNING, logger="prism.brain.admin"):
        wrong = (bearer("not-the-token-at-all-123456"), bearer(TOKEN + "x"), {"Authorization": f"Basic {TOKEN}"})
        for headers in wrong:
            status, reply_headers, _ = admin.request("POST", "/v1/nodes/a/drain", headers)
            assert status == 401 and 'error="invalid_token"' in reply_headers["WWW-Authenticate"]
    assert admin.rejected("bad_token") == 3 and admin.backend.drained == []
    assert TOKEN not in caplog.text, "the token is never logged"


def test_right_token_is_served(serve: Callable[..., Served]) -> None:
    admin = serve()
    status, _, body = admin.request("POST", "/v1/nodes/a/drain", bearer())
    assert (status, body) == (200, {"node_id": "a", "drained": True})
    assert admin.backend.drained == [("a", True)]
    put = json.dumps({"slice": "llm", "arms": {"v1": 1.0}}).encode()
    assert admin.request("PUT", "/v1/experiments/canary", bearer(), put)[0] == 200
    assert admin.backend.experiments_set == [("canary", {"slice": "llm", "arms": {"v1": 1.0}})]
    assert admin.request("GET", "/v1/status", bearer())[2]["version"] == 2
    assert admin.body_bytes() == len(put)


def test_public_reads_leave_mutations_guarded(serve: Callable[..., Served]) -> None:
    admin = serve(AdminAccess(token=TOKEN, public_reads=True))
    assert admin.request("GET", "/v1/status")[0] == 200
    assert admin.request("GET", "/v1/experiments")[0] == 200
    assert admin.request("POST", "/v1/nodes/a/drain")[0] == 401
    assert admin.request("DELETE", "/v1/experiments/x")[0] == 401
    assert admin.backend.drained == []


def test_without_a_token_file_reads_only_unless_insecure(serve: Callable[..., Served]) -> None:
    admin = serve(AdminAccess())
    assert admin.request("GET", "/v1/status")[0] == 200
    status, _, body = admin.request("POST", "/v1/nodes/a/drain")
    assert status == 403 and "--admin-token-file" in body["error"]
    assert admin.rejected("mutations_off") == 1 and admin.backend.drained == []
    insecure = serve(AdminAccess(insecure=True))
    assert insecure.request("POST", "/v1/nodes/a/drain")[0] == 200
    with pytest.raises(ConfigError, match="loopback"):
        AdminServer(FakeBackend(), AdminQueue(), AdminAccess(), host="0.0.0.0")


def test_host_must_name_this_server(serve: Callable[..., Served]) -> None:
    admin = serve(AdminAccess(token=TOKEN, allowed_hosts=("brain.internal", "ops.example:8443")))
    port = admin.port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "brain.internal", "brain.internal:443", "ops.example:8443"):
        assert admin.request("GET", "/v1/status", {**bearer(), "Host": host})[0] == 200, host
    for host in (f"evil.example:{port}", f"localhost:{port + 1}", "localhost", "ops.example:9999"):
        status, _, body = admin.request("GET", "/v1/status", {**bearer(), "Host": host})
        assert status == 421 and "Host" in body["error"], host
    assert admin.rejected("bad_host") == 4
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    assert b" 421 " in admin.raw(b"GET /v1/status HTTP/1.0\r\n" + auth + b"\r\n"), "no Host at all"
    two = f"Host: 127.0.0.1:{port}\r\nHost: evil.example\r\n".encode()
    assert b" 421 " in admin.raw(b"GET /v1/status HTTP/1.0\r\n" + two + auth + b"\r\n"), "two Hosts"
    assert admin.rejected("bad_host") == 6


def test_cross_origin_requests_are_refused(serve: Callable[..., Served]) -> None:
    admin = serve()
    port = admin.port
    for origin in ("http://evil.example", f"http://localhost:{port + 1}", "null", f"file://127.0.0.1:{port}"):
        status, _, body = admin.request("POST", "/v1/nodes/a/drain", {**bearer(), "Origin": origin})
        assert status == 403 and "cross-origin" in body["error"], origin
    assert admin.rejected("cross_origin") == 4 and admin.backend.drained == []
    same = {**bearer(), "Origin": f"http://127.0.0.1:{admin.port}"}
    assert admin.request("POST", "/v1/nodes/a/drain", same)[0] == 200


@pytest.mark.parametrize(
    ("framing", "status", "kind"),
    [
        ("Content-Length: -1", 400, "bad_length"),
        ("Content-Length: abc", 400, "bad_length"),
        ("Content-Length: +5", 400, "bad_length"),
        ("Content-Length: 5\r\nContent-Length: 5", 400, "bad_length"),
        (f"Content-Length: {MAX_BODY + 1}", 413, "body_too_large"),
        ("Content-Length: 99999999999999999999999999999999999999", 413, "body_too_large"),
        ("Transfer-Encoding: chunked", 411, "chunked"),
    ],
)
def test_bad_body_framing_is_refused_unread(serve: Callable[..., Served], framing: str, status: int, kind: str) -> None:
    admin = serve()
    head = f"PUT /v1/experiments/x HTTP/1.1\r\nHost: 127.0.0.1:{admin.port}\r\nAuthorization: Bearer {TOKEN}\r\n"
    line = admin.raw(f"{head}{framing}\r\n\r\n".encode())
    assert line.startswith(f"HTTP/1.0 {status} ".encode()), line
    # the same framing followed by 4 MiB of body: the server reads none of it, so its memory cannot grow
    admin.raw(f"{head}{framing}\r\n\r\n".encode(), b"x" * (4 << 20))
    assert admin.rejected(kind) == 2
    assert admin.body_bytes() == 0
    assert admin.backend.experiments_set == []


def test_a_body_of_exactly_the_limit_is_read(serve: Callable[..., Served]) -> None:
    admin = serve()
    body = json.dumps({"slice": "llm", "arms": {"v1": 1.0}, "note": ""}).encode()
    body = body[:-2] + b"x" * (MAX_BODY - len(body)) + body[-2:]
    assert len(body) == MAX_BODY
    assert admin.request("PUT", "/v1/experiments/x", bearer(), body)[0] == 200
    assert admin.body_bytes() == MAX_BODY


def test_a_slow_body_or_slow_headers_time_out(serve: Callable[..., Served]) -> None:
    admin = serve(timeout_s=0.3)
    head = f"PUT /v1/experiments/x HTTP/1.0\r\nHost: 127.0.0.1:{admin.port}\r\nAuthorization: Bearer {TOKEN}\r\n"
    line = admin.raw(f"{head}Content-Length: 100\r\n\r\n".encode(), b'{"slice": ')
    assert line.startswith(b"HTTP/1.0 408 "), line
    assert admin.rejected("slow_body") == 1
    assert admin.body_bytes() == len(b'{"slice": ')
    with socket.create_connection(("127.0.0.1", admin.port), timeout=5) as s:
        s.sendall(b"GET /v1/status HTTP/1.0\r\nHost: ")
        assert s.recv(100) == b"", "the server hangs up on headers that never finish"
    assert wait_for(lambda: admin.rejected("slow_headers") == 1)


def test_connections_are_capped(serve: Callable[..., Served]) -> None:
    admin = serve(max_connections=2)
    holders = [socket.create_connection(("127.0.0.1", admin.port), timeout=5) for _ in range(2)]
    try:
        for s in holders:
            s.sendall(b"GET /v1/status HTTP/1.0\r\n")  # a handler thread waits for the rest of the headers
        assert wait_for(lambda: b" 503 " in admin.raw(b""))
        assert admin.rejected("too_many_connections") >= 1
    finally:
        for s in holders:
            s.close()
    assert wait_for(lambda: admin.request("GET", "/v1/status", bearer())[0] == 200)


def test_unknown_methods_are_counted(serve: Callable[..., Served]) -> None:
    admin = serve()
    assert admin.request("PATCH", "/v1/status", bearer())[0] == 501
    assert admin.rejected("http_501") == 1


def test_token_file_must_be_private(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_token(token_file(tmp_path)) == TOKEN
    for mode in (0o644, 0o640, 0o604, 0o620):
        with pytest.raises(ConfigError, match="chmod 600"):
            load_token(token_file(tmp_path, mode))
    with pytest.raises(ConfigError, match="16 to 4096"):
        load_token(token_file(tmp_path, token="short"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_token(tmp_path / "missing")
    public = token_file(tmp_path, 0o644)
    assert prism(["brain", "--admin-token-file", str(public)]) == 2, "the brain refuses to start"
    assert "chmod 600" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="chmod 600"):
        resolve_config(argparse.Namespace(), {"PRISM_BRAIN_ADMIN_TOKEN_FILE": str(public)})


def test_access_settings_resolve_and_contradictions_are_refused(tmp_path: Path) -> None:
    path = str(token_file(tmp_path))
    config = resolve_config(
        argparse.Namespace(admin_token_file=path, admin_public_reads=True, admin_allowed_hosts="a.example, b:1"), {}
    )
    assert config.admin_access == AdminAccess(TOKEN, True, False, ("a.example", "b:1"))
    assert TOKEN not in repr(config), "configs are logged; the token is not"
    assert resolve_config(argparse.Namespace(), {}).admin_access == AdminAccess()
    refused = {
        "--admin-insecure contradicts": argparse.Namespace(admin_token_file=path, admin_insecure=True),
        "needs --admin-token-file": argparse.Namespace(admin_public_reads=True),
        "not loopback": argparse.Namespace(admin_addr="0.0.0.0"),
    }
    for message, args in refused.items():
        with pytest.raises(ConfigError, match=message):
            resolve_config(args, {})
    assert resolve_config(argparse.Namespace(admin_addr="0.0.0.0", admin_token_file=path), {}).admin_addr == "0.0.0.0"


def test_ctl_sends_the_token_from_its_file(
    serve: Callable[..., Served], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = serve()
    url = f"http://127.0.0.1:{admin.port}"
    path = str(token_file(tmp_path))
    monkeypatch.delenv("PRISM_BRAIN_ADMIN_TOKEN_FILE", raising=False)
    assert prism(["ctl", "--admin", url, "drain", "a"]) == 1
    assert "--token-file" in capsys.readouterr().err
    assert prism(["ctl", "--admin", url, "--token-file", path, "drain", "a"]) == 0
    assert json.loads(capsys.readouterr().out) == {"node_id": "a", "drained": True}
    monkeypatch.setenv("PRISM_BRAIN_ADMIN_TOKEN_FILE", path)
    assert prism(["ctl", "--admin", url, "undrain", "a"]) == 0
    assert prism(["top", "--admin", url, "--once"]) == 0
    assert admin.backend.drained == [("a", True), ("a", False)]
    assert prism(["ctl", "--admin", url, "--token-file", str(tmp_path / "missing"), "status"]) == 1
    assert "cannot read the admin token file" in capsys.readouterr().err
