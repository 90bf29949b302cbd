"""The engines' lean JSON client (router/_post.py): the answer's parser on its own, then both drivers against real
loopback servers that keep connections, close them unannounced, answer in chunks or never."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from prismlb.router._post import MAX_BODY_BYTES, JsonPoster, ReplyError, Target, parse

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"tokens": [1]}'


def test_an_answer_is_read_by_its_length_its_chunks_or_the_connections_end() -> None:
    assert parse(OK, eof=False) == (200, b'{"tokens": [1]}', True)
    assert parse(OK[:-3], eof=False) is None
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n"
    )
    assert parse(chunked, eof=False) == (200, b"hello world", True)
    for cut in (40, 55, len(chunked) - 2):
        assert parse(chunked[:cut], eof=False) is None
    until_close = b"HTTP/1.0 200 OK\r\n\r\n{}"
    assert parse(until_close, eof=False) is None and parse(until_close, eof=True) == (200, b"{}", False)
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" + OK
    assert parse(interim, eof=False) == (200, b'{"tokens": [1]}', True)
    closing = b"HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
    assert parse(closing, eof=False) == (404, b"{}", False)
    assert parse(b"HTTP/1.1 204 No Content\r\n\r\n", eof=False) == (204, b"", True)


@pytest.mark.parametrize(
    ("answer", "eof", "problem"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", False, "no HTTP/1.x status line"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", False, "no HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", False, "without a colon"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", False, "no length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1), False, "no length up to"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", False, "no hex number"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % (MAX_BODY_BYTES + 1), False, "body over"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20000, False, "head over"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{}", True, "closed inside the answer's body"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", True, "inside the answer's chunks"),
        (b"HTTP/1.1 200", True, "before the answer's head"),
    ],
)
def test_an_answer_that_is_no_http_or_past_the_bounds_is_refused(answer: bytes, eof: bool, problem: str) -> None:
    with pytest.raises(ReplyError, match=problem):
        parse(answer, eof=eof)


def test_a_target_is_the_urls_address_and_request_head() -> None:
    target = Target.of(httpx.URL("http://10.0.0.5:8000/v1/tokenize"))
    assert (target.host, target.port) == ("10.0.0.5", 8000)
    request = target.request(b'{"prompt": "hi"}')
    assert request.startswith(b"POST /v1/tokenize HTTP/1.1\r\nHost: 10.0.0.5:8000\r\n")
    assert request.endswith(b"Content-Length: 16\r\n\r\n" + b'{"prompt": "hi"}')
    assert Target.of(httpx.URL("https://engine.example/tokenize")).port == 443
    with pytest.raises(ValueError, match="not an http"):
        Target.of(httpx.URL("ftp://engine.example/tokenize"))


Serve = Callable[[socket.socket], None]


def read_request(conn: socket.socket) -> bytes:
    """One request off `conn` (head and Content-Length body); b"" once the client closed it."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(65536)
        if not piece:
            return b""
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    while len(body) < length:
        body += conn.recv(65536)
    return head


class RawServer:
    """A loopback TCP server that hands each connection to `serve` on a thread; counts connections."""

    def __init__(self, serve: Serve) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.target = Target.of(httpx.URL(f"http://127.0.0.1:{self.sock.getsockname()[1]}/tokenize"))
        self.connections = 0
        self._serve = serve
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            self._serve(conn)


@contextlib.contextmanager
def raw_server(serve: Serve) -> Iterator[RawServer]:
    server = RawServer(serve)
    try:
        yield server
    finally:
        server.sock.close()


def keep_alive(conn: socket.socket) -> None:
    while read_request(conn):
        conn.sendall(OK)


def answer_once_then_close_unannounced(conn: socket.socket) -> None:
    """An answer that says nothing of closing, then the connection closed: a kept connection found stale later."""
    if read_request(conn):
        conn.sendall(OK)
        time.sleep(0.05)


def chunked_answers(conn: socket.socket) -> None:
    while read_request(conn):
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        conn.sendall(head + b"3\r\n[1,\r\n")
        time.sleep(0.01)
        conn.sendall(b"3\r\n 2]\r\n0\r\n\r\n")


def never_answers(conn: socket.socket) -> None:
    read_request(conn)
    time.sleep(2)


def post_both_ways(poster: JsonPoster, target: Target, times: int) -> list[tuple[int, bytes]]:
    """`times` posts from a thread, then `times` from a coroutine."""
    answers = [poster.post(target, b"{}") for _ in range(times)]

    async def run() -> list[tuple[int, bytes]]:
        return [await poster.apost(target, b"{}") for _ in range(times)]

    return answers + asyncio.run(run())


def test_connections_are_kept_and_reused_by_both_drivers() -> None:
    with raw_server(keep_alive) as server:
        poster = JsonPoster(timeout_s=1.0)
        answers = post_both_ways(poster, server.target, 5)
        assert answers == [(200, b'{"tokens": [1]}')] * 10
        assert server.connections == 2  # one the threads' pool kept, one the event loop's
        poster.close()


def test_a_kept_connection_the_server_closed_meanwhile_is_passed_over_for_a_new_one() -> None:
    with raw_server(answer_once_then_close_unannounced) as server:
        poster = JsonPoster(timeout_s=1.0)
        for _ in range(3):
            assert poster.post(server.target, b"{}")[0] == 200
            time.sleep(0.1)  # the server has closed it by now

        async def run() -> None:
            for _ in range(3):
                assert (await poster.apost(server.target, b"{}"))[0] == 200
                await asyncio.sleep(0.1)

        asyncio.run(run())
        assert server.connections == 6


def test_chunked_answers_are_read_whole() -> None:
    with raw_server(chunked_answers) as server:
        assert post_both_ways(JsonPoster(timeout_s=1.0), server.target, 2) == [(200, b"[1, 2]")] * 4
        assert server.connections == 2


def test_a_server_that_never_answers_times_out_within_the_bound() -> None:
    """The server closes each connection after 2 s without a word: a ReplyError then, a TimeoutError at 0.2 s."""
    with raw_server(never_answers) as server:
        poster = JsonPoster(timeout_s=0.2)
        with pytest.raises(TimeoutError, match=r"127.0.0.1:\d+ did not connect or answer within 0.2 s"):
            poster.post(server.target, b"{}")

        async def run() -> None:
            await poster.apost(server.target, b"{}")

        with pytest.raises(TimeoutError, match="within 0.2 s"):
            asyncio.run(run())


def test_a_refused_connect_raises_and_close_ends_the_kept_connections() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        refused = Target.of(httpx.URL(f"http://127.0.0.1:{sock.getsockname()[1]}/tokenize"))
    poster = JsonPoster(timeout_s=0.5)
    with pytest.raises(ConnectionRefusedError):
        poster.post(refused, b"{}")
    closed = threading.Event()

    def until_closed(conn: socket.socket) -> None:
        keep_alive(conn)
        closed.set()

    with raw_server(until_closed) as server:
        poster.post(server.target, b"{}")
        poster.close()
        assert closed.wait(2), "the kept connection stayed open after close"


def test_retain_closes_the_kept_connections_to_endpoints_a_table_dropped_and_keeps_the_rest() -> None:
    dropped_closed = threading.Event()

    def until_closed(conn: socket.socket) -> None:
        keep_alive(conn)
        dropped_closed.set()

    with raw_server(keep_alive) as kept, raw_server(until_closed) as dropped:
        poster = JsonPoster(timeout_s=1.0)
        poster.post(kept.target, b"{}")
        poster.post(dropped.target, b"{}")
        poster.retain({kept.target})
        assert dropped_closed.wait(2), "the dropped endpoint's connection stayed open"
        poster.post(kept.target, b"{}")
        assert kept.connections == 1
        poster.close()
