"""A lean HTTP/1.1 client for one kind of call: a small JSON POST to an engine, answered with a small JSON body, over
kept-alive connections; sync over sockets, async over the event loop's streams, one parser for both.

Why not httpx here: the engines' `/tokenize` round trip is made for every text request a router places, before it
is placed, in the caller's process. Through httpx's clients it cost as much of the caller's CPU as the request it
preceded (2.4 ms a call at sixteen at once, most of it the connection pool's bookkeeping; bench/gateway.py), which
halved what a gateway or an app on one core could relay. This client does only what that call needs: one request
line, three headers, a body by `Content-Length`, an answer by `Content-Length`, chunks or the connection's end.

Bounds: `timeout_s` on connecting and on each wait for bytes; an answer's head at most `MAX_HEAD_BYTES` and its
body `MAX_BODY_BYTES`; at most `MAX_IDLE` idle connections kept per endpoint, and none to an endpoint the caller no
longer names (`retain`). A kept connection the server closed meanwhile is found on use (nothing comes back, or
the write fails) and the call goes again on another kept one or a new one; a new one's failure raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

import httpx

MAX_HEAD_BYTES: Final = 64 * 1024
"""An answer's status line and headers at most."""
MAX_BODY_BYTES: Final = 16 * 1024 * 1024
"""An answer's body at most: the ids of a long prompt (128k tokens of up to six digits and a comma: under 1 MiB),
with room to spare."""
MAX_IDLE: Final = 32
"""Idle connections kept per endpoint; one more is closed instead."""
_READ_BYTES: Final = 65536


class ReplyError(ValueError):
    """An answer that is no HTTP/1.x response, or past the bounds."""


@dataclass(frozen=True)
class Target:
    """Where a POST goes: the connection's address, and the request's bytes before its body's length."""

    scheme: str
    host: str
    port: int
    head: bytes

    @classmethod
    def of(cls, url: httpx.URL) -> Target:
        """The target for POSTs of JSON to `url` (http or https)."""
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"not an http(s) URL: {url}")
        port = url.port or (443 if url.scheme == "https" else 80)
        host = f"[{url.host}]" if ":" in url.host else url.host
        authority = host if url.port is None else f"{host}:{port}"
        head = (
            f"POST {url.raw_path.decode('ascii')} HTTP/1.1\r\nHost: {authority}\r\n"
            "Content-Type: application/json\r\nAccept: application/json\r\nContent-Length: "
        )
        return cls(url.scheme, url.host, port, head.encode("ascii"))

    def request(self, payload: bytes) -> bytes:
        return b"%s%d\r\n\r\n%s" % (self.head, len(payload), payload)


def parse(buffer: bytes | bytearray, eof: bool) -> tuple[int, bytes, bool] | None:
    """(status, body, whether the connection may be kept) of the response at the start of `buffer`, or None while
    it is incomplete; `eof`: the server closed the connection after `buffer`. Raises ReplyError."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise ReplyError(f"an answer's head over {MAX_HEAD_BYTES} bytes")
        if eof:
            raise ReplyError("the connection closed before the answer's head")
        return None
    lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise ReplyError(f"no HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(code)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            raise ReplyError(f"a header line without a colon: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    start = end + 4
    if 100 <= status < 200:  # an interim answer (none is asked for): the final one follows it
        return parse(buffer[start:], eof)
    keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    if status in (204, 304):
        return status, b"", keep
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return _chunked(buffer, start, status, keep, eof)
    length = headers.get("content-length")
    if length is None:  # the body runs to the connection's end
        if len(buffer) - start > MAX_BODY_BYTES:
            raise ReplyError(f"an answer's body over {MAX_BODY_BYTES} bytes")
        return (status, bytes(buffer[start:]), False) if eof else None
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        raise ReplyError(f"Content-Length {length[:20]!r} is no length up to {MAX_BODY_BYTES} bytes")
    if len(buffer) - start < int(length):
        if eof:
            raise ReplyError("the connection closed inside the answer's body")
        return None
    return status, bytes(buffer[start : start + int(length)]), keep


def _chunked(buffer: bytes | bytearray, pos: int, status: int, keep: bool, eof: bool) -> tuple[int, bytes, bool] | None:
    """`parse`'s chunked body from `pos` on."""
    body = bytearray()
    while True:
        line_end = buffer.find(b"\r\n", pos)
        if line_end < 0:
            break
        size_text = bytes(buffer[pos:line_end]).split(b";")[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise ReplyError(f"a chunk size that is no hex number: {size_text[:20]!r}") from None
        if size == 0:
            if buffer.find(b"\r\n\r\n", line_end) < 0:  # the trailers' end
                break
            return status, bytes(body), keep
        if len(body) + size > MAX_BODY_BYTES:
            raise ReplyError(f"an answer's body over {MAX_BODY_BYTES} bytes")
        if len(buffer) < line_end + 2 + size + 2:
            break
        body += buffer[line_end + 2 : line_end + 2 + size]
        pos = line_end + 2 + size + 2
    if eof:
        raise ReplyError("the connection closed inside the answer's chunks")
    return None


class _Stale(Exception):
    """A kept connection the server had closed: nothing of the answer came back."""


class _Answer:
    """One answer as it is read off a connection, by either driver; `reused`: over a kept connection, which the
    server may have closed meanwhile."""

    def __init__(self, reused: bool) -> None:
        self._reused = reused
        self._buffer = bytearray()

    def take(self, data: bytes) -> tuple[int, bytes, bool] | None:
        """`parse` with `data` added (b"": the connection's end); _Stale for a kept connection that gave nothing."""
        if not data and self._reused and not self._buffer:
            raise _Stale
        self._buffer += data
        return parse(self._buffer, eof=not data)

    def lost(self, exc: OSError) -> Exception:
        """What a reset or broken pipe means: a stale kept connection while nothing came back, else `exc`."""
        return _Stale() if self._reused and not self._buffer else exc


class JsonPoster:
    """POSTs JSON payloads to targets and returns (status, body); thread-safe for `post`, and `apost` for the one
    event loop that first calls it. Raises OSError (refused, reset, `TimeoutError`) or ReplyError."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._idle: dict[Target, list[socket.socket]] = {}
        self._aidle: dict[Target, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._tls: ssl.SSLContext | None = None

    def _context(self, target: Target) -> ssl.SSLContext | None:
        if target.scheme != "https":
            return None
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def post(self, target: Target, payload: bytes) -> tuple[int, bytes]:
        try:
            return self._post(target, target.request(payload))
        except TimeoutError:
            raise self._timed_out(target) from None

    async def apost(self, target: Target, payload: bytes) -> tuple[int, bytes]:
        try:
            return await self._apost(target, target.request(payload))
        except TimeoutError:
            raise self._timed_out(target) from None

    def _timed_out(self, target: Target) -> TimeoutError:
        return TimeoutError(f"{target.host}:{target.port} did not connect or answer within {self._timeout_s:g} s")

    def _post(self, target: Target, request: bytes) -> tuple[int, bytes]:
        while True:
            with self._lock:
                kept = self._idle.get(target)
                sock = kept.pop() if kept else None
            reused = sock is not None
            if sock is None:
                sock = socket.create_connection((target.host, target.port), timeout=self._timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                context = self._context(target)
                if context is not None:
                    sock = context.wrap_socket(sock, server_hostname=target.host)
            try:
                status, body, keep = self._exchange(sock, request, reused)
            except _Stale:
                sock.close()
                continue
            except BaseException:
                sock.close()
                raise
            with self._lock:
                kept = self._idle.setdefault(target, [])
                if keep and len(kept) < MAX_IDLE:
                    kept.append(sock)
                    sock = None
            if sock is not None:
                sock.close()
            return status, body

    @staticmethod
    def _exchange(sock: socket.socket, request: bytes, reused: bool) -> tuple[int, bytes, bool]:
        answer = _Answer(reused)
        try:
            sock.sendall(request)
            while (parsed := answer.take(sock.recv(_READ_BYTES))) is None:
                pass
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise answer.lost(exc) from None
        return parsed

    async def _apost(self, target: Target, request: bytes) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        if loop is not self._aloop:  # streams belong to the loop that opened them
            self._close_streams()
            self._aloop = loop
        while True:
            kept = self._aidle.get(target)
            stream = None
            while kept and stream is None:
                reader, writer = kept.pop()
                if reader.at_eof() or writer.is_closing():
                    writer.close()
                else:
                    stream = (reader, writer)
            reused = stream is not None
            if stream is None:
                async with asyncio.timeout(self._timeout_s):
                    stream = await asyncio.open_connection(target.host, target.port, ssl=self._context(target))
            reader, writer = stream
            try:
                status, body, keep = await self._aexchange(reader, writer, request, reused)
            except _Stale:
                writer.close()
                continue
            except BaseException:
                writer.close()
                raise
            kept = self._aidle.setdefault(target, [])
            if keep and len(kept) < MAX_IDLE:
                kept.append(stream)
            else:
                writer.close()
            return status, body

    async def _aexchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, reused: bool
    ) -> tuple[int, bytes, bool]:
        answer = _Answer(reused)
        try:
            writer.write(request)
            async with asyncio.timeout(self._timeout_s):
                await writer.drain()
            while True:
                async with asyncio.timeout(self._timeout_s):
                    parsed = answer.take(await reader.read(_READ_BYTES))
                if parsed is not None:
                    return parsed
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise answer.lost(exc) from None

    def retain(self, targets: Collection[Target]) -> None:
        """Close the idle connections to every target but `targets` (the endpoints a new table still has), so that
        nodes leaving over days of tables leave no connections behind."""
        with self._lock:
            gone = [t for t in self._idle if t not in targets]
            socks = [s for t in gone for s in self._idle.pop(t)]
        for sock in socks:
            sock.close()
        self._close_streams([t for t in self._aidle if t not in targets])

    def close(self) -> None:
        """Close the idle connections of `post` and `apost` (an async stream closes without waiting for the loop)."""
        self.retain(())

    def _close_streams(self, targets: Collection[Target] | None = None) -> None:
        """Close the idle streams to `targets` (None: all)."""
        gone = list(self._aidle) if targets is None else targets
        writers = [w for t in gone for _, w in self._aidle.pop(t, [])]
        for writer in writers:
            with contextlib.suppress(RuntimeError):  # its loop already closed: so is the socket
                writer.close()
