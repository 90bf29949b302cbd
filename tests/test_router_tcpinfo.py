"""The router's own connections' retransmits (router/_tcpinfo.py): read from the kernel's `TCP_INFO`, counted per
request on the endpoint, and, for real, loss on the way to one node (nftables in its network namespace) moves the
router's requests off it. The real test needs root, `ip` and `nft`, not eBPF: any process reads its own sockets."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from prismlb.router import PrismTransport, Router, Settings
from prismlb.router._health import EndpointState
from prismlb.router._tcpinfo import TCPI_TOTAL_RETRANS_OFFSET, Retransmits, total_retransmits
from prismlb.semantics import RTO_MIN_MS, STALL_SMOOTHING_S
from prismlb.wire import RoutingTable, SliceTable, TableNode

from ._netns import Namespace, host_veth, wait_listening

PORT = 8000
DROP_PERCENT = 30
MAX_LOSSY_REQUESTS = 200

_SERVER = """
import http.server, json, sys

BODY = json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"}}]}).encode()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as between a router and an engine

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Handler).serve_forever()
"""


class _FakeSock:
    def __init__(self, total: int | None) -> None:
        self.total = total

    def getsockopt(self, level: int, option: int, buflen: int) -> bytes:
        if self.total is None:
            raise OSError(9, "Bad file descriptor")
        raw = bytearray(buflen)
        struct.pack_into("=I", raw, TCPI_TOTAL_RETRANS_OFFSET, self.total)
        return bytes(raw)


class _FakeStream:
    def __init__(self, sock: object) -> None:
        self.sock = sock

    def get_extra_info(self, info: str) -> object:
        return self.sock if info == "socket" else None


def test_a_sound_tcp_connection_reads_no_retransmits_and_a_closed_or_udp_socket_none() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        assert total_retransmits(client) == 0
        client.close()
        assert total_retransmits(client) is None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert total_retransmits(udp) is None


def test_each_connection_counts_what_it_retransmitted_since_it_was_last_read() -> None:
    counted = Retransmits()
    first, second = _FakeSock(3), _FakeSock(1)
    a, b = _FakeStream(first), _FakeStream(second)
    assert counted.since_last(a) == 3  # its first read: everything since it opened, the handshake's included
    first.total = 5
    assert counted.since_last(a) == 2
    assert counted.since_last(a) == 0
    assert counted.since_last(b) == 1  # another connection keeps its own count
    first.total = None  # closed
    assert counted.since_last(a) is None
    assert counted.since_last(object()) is None  # no network stream (an HTTP/2 or mocked response)
    assert counted.since_last(_FakeStream(None)) is None


def test_the_stall_is_retransmits_per_request_averaged_and_decays_without_requests() -> None:
    state = EndpointState("a", Settings())
    assert state.stall_s(0.0) == 0.0
    for _ in range(9):
        state.count_retransmits(0, 0.0)
    state.count_retransmits(2, 0.0)
    # 2 segments over 10 requests and the one that lost nothing: 2/11 of a minimum timeout
    assert state.stall_s(0.0) == pytest.approx(2 / 11 * RTO_MIN_MS / 1000)
    later = state.stall_s(STALL_SMOOTHING_S)
    assert 0 < later < state.stall_s(0.0)
    assert state.stall_s(20 * STALL_SMOOTHING_S) < 1e-6  # no requests: the endpoint is tried again
    assert EndpointState("b", Settings(client_stall=False)).stall_s(0.0) == 0.0
    off = EndpointState("b", Settings(client_stall=False))
    off.count_retransmits(5, 0.0)
    assert off.stall_s(0.0) == 0.0


def _missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces and nftables"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, nftables)"
    return None


def _serve(stack: ExitStack) -> Namespace:
    ns = stack.enter_context(host_veth())
    server = ns.popen([sys.executable, "-c", _SERVER, ns.address, str(PORT)])
    wait_listening(ns.address, PORT, 10.0, server)
    return ns


def _drop_arriving(ns: Namespace, percent: int) -> None:
    """nftables in the node's namespace drops `percent` of the packets arriving at its port: the client's requests,
    handshakes and ACKs, which the client's kernel sends again."""
    ns.run(
        ["nft", "-f", "-"],
        stdin=f"""
table inet prism_tcpinfo_test {{
    chain input {{
        type filter hook input priority 0; policy accept;
        tcp dport {PORT} numgen random mod 100 < {percent} counter drop
    }}
}}
""",
    )


def _router(nodes: dict[str, Namespace], settings: Settings) -> Router:
    entries = [
        TableNode(node_id=name, endpoint=f"http://{ns.address}:{PORT}", weight=1.0, prefill_tokens_per_s=10_000.0)
        for name, ns in nodes.items()
    ]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=entries)])
    return Router.from_table(table, settings=settings)


def _ended(router: Router) -> dict[str, int]:
    """Requests ended so far per node (a whole node's entry is labelled with its id)."""
    return {label: sum(status.outcomes.values()) for label, status in router.status().items()}


def _send(router: Router, client: httpx.Client, n: int) -> str:
    """One chat completion with a prompt of its own (so no cache draws it anywhere); the node it went to."""
    before = _ended(router)
    body = {"model": "m", "messages": [{"role": "user", "content": f"question {n}: " + "why " * 40}]}
    assert client.post("http://prism/v1/chat/completions", json=body).status_code == 200
    after = _ended(router)
    (node,) = [name for name in after if after[name] != before.get(name, 0)]
    return node


def _phases(nodes: dict[str, Namespace], settings: Settings) -> tuple[Router, list[str]]:
    """Requests one at a time until the router has counted a retransmit on the lossy node, then 20 more: the router
    and the nodes those 20 went to."""
    router = _router(nodes, settings)
    with httpx.Client(transport=PrismTransport(router, tokenize=None), timeout=10.0) as client:
        for n in range(MAX_LOSSY_REQUESTS):
            _send(router, client, n)
            if router.status()["lossy"].retransmitted > 0:
                break
        else:
            pytest.fail(f"no retransmit counted in {MAX_LOSSY_REQUESTS} requests at {DROP_PERCENT}% loss")
        return router, [_send(router, client, MAX_LOSSY_REQUESTS + n) for n in range(20)]


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Namespace]]:
    problem = _missing_tools()
    if problem is not None:
        pytest.skip(problem)
    with ExitStack() as stack:
        lossy, sound = _serve(stack), _serve(stack)
        _drop_arriving(lossy, DROP_PERCENT)
        yield {"lossy": lossy, "sound": sound}


def test_loss_on_the_way_to_a_node_moves_the_routers_requests_off_it(nodes: dict[str, Namespace]) -> None:
    router, after = _phases(nodes, Settings())
    lossy, sound = router.status()["lossy"], router.status()["sound"]
    assert lossy.stall_s > 0 and sound.retransmitted == 0 and sound.stall_s == 0
    # each prompt alone takes about 5 ms at the table's 10,000 tokens/s; one lost segment in the requests so far
    # adds a share of 200 ms to the lossy node's expected time, so the sound node takes every request after it
    assert after == ["sound"] * 20


def test_without_the_client_stall_the_lossy_node_keeps_its_share(nodes: dict[str, Namespace]) -> None:
    router, after = _phases(nodes, Settings(client_stall=False))
    assert router.status()["lossy"].stall_s == 0
    assert "lossy" in after  # equal expected times: the two nodes share the prompts by their keys


def test_a_stream_that_fails_to_say_its_socket_counts_nothing_and_raises_nothing() -> None:
    class Broken:
        def get_extra_info(self, info: str) -> object:
            raise RuntimeError("not a socket stream")

    class Odd:
        def getsockopt(self, level: int, option: int, buflen: int) -> bytes:
            return b"short"

    assert Retransmits().since_last(Broken()) is None
    assert Retransmits().since_last(_FakeStream(Odd())) is None
