"""The agent's trace path for real: kernel connections joined to the spans of an OpenTelemetry-instrumented
HTTP server that exports to the agent over OTLP; the agent forwards to an upstream collector."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from prismlb.agent import Agent, AgentConfig
from prismlb.agent._otlp_receiver import EPHEMERAL_PORT, OtlpReceiver

from ._netns import veth_pair
from .apps.otel_http_server import make_provider, make_server
from .conftest import free_port, require_ebpf, running_agent, wait_for

APPS = Path(__file__).parent / "apps"
REQUESTS = 1000


@dataclass
class Running:
    agent: Agent
    http_port: int
    upstream: list[ExportTraceServiceRequest]


@contextlib.contextmanager
def upstream_collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ExportTraceServiceRequest]]:
    """An OTLP/HTTP receiver the agent's trace exporter is pointed at (by the OTEL_ environment), and the
    requests it gets; shut down on the way out."""
    requests: list[ExportTraceServiceRequest] = []
    upstream = OtlpReceiver(requests.append, lambda _m: None, grpc_port=0, http_port=EPHEMERAL_PORT)
    upstream.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{upstream.http_port}/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    try:
        yield requests
    finally:
        upstream.shutdown()


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[Running]:
    require_ebpf()
    http_port = free_port()
    config = AgentConfig(
        node_id="join-test",
        brain=f"tcp://127.0.0.1:{free_port()}",
        otlp_grpc_port=0,
        otlp_http_port=http_port,
        period_s=0.5,
    )
    with upstream_collector(monkeypatch) as upstream_requests, running_agent(config) as agent:
        wait_for(
            lambda: (
                agent.trace_path is not None
                and agent.trace_path.receiver is not None
                and agent.trace_path.tracer is not None
            ),
            20,
            what="the agent's trace path",
        )
        yield Running(agent, http_port, upstream_requests)


def attributes(span: Span) -> dict[str, object]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def each_span(requests: list[ExportTraceServiceRequest], kind: int) -> Iterator[Span]:
    return (
        span
        for request in list(requests)
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
        if span.kind == kind
    )


def spans_of(requests: list[ExportTraceServiceRequest], kind: int) -> list[dict[str, object]]:
    return [attributes(span) for span in each_span(requests, kind)]


def has_spans(requests: list[ExportTraceServiceRequest], kind: int, count: int) -> bool:
    """Whether `requests` hold `count` spans of `kind`: cheap enough to poll while the agent works."""
    return sum(1 for _ in each_span(requests, kind)) >= count


def server_spans(requests: list[ExportTraceServiceRequest]) -> list[dict[str, object]]:
    return spans_of(requests, Span.SpanKind.SPAN_KIND_SERVER)


def wait_for_spans(running: Running, count: int, timeout_s: float = 30) -> list[dict[str, object]]:
    arrived = wait_for(lambda: has_spans(running.upstream, Span.SpanKind.SPAN_KIND_SERVER, count), timeout_s)
    spans = server_spans(running.upstream)
    assert arrived, f"upstream got {len(spans)} of {count} server spans"
    return spans


def check_join(running: Running, client_tuples: list[list[object]], server_address: str, server_port: int) -> None:
    spans = wait_for_spans(running, len(client_tuples))
    assert len(spans) == len(client_tuples), "every span is forwarded, joined or not"
    joined = [s for s in spans if "prism.net.join" in s]
    coverage = len(joined) / len(spans)
    counts = running.agent.trace_path.joiner.counts  # type: ignore[union-attr]
    assert counts.server_spans_with_peer == len(spans)
    assert counts.coverage == pytest.approx(coverage)
    print(f"join coverage {coverage:.4f} ({len(joined)}/{len(spans)} server spans)")
    assert coverage >= 0.94, f"join coverage {coverage:.3f}"
    expected = {(str(t[0]), int(t[1])) for t in client_tuples}
    for span in joined:
        client = (span["test.client.local_address"], span["test.client.local_port"])
        assert client in expected
        assert (span["prism.net.peer.address"], span["prism.net.peer.port"]) == client
        assert (span["prism.net.local.address"], span["prism.net.local.port"]) == (server_address, server_port)
        assert span["prism.net.role"] == "server" and span["prism.net.join"] == "4-tuple"
        assert int(span["prism.net.bytes_received"]) > 0  # type: ignore[call-overload]
    reused = [s for s in joined if s["prism.net.reused"]]
    assert reused, "connections carrying several requests are marked reused"


def run_client(argv: list[str], env: dict[str, str]) -> list[list[object]]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True, env=env).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["failures"] == 0
    return report["tuples"]


def test_loopback_server_spans_join_with_the_right_four_tuple(agent: Running) -> None:
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{agent.http_port}/v1/traces"}
    env.pop("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", None)
    server = subprocess.Popen(
        [sys.executable, str(APPS / "otel_http_server.py"), "127.0.0.1", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline().split()[1])
        tuples = run_client([sys.executable, str(APPS / "http_client.py"), "127.0.0.1", str(port), str(REQUESTS)], env)
    finally:
        server.terminate()
        server.wait(timeout=15)
    assert len(tuples) == REQUESTS
    check_join(agent, tuples, "127.0.0.1", port)
    wait_for(lambda: has_spans(agent.upstream, Span.SpanKind.SPAN_KIND_CLIENT, REQUESTS), 20)
    clients = spans_of(agent.upstream, Span.SpanKind.SPAN_KIND_CLIENT)
    assert len(clients) == REQUESTS
    joined = [s for s in clients if s.get("prism.net.join") == "peer+pid"]
    print(f"client spans joined by peer + pid: {len(joined)}/{len(clients)}")
    assert len(joined) / len(clients) >= 0.94
    # Without the local port in the span, peer + pid takes the latest connection established before the span
    # ended: when the next connection follows within the kernel-to-wall clock conversion's error, it is taken
    # instead (seen once in 1,000 spans). What is joined must otherwise be the client's own connection.
    wrong = [
        s
        for s in joined
        if (s["prism.net.local.address"], s["prism.net.local.port"])
        != (s["test.client.local_address"], s["test.client.local_port"])
    ]
    print(f"client spans joined to another connection of the same process and peer: {len(wrong)}")
    assert len(wrong) <= len(joined) // 200, wrong[:3]
    for span in joined:
        assert (span["prism.net.peer.address"], span["prism.net.peer.port"]) == ("127.0.0.1", port)
        assert float(span["prism.net.handshake_us"]) > 0  # type: ignore[arg-type]


def test_spans_across_two_namespaces_join_over_veth(agent: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{agent.http_port}/v1/traces")
    provider = make_provider()  # its export thread stays in this (root) namespace and reaches the agent
    with veth_pair() as (a, b):
        with b.entered():
            server = make_server(b.address, 0, provider.get_tracer("prism.tests.netns"))
        port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            client_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
            client = a.popen(
                [sys.executable, str(APPS / "http_client.py"), b.address, str(port), str(REQUESTS)],
                stdout=subprocess.PIPE,
                env=client_env,
            )
            out, _ = client.communicate(timeout=120)
        finally:
            server.shutdown()
            server.server_close()
            provider.shutdown()
        report = json.loads(out.decode().strip().splitlines()[-1])
        assert report["failures"] == 0
        assert all(t[0] == a.address for t in report["tuples"])
        check_join(agent, report["tuples"], b.address, port)


def test_without_ebpf_spans_are_still_received_and_forwarded_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    http_port = free_port()
    config = AgentConfig(
        node_id="no-ebpf",
        brain=f"tcp://127.0.0.1:{free_port()}",
        ebpf=False,
        otlp_grpc_port=0,
        otlp_http_port=http_port,
    )
    with upstream_collector(monkeypatch) as upstream_requests, running_agent(config) as agent:
        wait_for(
            lambda: agent.trace_path is not None and agent.trace_path.receiver is not None,
            what="the agent's OTLP receiver",
        )
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{http_port}/v1/traces")
        provider = make_provider()
        server = make_server("127.0.0.1", 0, provider.get_tracer("prism.tests.no-ebpf"))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        run_client(
            [sys.executable, str(APPS / "http_client.py"), "127.0.0.1", str(server.server_address[1]), "20"], env
        )
        server.shutdown()
        server.server_close()
        provider.shutdown()
        wait_for(lambda: has_spans(upstream_requests, Span.SpanKind.SPAN_KIND_SERVER, 20), 20)
        spans = server_spans(upstream_requests)
        assert len(spans) == 20
        assert not any(key.startswith("prism.net.") for span in spans for key in span)
        assert agent.trace_path.tracer is None
