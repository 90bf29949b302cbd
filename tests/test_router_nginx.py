"""`render_nginx`: a routing table as nginx upstream blocks with weights, max_fails and fail_timeout, that nginx
itself loads and runs; and `prism route --nginx KEY`, which names the server nginx's consistent hash picks."""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prismlb.router import render_nginx
from prismlb.wire import RoutingTable, SliceTable, TableNode

from ._helpers_http import QuietHandler
from .conftest import free_port, wait_for
from .test_router import Brain


def node(node_id: str, endpoint: str, weight: float, gpu: int | None = None) -> TableNode:
    return TableNode(node_id=node_id, endpoint=endpoint, weight=weight, gpu=gpu)


TABLE = RoutingTable(
    epoch=7,
    version=3,
    issued_unix_s=86400.0,
    guardian="degrade",
    slices=[
        SliceTable(
            name="llm",
            nodes=[
                node("a100-1", "http://10.0.0.1:8000", 1.0),
                node("a100-2", "http://10.0.0.2:8000/", 0.55),
                node("a100-3", "10.0.0.3:8000", 0.05),
            ],
        ),
        SliceTable(
            name="av",
            nodes=[node("l40s-1", "http://10.0.1.1:8000", 0.5, gpu=g) for g in range(4)]
            + [node("l40s-2", "http://[fd00::2]:8000", 0.25, gpu=0)],
        ),
        SliceTable(name="vlm", nodes=[], fallback="llm"),
        SliceTable(name="rag", nodes=[]),
    ],
)


def test_every_slice_becomes_an_upstream_with_nginx_weights() -> None:
    assert render_nginx(TABLE, max_fails=3, fail_timeout_s=30).splitlines() == [
        "# Prism routing table epoch 7 version 3, issued 1970-01-02T00:00:00Z, guardian 'degrade'",
        "upstream prism_llm {",
        "    hash $http_x_prism_affinity_key consistent;",
        "    server 10.0.0.1:8000 weight=20 max_fails=3 fail_timeout=30s;  # a100-1",
        "    server 10.0.0.2:8000 weight=11 max_fails=3 fail_timeout=30s;  # a100-2",
        "    server 10.0.0.3:8000 weight=1 max_fails=3 fail_timeout=30s;  # a100-3",
        "}",
        "upstream prism_av {",
        "    hash $http_x_prism_affinity_key consistent;",
        "    server 10.0.1.1:8000 weight=40 max_fails=3 fail_timeout=30s;  # l40s-1",  # four GPUs of one server
        "    server [fd00::2]:8000 weight=5 max_fails=3 fail_timeout=30s;  # l40s-2",
        "}",
        "# slice 'vlm' has no nodes: the servers of its fallback 'llm'",
        "upstream prism_vlm {",
        "    hash $http_x_prism_affinity_key consistent;",
        "    server 10.0.0.1:8000 weight=20 max_fails=3 fail_timeout=30s;  # a100-1",
        "    server 10.0.0.2:8000 weight=11 max_fails=3 fail_timeout=30s;  # a100-2",
        "    server 10.0.0.3:8000 weight=1 max_fails=3 fail_timeout=30s;  # a100-3",
        "}",
        "# slice 'rag': no nodes, so no upstream prism_rag",
    ]


def test_one_slice_round_robin_and_bad_endpoints_left_out() -> None:
    table = RoutingTable(
        epoch=1,
        version=1,
        issued_unix_s=0.0,
        slices=[
            SliceTable(
                name="llm",
                nodes=[node("ok", "http://host-1.pool:9000", 1.0), node("evil", "h:1; include /etc/passwd", 1.0)],
            ),
            SliceTable(name="vlm\n}", nodes=[]),
        ],
    )
    text = render_nginx(table, slice_name="llm", hash_key="")
    assert text.splitlines()[1:] == [
        "upstream prism_llm {",
        "    server host-1.pool:9000 weight=20 max_fails=1 fail_timeout=10s;  # ok",
        "    # node evil: not host:port or a URL of one, left out",
        "}",
    ]
    assert "# slice 'vlm\\n}': no nodes, so no upstream prism_vlm__" in render_nginx(table)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="no slice 'x'"):
        render_nginx(TABLE, slice_name="x")
    with pytest.raises(ValueError, match="one nginx variable"):
        render_nginx(TABLE, hash_key="$x; evil")
    with pytest.raises(ValueError, match="max_fails"):
        render_nginx(TABLE, max_fails=-1)
    with pytest.raises(ValueError, match="fail_timeout_s"):
        render_nginx(TABLE, fail_timeout_s=0)
    with pytest.raises(ValueError, match="PORT or HOST:PORT"):
        render_nginx(TABLE, slice_name="llm", listen="127.0.0.1:70000")
    with pytest.raises(ValueError, match="a server block proxies to one slice"):
        render_nginx(TABLE, listen="8080")


def test_overflow_entries_are_backup_servers_or_left_out_under_hash() -> None:
    spill = TableNode(node_id="h100-1", endpoint="http://10.0.2.1:8000", weight=1.0, overflow=True)
    pool = node("l40s-1", "http://10.0.1.1:8000", 1.0)
    table = RoutingTable(epoch=1, version=1, issued_unix_s=0.0, slices=[SliceTable(name="av", nodes=[pool, spill])])
    assert render_nginx(table, hash_key="").splitlines()[1:] == [
        "upstream prism_av {",
        "    server 10.0.1.1:8000 weight=20 max_fails=1 fail_timeout=10s;  # l40s-1",
        "    server 10.0.2.1:8000 backup max_fails=1 fail_timeout=10s;  # h100-1",
        "}",
    ]
    hashed = render_nginx(table).splitlines()
    assert "    # 10.0.2.1:8000 (h100-1): overflow entry, left out (no backup servers with hash)" in hashed
    assert not any("server 10.0.2.1" in line for line in hashed)


NGINX = shutil.which("nginx", path=f"{os.environ.get('PATH', '')}:/usr/sbin")
needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: apt-get install -y nginx)")


def nginx_conf(prefix: Path, rendered: str) -> Path:
    """A whole nginx config around `rendered` (what `render_nginx` wrote, included in `http` as it is): one
    foreground process, logs and temporary files under `prefix`."""
    temp = " ".join(
        f"{kind}_temp_path {prefix / 'tmp'};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (prefix / "tmp").mkdir(exist_ok=True)
    (prefix / "prism.conf").write_text(rendered)
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"pid {prefix / 'nginx.pid'};\nerror_log {prefix / 'error.log'};\nmaster_process off;\ndaemon off;\n"
        f"events {{}}\nhttp {{\n    access_log off;\n    {temp}\n    include {prefix / 'prism.conf'};\n}}\n"
    )
    return conf


def nginx_test(prefix: Path, rendered: str) -> subprocess.CompletedProcess[str]:
    assert NGINX is not None
    conf = nginx_conf(prefix, rendered)
    command = [NGINX, "-t", "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


@pytest.fixture
def run_nginx(tmp_path: Path) -> Iterator[Callable[[str, int], None]]:
    """Start nginx on a rendered config whose server block listens on the given loopback port."""
    started: list[subprocess.Popen[bytes]] = []

    def start(rendered: str, port: int) -> None:
        assert NGINX is not None
        conf = nginx_conf(tmp_path, rendered)
        log = tmp_path / "error.log"
        started.append(subprocess.Popen([NGINX, "-p", str(tmp_path), "-e", str(log), "-c", str(conf)]))

        def listening() -> bool:
            assert started[-1].poll() is None, log.read_text()
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, what="nginx listening")

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=10)


class _Echo(QuietHandler):
    """Answers every GET with the name its server was given and the path it was asked for (quietly: a unix
    socket peer has no address to log)."""

    def do_GET(self) -> None:
        self.reply(200, f"{self.server.name} {self.path}".encode())  # type: ignore[attr-defined]


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture
def echo_servers() -> Iterator[Callable[..., str]]:
    """Start an HTTP server that echoes its name: on a loopback port (returns `127.0.0.1:PORT`, its name), or on
    the unix socket `path` (returns `unix:PATH`); `tls` wraps a TCP one in TLS."""
    servers: list[socketserver.BaseServer] = []

    def start(path: Path | None = None, tls: ssl.SSLContext | None = None) -> str:
        server: socketserver.BaseServer
        if path is not None:
            server = _UnixHTTPServer(str(path), _Echo)
            name = f"unix:{path}"
        else:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
            name = f"127.0.0.1:{server.server_address[1]}"
            if tls is not None:
                server.socket = tls.wrap_socket(server.socket, server_side=True)
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return name

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def get(port: int, path: str, key: str | None = None) -> str:
    headers = {} if key is None else {"X-Prism-Affinity-Key": key}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(response.read().decode())


def prism(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prismlb.cli", *argv], capture_output=True, text=True, timeout=60, check=False
    )


@needs_nginx
def test_nginx_sends_every_key_where_prism_route_says(
    tmp_path: Path, echo_servers: Callable[..., str], run_nginx: Callable[[str, int], None]
) -> None:
    """The upstream `prism route --nginx` renders, run by nginx, and `prism route --nginx KEY` agree on all keys:
    servers of different weights, one server's two GPU entries, a unix socket, beside entries left out."""
    a, b, c = echo_servers(), echo_servers(), echo_servers()
    sock = echo_servers(path=tmp_path / "engine.sock")
    nodes = [
        node("a", f"http://{a}", 1.0),
        node("b", f"http://{b}/", 0.55),
        node("c", c, 0.05),
        node("g", sock, 0.3, gpu=0),
        node("g", sock, 0.4, gpu=1),
        TableNode(node_id="spill", endpoint=f"http://{c}", weight=1.0, overflow=True),
        node("grpc", "grpc://127.0.0.1:1", 1.0),
    ]
    table = RoutingTable(epoch=4, version=2, issued_unix_s=0.0, slices=[SliceTable(name="llm", nodes=nodes)])
    keys = [f"conversation-{i}" for i in range(60)]
    port = free_port()
    brain = Brain()
    try:
        brain.publish(table)
        where = ["--updates", brain.address.updates, "--snapshot", brain.address.snapshot, "--slice", "llm"]
        rendered = prism("route", *where, "--nginx", "--nginx-listen", f"127.0.0.1:{port}")
        predicted = prism("route", *where, "--nginx", *keys)
    finally:
        brain.close()
    assert rendered.returncode == 0 and predicted.returncode == 0, rendered.stderr + predicted.stderr
    assert f"    server {sock} weight=14 max_fails=1 fail_timeout=10s;  # g" in rendered.stdout.splitlines()
    lines = predicted.stdout.splitlines()
    assert lines[0] == "table epoch 4 version 2, nginx upstream prism_llm (hash $http_x_prism_affinity_key consistent)"
    said = dict(line.split(" -> ") for line in lines[1:])
    run_nginx(rendered.stdout, port)
    served = {key: get(port, "/v1/models", key).split()[0] for key in keys}
    assert {key: said[key].split()[1] for key in keys} == served
    assert {a, b, sock} <= set(served.values()) <= {a, b, c, sock}, "c, of weight 1 in 46, may take none of 60"
    assert {said[key] for key in keys if served[key] == sock} == {f"g {sock}"}


def _tls(tmp_path: Path) -> ssl.SSLContext:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make the test servers' certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"]
        + ["-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


@needs_nginx
def test_https_endpoints_with_a_path_are_proxied_over_tls_under_their_path(
    tmp_path: Path, echo_servers: Callable[..., str], run_nginx: Callable[[str, int], None]
) -> None:
    """`https://host:port/v1` endpoints: nginx speaks TLS to them and puts /v1 before the request's path, as the
    router does; an endpoint of another scheme and path in the slice is left out, with comments."""
    tls = _tls(tmp_path)
    one, two, plain = echo_servers(tls=tls), echo_servers(tls=tls), echo_servers()
    nodes = [node("one", f"https://{one}/v1", 0.5), node("two", f"https://{two}/v1/", 0.5), node("plain", plain, 0.9)]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=0.0, slices=[SliceTable(name="llm", nodes=nodes)])
    port = free_port()
    rendered = render_nginx(table, listen=f"127.0.0.1:{port}")
    assert rendered.splitlines()[1:] == [
        "# endpoints disagree on scheme or path: the https://HOST:PORT/v1 ones are the servers",
        "# endpoints https://HOST:PORT/v1: in location /, proxy_pass https://prism_llm/v1/;",
        "upstream prism_llm {",
        "    hash $http_x_prism_affinity_key consistent;",
        f"    server {one} weight=10 max_fails=1 fail_timeout=10s;  # one",
        f"    server {two} weight=10 max_fails=1 fail_timeout=10s;  # two",
        "    # node plain: http://HOST:PORT, not https://HOST:PORT/v1, left out",
        "}",
        "server {",
        f"    listen 127.0.0.1:{port};",
        "    location / {",
        "        proxy_pass https://prism_llm/v1/;",
        "        proxy_http_version 1.1;",
        "        proxy_buffering off;  # streamed tokens go out as they come",
        "    }",
        "}",
    ]
    run_nginx(rendered, port)
    answers = {get(port, "/chat/completions?stream=1", f"k{i}") for i in range(20)}
    assert answers == {f"{one} /v1/chat/completions?stream=1", f"{two} /v1/chat/completions?stream=1"}


UNLOADABLE = [
    node("bare-path", "/run/engine.sock", 1.0),
    node("relative-socket", "unix:engine.sock", 1.0),
    node("grpc", "grpc://127.0.0.1:50051", 1.0),
    node("credentials", "http://user:secret@127.0.0.1:8000", 1.0),
    node("port", "http://127.0.0.1:99999", 1.0),
    node("injection\n}", "127.0.0.1:8000; include /etc/passwd", 1.0),
]


@needs_nginx
def test_nginx_loads_what_is_rendered_from_endpoints_it_cannot_all_take(tmp_path: Path) -> None:
    """Socket paths, URLs with paths, schemes nginx does not proxy, credentials, bad ports: nginx -t passes on what
    is rendered, and a slice left with no server has comments, not the empty upstream nginx refuses."""
    sockets = [node("sock", f"unix:{tmp_path / 'engine.sock'}", 0.5), node("url", "https://127.0.0.1:8443/v1", 1.0)]
    table = RoutingTable(
        epoch=1,
        version=1,
        issued_unix_s=0.0,
        slices=[
            SliceTable(name="lost", nodes=UNLOADABLE),
            SliceTable(name="mixed", nodes=[*sockets, *UNLOADABLE[:2]]),
            SliceTable(name="spill", nodes=[TableNode(node_id="o", endpoint="127.0.0.1:1", weight=1.0, overflow=True)]),
            SliceTable(name="empty", nodes=[], fallback="mixed"),
        ],
    )
    rendered = render_nginx(table)
    lost = [
        "# no upstream prism_lost: no endpoint of it is a server nginx takes",
        "# node bare-path: not host:port or a URL of one, left out",
        "# node relative-socket: not a unix socket path nginx takes (absolute, at most 107 plain characters), left out",
        "# node grpc: scheme 'grpc': nginx proxies to http and https only, left out",
        "# node credentials: credentials in the URL, which an nginx server line cannot carry, left out",
        "# node port: port 99999 is out of range, left out",
        "# node 'injection\\n}': not host:port or a URL of one, left out",
    ]
    assert rendered.splitlines()[1:8] == lost
    assert "# no upstream prism_spill: no endpoint of it is a server nginx takes" in rendered
    assert "# 127.0.0.1:1 (o): overflow entry, never the only server" in rendered
    mixed = [
        "# endpoints disagree on scheme or path: the https://HOST:PORT/v1 ones are the servers",
        "# endpoints https://HOST:PORT/v1: in location /, proxy_pass https://prism_mixed/v1/;",
        "upstream prism_mixed {",
        "    hash $http_x_prism_affinity_key consistent;",
        "    server 127.0.0.1:8443 weight=20 max_fails=1 fail_timeout=10s;  # url",
        "    # node bare-path: not host:port or a URL of one, left out",
        "    # node relative-socket: not a unix socket path nginx takes (absolute, at most 107 plain characters), "
        "left out",
        "    # node sock: http://HOST:PORT, not https://HOST:PORT/v1, left out",
        "}",
    ]
    assert "\n".join(mixed) in rendered, rendered
    assert "# slice 'empty' has no nodes: the servers of its fallback 'mixed'" in rendered
    assert "\n".join([*mixed[:1], *(line.replace("prism_mixed", "prism_empty") for line in mixed[1:])]) in rendered
    assert not any(line.startswith("upstream prism_lost") for line in rendered.splitlines())
    checked = nginx_test(tmp_path, rendered)
    assert checked.returncode == 0, checked.stderr
    sockets_only = RoutingTable(epoch=1, version=1, issued_unix_s=0.0, slices=[SliceTable(name="s", nodes=sockets[:1])])
    for text in (render_nginx(sockets_only, hash_key=""), render_nginx(table, slice_name="lost", listen="127.0.0.1:1")):
        checked = nginx_test(tmp_path, text)
        assert checked.returncode == 0, text + checked.stderr
    assert f"    server unix:{tmp_path / 'engine.sock'} weight=10 max_fails=1 fail_timeout=10s;  # sock" in (
        render_nginx(sockets_only, hash_key="")
    )
    assert "        return 503;  # no upstream prism_lost" in render_nginx(table, slice_name="lost", listen="1")
