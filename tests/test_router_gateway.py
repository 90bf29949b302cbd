"""`prism gateway`: real HTTP callers (the `openai` client, raw sockets) through the gateway's listener, the router
inside it placing each request on real local HTTP servers that answer as OpenAI-compatible engines do."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import zmq
from prometheus_client import CollectorRegistry

from prismlb.agent import EngineSample
from prismlb.cli import main
from prismlb.router import Gateway, GatewayConfig, Request, Router, Settings, WorkerWatch, static_table
from prismlb.router._cli import GATEWAY_SETTINGS, gateway_config, gateway_routing
from prismlb.semantics import held_speed
from prismlb.wire import ConfigError, RoutingTable, SliceTable, TableNode, VectorSender

from ._helpers_engines import Engine
from ._helpers_http import LoopbackServer, QuietHandler, refused_address, serving_http
from .conftest import free_port, idle_vector, prism, running_brain, wait_for
from .test_router_openai import conversation, make_router


def table_of(*addresses: tuple[str, str]) -> RoutingTable:
    nodes = [TableNode(node_id=name, endpoint=address, weight=1.0) for name, address in addresses]
    return RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=nodes)])


def openai_client(gateway: Gateway) -> openai.OpenAI:
    """The OpenAI client pointed at the gateway as at one engine; its own retries off."""
    return openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="-", max_retries=0, timeout=10)


def raw_exchange(port: int, request: bytes, timeout_s: float = 5.0) -> bytes:
    """`request` written on a fresh connection; everything the gateway answers until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_the_openai_client_gets_each_answer_from_the_engine_the_router_leased_it_to(
    engines: tuple[Engine, Engine],
) -> None:
    router = make_router(engines)
    with Gateway(router, GatewayConfig(port=0)) as gateway:
        client = openai_client(gateway)
        answered: dict[str, int] = {}
        for number in range(6):
            messages = conversation(number)
            stream = client.chat.completions.create(model="m", messages=messages, stream=True)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
            node = text.removeprefix("Hello from ")
            whole = client.chat.completions.create(model="m", messages=messages)
            assert whole.choices[0].message.content == node  # the conversation's second request follows its first
            answered[node] = answered.get(node, 0) + 2
        assert {e.name: e.requests for e in engines if e.requests} == answered
        assert gateway.responses == {"200": 12}

        def ended() -> dict[str, int]:
            return {n: sum(s.outcomes.values()) for n, s in router.status().items() if s.outcomes}

        wait_for(lambda: ended() == answered, what="each lease to end on the engine that answered")
        assert all(status.inflight == 0 for status in router.status().values())


class _Trickle(QuietHandler):
    """A streamed completion whose first chunk goes out at once and whose rest waits for the server's `gate`."""

    server: _TrickleEngine
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in (b'data: {"first": true}\n\n', None, b"data: [DONE]\n\n"):
            if piece is None:
                self.server.gate.wait(10)
                continue
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


class _TrickleEngine(LoopbackServer):
    def __init__(self) -> None:
        super().__init__(_Trickle)
        self.gate = threading.Event()


@pytest.fixture
def trickle() -> Iterator[_TrickleEngine]:
    with serving_http(_TrickleEngine()) as (engine,):
        try:
            yield engine
        finally:
            engine.gate.set()


def test_a_streamed_chunk_reaches_the_caller_before_the_engine_sends_the_next(trickle: _TrickleEngine) -> None:
    router = Router.from_table(table_of(("gpu-a", trickle.address)))
    with Gateway(router, GatewayConfig(port=0)) as gateway:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        url = f"http://127.0.0.1:{gateway.port}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=10) as response:
            assert response.status_code == 200
            assert response.headers["transfer-encoding"] == "chunked"
            lines = response.iter_lines()
            assert next(lines) == 'data: {"first": true}'
            assert not trickle.gate.is_set()  # the first chunk came while the engine still held the rest
            assert router.status()["gpu-a"].inflight == 1
            trickle.gate.set()
            assert [line for line in lines if line] == ["data: [DONE]"]
        wait_for(lambda: router.status()["gpu-a"].inflight == 0, what="the lease to end with the answer")


def test_a_caller_gone_mid_answer_ends_the_engines_request_and_its_lease(trickle: _TrickleEngine) -> None:
    router = Router.from_table(table_of(("gpu-a", trickle.address)))
    with Gateway(router, GatewayConfig(port=0)) as gateway:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
            sock.sendall(head + body)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            assert router.status()["gpu-a"].inflight == 1
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
        trickle.gate.set()  # the rest comes, and has nowhere to go
        wait_for(lambda: gateway.errors.get("client_gone") == 1, what="the caller's leaving to be counted")
        wait_for(lambda: router.status()["gpu-a"].inflight == 0, what="the lease to end")


def test_a_refusing_or_unreachable_engine_is_passed_over_and_none_reachable_is_a_502(
    engines: tuple[Engine, Engine],
) -> None:
    busy, ok = engines
    busy.status = 503
    dead = refused_address()
    for other in (busy.address, dead):  # each beside the good one: a request tries at most two endpoints
        router = Router.from_table(table_of(("gpu-a", other), ("gpu-b", ok.address)))
        with Gateway(router, GatewayConfig(port=0)) as gateway:
            client = openai_client(gateway)
            for number in range(5):
                reply = client.chat.completions.create(model="m", messages=conversation(number))
                assert reply.choices[0].message.content == "gpu-b"
    alone = Router.from_table(table_of(("gpu-c", dead)))
    with Gateway(alone, GatewayConfig(port=0)) as gateway:
        response = httpx.post(f"http://127.0.0.1:{gateway.port}/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 502
        assert response.json()["error"]["type"] == "upstream_unreachable"
        assert gateway.errors == {"upstream_unreachable": 1}
        health = httpx.get(f"http://127.0.0.1:{gateway.port}/health")  # a balancer in front sends elsewhere
        assert (health.status_code, health.json()["status"], health.json()["available"]) == (503, "none_available", 0)


def test_health_and_metrics_are_the_gateways_own_and_no_table_is_a_503(engines: tuple[Engine, Engine]) -> None:
    registry = CollectorRegistry()
    router = Router(registry=registry, settings=Settings())
    with Gateway(router, GatewayConfig(port=0), registry=registry) as gateway:
        base = f"http://127.0.0.1:{gateway.port}"
        health = httpx.get(f"{base}/health")
        assert (health.status_code, health.json()["status"]) == (503, "no_table")
        refused = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x"})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "no_route"
        router.apply(table_of(*((e.name, e.address) for e in engines)))
        health = httpx.get(f"{base}/health")
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "table": {"epoch": 1, "version": 1}, "endpoints": 2, "available": 2}
        assert httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 200
        metrics = httpx.get(f"{base}/metrics").text
        assert 'prism_gateway_responses_total{code="503"} 1.0' in metrics
        assert 'prism_gateway_errors_total{kind="no_route"} 1.0' in metrics
        assert "prism_router_inflight_requests" in metrics
        assert sum(e.requests for e in engines) == 1  # neither own path reached an engine


def test_a_chunked_request_body_is_relayed_whole(engines: tuple[Engine, Engine]) -> None:
    router = make_router(engines)
    with Gateway(router, GatewayConfig(port=0)) as gateway:
        body = json.dumps({"model": "m", "messages": conversation(1)}).encode()
        chunks = b"".join(
            b"%x;ext=1\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7)
        )
        request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        request += b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\nX-Trailer: 1\r\n\r\n"
        answer = raw_exchange(gateway.port, request)
        assert answer.startswith(b"HTTP/1.1 200")
        assert b'"content": "gpu-' in answer


@pytest.mark.parametrize(
    ("head", "body", "status", "kind"),
    [
        (b"Content-Length: 12abc\r\n", b"", 400, "bad_length"),
        (b"Content-Length: 2000\r\n", b"{}", 413, "oversized"),
        (b"Transfer-Encoding: chunked\r\n", b"zz\r\n{}\r\n0\r\n\r\n", 400, "bad_chunk"),
        (b"Transfer-Encoding: chunked\r\n", b"2\r\n{}}}\r\n0\r\n\r\n", 400, "bad_chunk"),
        (b"Transfer-Encoding: chunked\r\n", b"800\r\n" + b"x" * 2048 + b"\r\n0\r\n\r\n", 413, "oversized"),
        (b"Transfer-Encoding: gzip\r\n", b"", 501, "bad_encoding"),
    ],
)
def test_a_request_that_cannot_be_read_is_answered_counted_and_reaches_no_engine(
    engines: tuple[Engine, Engine], head: bytes, body: bytes, status: int, kind: str
) -> None:
    router = make_router(engines)
    with Gateway(router, GatewayConfig(port=0, max_body_bytes=1024)) as gateway:
        answer = raw_exchange(gateway.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n" + body)
        assert answer.startswith(f"HTTP/1.1 {status}".encode())
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == kind
        assert gateway.rejects.counts() == {kind: 1}
        assert sum(e.requests for e in engines) == 0
        # the gateway still serves
        assert (
            httpx.post(
                f"http://127.0.0.1:{gateway.port}/v1/completions", json={"model": "m", "prompt": "x"}
            ).status_code
            == 200
        )


def test_slow_and_surplus_connections_are_closed_and_counted(engines: tuple[Engine, Engine]) -> None:
    router = make_router(engines)
    config = GatewayConfig(port=0, max_connections=1, read_timeout_s=0.3)
    with Gateway(router, config) as gateway:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
            wait_for(lambda: gateway._server.open_connections == 1, what="the slow connection to be admitted")
            assert raw_exchange(gateway.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 503")
            assert slow.recv(65536) == b""  # closed at its read deadline, unanswered
        counts = gateway.rejects.counts()
        assert counts == {"too_many_connections": 1, "read_timeout": 1}
        wait_for(lambda: gateway._server.open_connections == 0, what="the slot to be freed")
        assert httpx.get(f"http://127.0.0.1:{gateway.port}/health").status_code == 200


def test_the_gateway_settings_resolve_flag_over_variable_over_default_and_refuse_bad_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    GATEWAY_SETTINGS.add_arguments(parser)
    environ = {"PRISM_GATEWAY_PORT": "9001", "PRISM_GATEWAY_MAX_CONNECTIONS": "64"}
    config = gateway_config(GATEWAY_SETTINGS.resolve(parser.parse_args(["--max-connections", "8"]), environ))
    assert config == GatewayConfig(port=9001, max_connections=8)
    assert gateway_config(GATEWAY_SETTINGS.resolve(parser.parse_args([]), {})) == GatewayConfig()
    with pytest.raises(ConfigError, match="PRISM_GATEWAY_UPSTREAM_TIMEOUT_S: must be positive"):
        GATEWAY_SETTINGS.resolve(parser.parse_args([]), {"PRISM_GATEWAY_UPSTREAM_TIMEOUT_S": "nan"})
    assert main(["gateway", "--curve-secret", "/etc/hostname"]) == 2
    assert "--curve-secret given alone" in capsys.readouterr().err
    assert main(["gateway", "--read-timeout", "0"]) == 2
    assert "--read-timeout: must be positive, got '0'" in capsys.readouterr().err


def test_the_gateway_routes_by_the_services_slo_given_by_flag_or_variable(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    GATEWAY_SETTINGS.add_arguments(parser)
    assert gateway_routing(GATEWAY_SETTINGS.resolve(parser.parse_args([]), {})) == Settings()
    given = GATEWAY_SETTINGS.resolve(parser.parse_args(["--slo-scale", "10"]), {"PRISM_SLO_SCALE": "3"})
    assert gateway_routing(given) == Settings(slo_scale=10.0)
    assert gateway_routing(GATEWAY_SETTINGS.resolve(parser.parse_args([]), {"PRISM_SLO_SCALE": "3"})).slo_scale == 3.0
    with pytest.raises(ConfigError, match="PRISM_SLO_SCALE: slo_scale must be a number of at least 1"):
        GATEWAY_SETTINGS.resolve(parser.parse_args([]), {"PRISM_SLO_SCALE": "0.5"})
    assert main(["gateway", "--worker-url", "http://127.0.0.1:1", "--slo-scale", "nan"]) == 2
    assert "--slo-scale: slo_scale must be a number of at least 1, got nan" in capsys.readouterr().err


def test_a_taken_port_is_a_config_error() -> None:
    router = Router.from_table(table_of(("gpu-a", "http://127.0.0.1:9")))
    with Gateway(router, GatewayConfig(port=0)) as first:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            Gateway(router, GatewayConfig(port=first.port))


@contextlib.contextmanager
def gateway_process(args: list[str], log: Path, endpoints: int) -> Iterator[openai.OpenAI]:
    """`prism gateway ARGS` on a free port until its table has `endpoints` endpoints; the `openai` client on it.
    On the way out it is sent SIGTERM and must exit 0."""
    port = free_port()
    proc = prism(["gateway", "--port", str(port), *args], log)

    def ready() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()["endpoints"] == endpoints
        return False

    try:
        wait_for(ready, timeout_s=30, what=f"the gateway's table: {log.read_text()}")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=10)
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0, log.read_text()


def test_prism_gateway_follows_a_real_brain_and_relays_to_the_nodes_it_publishes(
    engines: tuple[Engine, Engine], tmp_path: Path
) -> None:
    """The command as a unit file runs it: its own process, the brain's tables over ZeroMQ, SIGTERM to stop."""
    with running_brain() as brain, zmq.Context() as ctx, VectorSender(ctx, brain.config.ingest) as sender:
        for seq in range(3):
            for engine in engines:
                sender.send(idle_vector(engine.name, engine.address, seq, host="127.0.0.1"))
        brain_flags = ["--updates", brain.config.updates, "--snapshot", brain.config.snapshot]
        with gateway_process(brain_flags, tmp_path / "gateway.log", 2) as client:
            reply = client.chat.completions.create(model="m", messages=conversation(7))
            assert reply.choices[0].message.content in ("gpu-a", "gpu-b")
            assert sum(e.requests for e in engines) == 1


def test_a_static_table_names_each_worker_by_host_and_port_and_refuses_what_is_no_worker() -> None:
    table = static_table(["http://10.0.0.1:8000/", "https://gpu-2.example/v", "http://10.0.0.1:8001"])
    (only,) = table.slices
    assert only.name == "default"  # takes every modality
    assert [(n.node_id, n.endpoint, n.weight) for n in only.nodes] == [
        ("10.0.0.1:8000", "http://10.0.0.1:8000", 1.0),
        ("gpu-2.example:443", "https://gpu-2.example/v", 1.0),
        ("10.0.0.1:8001", "http://10.0.0.1:8001", 1.0),
    ]
    for bad, why in [
        (["ftp://h:1"], "is not http"),
        (["http://:80"], "is not http"),
        (["http://h:99999"], "is not http"),
        (["http://h:1/?q=1"], "is not http"),
        (["http://h:1", "http://h:1/v1"], "named twice"),
        ([], "no worker URLs"),
    ]:
        with pytest.raises(ValueError, match=why):
            static_table(bad)


def test_prism_gateway_with_worker_urls_relays_without_a_brain(engines: tuple[Engine, Engine], tmp_path: Path) -> None:
    urls = ",".join(e.address for e in engines)  # one flag, comma-separated
    with gateway_process(["--worker-url", urls], tmp_path / "gateway.log", 2) as client:
        first = client.chat.completions.create(model="m", messages=conversation(3))
        again = client.chat.completions.create(model="m", messages=conversation(3))
        assert first.choices[0].message.content == again.choices[0].message.content  # its own placements' index
        assert sum(e.requests for e in engines) == 2


class _ScriptedEngine:
    """An `EngineCollector` stand-in at the watch's seam: each `sample()` gives the next scripted prefill speed."""

    def __init__(self, speeds: list[float | None]) -> None:
        self.speeds = speeds

    def sample(self) -> EngineSample:
        return EngineSample(prefill_tokens_per_s=self.speeds.pop(0) if self.speeds else None)


def _sent(router: Router, clock: list[float], node: str, tokens: int, seconds: float) -> None:
    """One streamed request of `tokens` uncached prompt tokens placed on `node`, its first token `seconds` later."""
    others = {label for label in router.status() if label != node}
    with router.request(Request(key=f"k{clock[0]}", cost=tokens), exclude=others) as lease:
        assert lease.node_id == node
        clock[0] += seconds
        lease.first_token()


def test_the_worker_watch_gives_each_worker_its_measure_else_the_routers_own_else_twice_the_fastest() -> None:
    urls = ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    script = {
        "http://10.0.0.1:8000/metrics": [None, None, 3000.0, None],
        "http://10.0.0.2:8000/metrics": [None, None, None, None],
        "http://10.0.0.3:8000/metrics": [None, None, None, None],
    }
    clock = [0.0]
    router = Router.from_table(static_table(urls), clock=lambda: clock[0])
    watch = WorkerWatch(router, urls, collector=lambda url: _ScriptedEngine(script[url]))
    assert not watch.poll() and watch.speeds == {}  # nothing measured: expected times stay in tokens
    one, two, three = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
    _sent(router, clock, one, 1000, 1.0)
    _sent(router, clock, one, 3000, 1.0)  # the router's own: 4,000 tokens over 2 s
    assert watch.poll()
    assert watch.speeds == {
        one: held_speed(2000.0, None),
        two: held_speed(4000.0, None),
        three: held_speed(4000.0, None),
    }, "a worker never tried is expected twice as fast as the fastest known, so that one is sent there"
    assert router.table is not None and router.table.version == 2
    _sent(router, clock, two, 500, 1.0)
    assert watch.poll()  # the engine's own measure of the first worker reads 1.5 times the router's
    assert watch.speeds == {
        one: held_speed(3000.0, None),
        two: held_speed(750.0, None),
        three: held_speed(6000.0, None),
    }
    _sent(router, clock, two, 60, 0.1)  # 560 tokens over 1.1 s, 764 scaled: within 15% of the published 724
    assert not watch.poll(), "a worker whose measure moved less than the hysteresis keeps its published speed"
    assert router.table.version == 3 and router.table.slices[0].nodes[1].prefill_tokens_per_s == held_speed(750.0, None)
