"""The OTLP receiver under many, slow or large clients at once, over real loopback sockets: what it takes is
bounded (connections, threads, bytes in flight, gRPC calls), and what it refuses is answered and counted."""

from __future__ import annotations

import argparse
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from prometheus_client import CollectorRegistry

from prismlb.agent import resolve_config
from prismlb.agent._otlp_receiver import EPHEMERAL_PORT, OtlpReceiver
from prismlb.agent._signals import SpanSignals
from prismlb.agent._tracing import TracePath
from prismlb.wire import ConfigError

from .conftest import wait_for
from .test_otlp import WAIT_S, Sink, post, request_of, serve  # noqa: F401 (serve is a fixture)

HEAD = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
KIB = 1 << 10
MIB = 1 << 20


def threads_named(part: str) -> int:
    return sum(1 for thread in threading.enumerate() if part in thread.name)


def answer(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (b"" if it resets it)."""
    try:
        return conn.makefile("rb").read()
    except ConnectionResetError:
        return b""


def cut_while_trickling(conn: socket.socket, rest: bytes) -> bool:
    """Send `rest` a byte at a time, 20 a second; True once the server has closed the connection."""
    deadline = time.monotonic() + WAIT_S
    for i in range(len(rest)):
        if time.monotonic() > deadline:
            return False
        try:
            conn.sendall(rest[i : i + 1])
            if select.select([conn], [], [], 0.05)[0]:
                return conn.recv(1 << 16) == b""
        except OSError:  # reset
            return True
    return False


def big_request(size: int) -> ExportTraceServiceRequest:
    """One span whose name makes the request about `size` bytes."""
    span = Span(trace_id=bytes(16 * [1]), span_id=bytes(8 * [2]), name="x" * size)
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[span])])])


def test_connections_over_the_limit_are_refused_counted_and_threads_stay_bounded(
    serve: Callable[..., OtlpReceiver],  # noqa: F811
) -> None:
    registry = CollectorRegistry()
    receiver = serve(Sink(), grpc_port=0, max_connections=4, read_timeout_s=60.0, registry=registry)
    port = receiver.http_port
    assert port is not None
    slow = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(4)]
    try:
        for conn in slow:
            conn.sendall(HEAD)  # the headers never end
        assert wait_for(lambda: registry.get_sample_value("prism_agent_otlp_http_connections") == 4, WAIT_S)
        for _ in range(30):
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as extra:
                refused = answer(extra)
            assert refused.startswith(b"HTTP/1.1 503") and b"Connection: close" in refused
        assert threads_named("process_request_thread") <= 4
        assert receiver.rejects["http"].counts() == {"too_many_connections": 30}
        assert (
            registry.get_sample_value(
                "prism_rejected_messages_total", {"receiver": "otlp_http", "kind": "too_many_connections"}
            )
            == 30
        )
    finally:
        for conn in slow:
            conn.close()
    assert wait_for(lambda: registry.get_sample_value("prism_agent_otlp_http_connections") == 0, WAIT_S)
    assert post(port, request_of(1).SerializeToString())[0] == 200


def test_requests_trickling_in_are_cut_at_the_read_timeout_and_counted(
    serve: Callable[..., OtlpReceiver],  # noqa: F811
) -> None:
    receiver = serve(Sink(), grpc_port=0, read_timeout_s=0.5)
    port = receiver.http_port
    assert port is not None
    body = request_of(50).SerializeToString()
    for opening, rest in (
        (b"POST /v1/traces HTTP/1.1\r\n", b"X-Pad: y\r\n" * 90),  # headers a byte at a time
        (HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode(), body),  # the body a byte at a time
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
            conn.sendall(opening)
            assert cut_while_trickling(conn, rest)
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as idle:
        assert idle.recv(1) == b"", "an idle connection is closed too"
    assert receiver.rejects["http"].counts() == {"read_timeout": 2}, "idleness is not counted as a reject"
    assert post(port, body)[0] == 200


def test_bodies_beyond_the_in_flight_budget_are_refused_on_both_protocols(
    serve: Callable[..., OtlpReceiver],  # noqa: F811
) -> None:
    registry = CollectorRegistry()
    sink = Sink()
    receiver = serve(sink, max_message_bytes=MIB, max_inflight_bytes=MIB, registry=registry)
    port = receiver.http_port
    assert port is not None and receiver.grpc_port is not None
    held = 600 * KIB
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as holder:
        holder.sendall(HEAD + f"Content-Length: {held}\r\n\r\n".encode() + bytes(KIB))  # the rest never comes
        assert wait_for(lambda: registry.get_sample_value("prism_agent_otlp_inflight_bytes") == held, WAIT_S)
        refusals: list[bytes] = []

        def too_big() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
                conn.sendall(HEAD + f"Content-Length: {held}\r\n\r\n".encode() + bytes(held))
                refusals.append(answer(conn))

        clients = [threading.Thread(target=too_big) for _ in range(6)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(WAIT_S)
        assert len(refusals) == 6
        assert all(r.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in r for r in refusals)
        with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as channel:
            stub = TraceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Export(big_request(held), timeout=WAIT_S)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            stub.Export(request_of(1), timeout=WAIT_S)  # a small one fits beside the held body
        assert post(port, request_of(1, first_id=10).SerializeToString())[0] == 200
        assert receiver.rejects["http"].counts() == {"over_budget": 6}
        assert receiver.rejects["grpc"].counts() == {"over_budget": 1}
    assert wait_for(lambda: registry.get_sample_value("prism_agent_otlp_inflight_bytes") == 0, WAIT_S)
    assert receiver.rejects["http"].counts() == {"over_budget": 6, "truncated": 1}
    assert post(port, big_request(held).SerializeToString())[0] == 200, "the budget is whole again"
    assert receiver.spans_received == 3


def test_grpc_exports_beyond_the_limit_are_refused_and_counted(
    serve: Callable[..., OtlpReceiver],  # noqa: F811
) -> None:
    release = threading.Event()
    entered = threading.Semaphore(0)

    def hold(_request: ExportTraceServiceRequest) -> None:
        entered.release()
        release.wait(WAIT_S)

    receiver = serve(Sink(before=hold), http_port=0, max_grpc_rpcs=2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as channel:
            stub = TraceServiceStub(channel)
            admitted = [stub.Export.future(request_of(1, first_id=1 + i), timeout=WAIT_S) for i in range(2)]
            for _ in admitted:
                assert entered.acquire(timeout=WAIT_S)
            flood = [stub.Export.future(request_of(1, first_id=100 + i), timeout=WAIT_S) for i in range(12)]
            codes = [call.exception(timeout=WAIT_S) for call in flood]
            assert all(isinstance(c, grpc.RpcError) and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in codes)
            assert receiver.rejects["grpc"].counts() == {"too_many_rpcs": 12}
            assert threads_named("prism-otlp-grpc") <= 2 + 2, "the admitted exports and two spare threads"
            release.set()
            for call in admitted:
                call.result(timeout=WAIT_S)
            stub.Export(request_of(1, first_id=200), timeout=WAIT_S)  # room again
    finally:
        release.set()
    assert receiver.spans_received == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_connections": 0}, "max_connections must be positive, got 0"),
        ({"read_timeout_s": float("nan")}, "read_timeout_s must be positive, got nan"),
        ({"max_grpc_rpcs": -1}, "max_grpc_rpcs must be positive, got -1"),
        ({"max_inflight_bytes": 1024}, "must be at least max_message_bytes"),
    ],
)
def test_bad_limits_are_config_errors(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OtlpReceiver(lambda _t: None, lambda _m: None, grpc_port=0, http_port=0, **kwargs)


def test_the_agents_receiver_takes_its_limits_from_the_agents_settings() -> None:
    environ = {
        "PRISM_OTLP_MAX_CONNECTIONS": "5",
        "PRISM_OTLP_MAX_INFLIGHT_BYTES": str(32 * MIB),
        "PRISM_OTLP_READ_TIMEOUT_S": "2.5",
        "PRISM_OTLP_MAX_GRPC_RPCS": "3",
        "PRISM_OTLP_GRPC_PORT": "0",
    }
    config = replace(resolve_config(argparse.Namespace(), environ), ebpf=False, otlp_http_port=EPHEMERAL_PORT)
    path = TracePath(config, None, SpanSignals(), CollectorRegistry())
    try:
        receiver = path.receiver
        assert receiver is not None and receiver.grpc_port is None and receiver.http_port
        assert (receiver.max_connections, receiver.budget.limit) == (5, 32 * MIB)
        assert (receiver.read_timeout_s, receiver.max_grpc_rpcs) == (2.5, 3)
    finally:
        path.close()
    default = resolve_config(argparse.Namespace(), {})
    assert (default.otlp_max_connections, default.otlp_max_inflight_bytes) == (64, 64 * MIB)
    assert (default.otlp_read_timeout_s, default.otlp_max_grpc_rpcs) == (10.0, 8)
