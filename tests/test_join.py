"""Span ⇄ connection join on synthetic connections and real OTLP protobuf spans."""

from __future__ import annotations

import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from prismlb.agent._connections import Connection
from prismlb.agent._join import ConnectionIndex, SpanJoiner, normalise_address

from .conftest import wait_for

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def kv(key: str, value: str | int) -> KeyValue:
    return KeyValue(
        key=key, value=AnyValue(int_value=value) if isinstance(value, int) else AnyValue(string_value=value)
    )


def span(kind: int, start_ms: float, attrs: dict[str, str | int], end_ms: float | None = None) -> Span:
    s = Span(name="GET /", kind=kind, start_time_unix_nano=T0 + int(start_ms * MS))
    s.end_time_unix_nano = T0 + int((end_ms if end_ms is not None else start_ms + 5) * MS)
    s.attributes.extend(kv(k, v) for k, v in attrs.items())
    return s


def enrich(joiner: SpanJoiner, spans: list[Span], pid: int | None = None) -> list[Span]:
    """Run the joiner over one request holding `spans`; returns the request's (enriched) spans."""
    rs = ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])
    if pid is not None:
        rs.resource.attributes.append(kv("process.pid", pid))
    req = ExportTraceServiceRequest(resource_spans=[rs])
    joiner.enrich(req)
    return list(req.resource_spans[0].scope_spans[0].spans)


def conn(
    sock: int, role: str, local: tuple[str, int], remote: tuple[str, int], at_ms: float, **kw: object
) -> Connection:
    return Connection(
        sock_id=sock,
        role=role,  # type: ignore[arg-type]
        local_addr=local[0],
        local_port=local[1],
        remote_addr=remote[0],
        remote_port=remote[1],
        established_unix_ns=T0 + int(at_ms * MS),
        **kw,  # type: ignore[arg-type]
    )


def attrs_of(s: Span) -> dict[str, object]:
    out: dict[str, object] = {}
    for a in s.attributes:
        out[a.key] = getattr(a.value, a.value.WhichOneof("value"))
    return out


def test_normalise_address() -> None:
    assert normalise_address("::ffff:10.0.0.1") == "10.0.0.1"
    assert normalise_address("[::1]") == "::1"
    assert normalise_address("example.com") is None


def test_server_span_joins_by_exact_four_tuple_and_time() -> None:
    index = ConnectionIndex()
    index.established(conn(1, "server", ("10.1.0.2", 8000), ("10.1.0.1", 40001), 0, pid=42))
    index.established(conn(2, "server", ("10.1.0.2", 8000), ("10.1.0.1", 40002), 1, pid=42))
    joiner = SpanJoiner(index)
    first = span(2, 3, {"network.peer.address": "10.1.0.1", "network.peer.port": 40002, "server.port": 8000})
    wrong_port = span(2, 3, {"client.address": "10.1.0.1", "client.port": 40003, "server.port": 8000})
    first, wrong_port = enrich(joiner, [first, wrong_port])
    a = attrs_of(first)
    assert a["prism.net.peer.port"] == 40002 and a["prism.net.local.port"] == 8000
    assert a["prism.net.local.address"] == "10.1.0.2" and a["prism.net.reused"] is False
    assert "prism.net.join" not in attrs_of(wrong_port)
    assert joiner.counts.server_spans_with_peer == 2 and joiner.counts.server_spans_joined == 1
    assert joiner.counts.coverage == 0.5


def test_port_reuse_picks_the_connection_alive_at_span_time() -> None:
    index = ConnectionIndex()
    old = conn(1, "server", ("127.0.0.1", 8000), ("127.0.0.1", 50000), 0)
    index.established(old)
    index.closed(
        conn(1, "server", ("127.0.0.1", 8000), ("127.0.0.1", 50000), 0, closed_unix_ns=T0 + 10 * MS, bytes_sent=7)
    )
    index.established(conn(9, "server", ("127.0.0.1", 8000), ("127.0.0.1", 50000), 500))
    joiner = SpanJoiner(index, slack_s=0.001)
    early = span(2, 2, {"client.address": "127.0.0.1", "client.port": 50000, "server.port": 8000})
    late = span(2, 600, {"client.address": "127.0.0.1", "client.port": 50000, "server.port": 8000})
    again = span(2, 700, {"client.address": "127.0.0.1", "client.port": 50000, "server.port": 8000})
    early, late, again = enrich(joiner, [early, late, again])
    assert attrs_of(early)["prism.net.bytes_sent"] == 7
    assert attrs_of(late)["prism.net.connection_age_ms"] == 100.0
    assert attrs_of(late)["prism.net.reused"] is False and attrs_of(again)["prism.net.reused"] is True


def test_client_span_joins_by_remote_pid_and_window() -> None:
    index = ConnectionIndex()
    index.established(conn(1, "client", ("10.0.0.1", 41000), ("10.0.0.2", 8000), 0, pid=7, handshake_us=850.0))
    index.established(conn(2, "client", ("10.0.0.1", 41001), ("10.0.0.2", 8000), 0.5, pid=8))
    joiner = SpanJoiner(
        index, stats=lambda sock, lport, rport: (100, 200, 1) if (sock, lport, rport) == (1, 41000, 8000) else None
    )
    s = span(3, 1, {"server.address": "10.0.0.2", "server.port": 8000})
    (s,) = enrich(joiner, [s], pid=7)
    a = attrs_of(s)
    assert a["prism.net.local.port"] == 41000 and a["prism.net.handshake_us"] == 850.0
    assert (a["prism.net.bytes_sent"], a["prism.net.bytes_received"], a["prism.net.retransmits"]) == (100, 200, 1)
    assert a["prism.net.join"] == "peer+pid"


def test_client_span_by_host_name_falls_back_to_thread_and_time() -> None:
    index = ConnectionIndex()
    index.established(conn(1, "client", ("10.0.0.1", 41000), ("10.0.0.2", 8000), 10, pid=7, tid=70))
    index.established(conn(2, "client", ("10.0.0.1", 41001), ("10.0.0.3", 8000), 10.5, pid=7, tid=71))
    joiner = SpanJoiner(index)
    by_thread = span(3, 9, {"server.address": "api.internal", "server.port": 8000, "thread.id": 71}, end_ms=20)
    ambiguous = span(3, 9, {"server.address": "api.internal", "server.port": 8000}, end_ms=20)
    by_thread, ambiguous = enrich(joiner, [by_thread, ambiguous], pid=7)
    assert attrs_of(by_thread)["prism.net.peer.address"] == "10.0.0.3"
    assert "prism.net.join" not in attrs_of(ambiguous)
    assert joiner.counts.joined_by_thread == 1


def test_unjoinable_spans_are_left_unchanged() -> None:
    joiner = SpanJoiner(ConnectionIndex())
    s = span(1, 0, {"foo": "bar"})
    (after,) = enrich(joiner, [s])
    assert after == s
    assert joiner.counts.coverage is None


def test_index_is_bounded_and_forgets_old_closed_connections() -> None:
    index = ConnectionIndex(retention_s=1.0, max_connections=100)
    for i in range(250):
        c = conn(i, "client", ("10.0.0.1", 1000 + i), ("10.0.0.2", 80), i * 10.0)
        index.established(c)
    assert len(index) == 100 and index.evicted == 150
    index = ConnectionIndex(retention_s=1.0)
    first = conn(1, "client", ("10.0.0.1", 1000), ("10.0.0.2", 80), 0)
    index.established(first)
    index.closed(conn(1, "client", ("10.0.0.1", 1000), ("10.0.0.2", 80), 0, closed_unix_ns=T0 + MS))
    index.established(conn(2, "client", ("10.0.0.1", 1001), ("10.0.0.2", 80), 2000))
    assert len(index) == 1 and index.candidates("10.0.0.2", 80)[0].sock_id == 2


def test_eviction_takes_the_oldest_of_each_remote_endpoint() -> None:
    """Connections to two endpoints, interleaved, most to one: eviction (by count, then by age) removes the oldest
    overall, which is also the oldest of its endpoint; what is left keeps its order."""
    index = ConnectionIndex(retention_s=1.0, max_connections=300)
    remotes = {i: ("10.0.0.3", 443) if i % 10 == 0 else ("10.0.0.2", 80) for i in range(1_000)}
    for i, remote in remotes.items():
        index.established(conn(i, "client", ("10.0.0.1", 2000 + i), remote, i * 0.1))
    assert (len(index), index.evicted) == (300, 700)
    assert [c.sock_id for c in index.candidates("10.0.0.2", 80)] == [i for i in range(700, 1_000) if i % 10]
    assert [c.sock_id for c in index.candidates("10.0.0.3", 443)] == list(range(700, 1_000, 10))
    for i in range(700, 1_000):  # each closed 1 ms after it opened
        closed_ns = T0 + int((i * 0.1 + 1) * MS)
        index.closed(conn(i, "client", ("10.0.0.1", 2000 + i), remotes[i], i * 0.1, closed_unix_ns=closed_ns))
    index.established(conn(5_000, "client", ("10.0.0.1", 9000), ("10.0.0.2", 80), 1_099.95))  # 1 s later: 0..989 go
    assert [c.sock_id for c in index.candidates("10.0.0.2", 80)] == [*range(991, 1_000), 5_000]
    assert [c.sock_id for c in index.candidates("10.0.0.3", 443)] == [990]
    index.established(conn(5_001, "client", ("10.0.0.1", 9001), ("10.0.0.2", 80), 3_000))
    assert [c.sock_id for c in index.candidates("10.0.0.2", 80)] == [5_000, 5_001]
    assert index.candidates("10.0.0.3", 443) == []
    assert len(index) == 2


def test_a_span_waiting_for_a_close_event_gets_it() -> None:
    """A span whose connection the kernel already dropped waits for its close event: woken by it, or not at all."""
    index = ConnectionIndex()
    first = conn(1, "server", ("127.0.0.1", 8000), ("127.0.0.1", 50000), 0)
    index.established(first)
    index.established(conn(2, "server", ("127.0.0.1", 8000), ("127.0.0.1", 50001), 0))
    woken: list[bool] = []
    waiter = threading.Thread(target=lambda: woken.append(index.wait_closed(first, 30.0)))
    waiter.start()
    assert wait_for(lambda: index._waiting == 1, what="the waiter")
    index.closed(conn(1, "server", ("127.0.0.1", 8000), ("127.0.0.1", 50000), 0, closed_unix_ns=T0 + MS, bytes_sent=9))
    waiter.join(timeout=30)
    assert woken == [True] and first.bytes_sent == 9
    assert index.wait_closed(index.candidates("127.0.0.1", 50001)[0], 0.01) is False
    assert index._waiting == 0


def test_connection_first_seen_at_close_is_indexed() -> None:
    index = ConnectionIndex()
    index.closed(
        conn(5, "server", ("::ffff:127.0.0.1", 9000), ("::ffff:127.0.0.1", 5555), 0, closed_unix_ns=T0 + 5 * MS)
    )
    found = index.candidates("127.0.0.1", 5555)
    assert [c.sock_id for c in found] == [5] and found[0].local_addr == "127.0.0.1"


def test_pipeline_holds_joins_and_never_drops() -> None:
    import threading
    import time

    from prismlb.agent._spans import SpanPipeline

    index = ConnectionIndex()
    index.established(conn(1, "server", ("127.0.0.1", 8000), ("127.0.0.1", 50000), 0))
    out: list[ExportTraceServiceRequest] = []
    done = threading.Event()

    def submit(req: ExportTraceServiceRequest) -> None:
        out.append(req)
        if len(out) == 6:
            done.set()

    pipeline = SpanPipeline(SpanJoiner(index), submit, join_delay_s=0.2, max_pending=4)
    attrs = {"client.address": "127.0.0.1", "client.port": 50000, "server.port": 8000}
    started = time.monotonic()
    for _ in range(6):
        pipeline.put(
            ExportTraceServiceRequest(
                resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[span(2, 1, attrs)])])]
            )
        )
    assert pipeline.join_skipped == 2 and len(out) == 2, "overflow is handed on at once, unjoined"
    assert done.wait(3)
    assert time.monotonic() - started >= 0.2
    joined = [
        r for r in out if any(a.key == "prism.net.join" for a in r.resource_spans[0].scope_spans[0].spans[0].attributes)
    ]
    assert len(joined) == 4
    pipeline.put(ExportTraceServiceRequest())
    pipeline.shutdown()
    assert len(out) == 7, "shutdown hands on what was still held"


def test_client_span_does_not_take_the_next_connection() -> None:
    index = ConnectionIndex()
    index.established(conn(1, "client", ("127.0.0.1", 41000), ("127.0.0.1", 8000), 0, pid=7))
    index.closed(conn(1, "client", ("127.0.0.1", 41000), ("127.0.0.1", 8000), 0, pid=7, closed_unix_ns=T0 + 2 * MS))
    index.established(conn(2, "client", ("127.0.0.1", 41001), ("127.0.0.1", 8000), 2.1, pid=7))
    joiner = SpanJoiner(index)
    (s,) = enrich(joiner, [span(3, 0.2, {"server.address": "127.0.0.1", "server.port": 8000}, end_ms=1.9)], pid=7)
    assert attrs_of(s)["prism.net.local.port"] == 41000
