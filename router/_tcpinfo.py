"""The segments a connection of the caller's own retransmitted, read from the kernel (`TCP_INFO`), per request.

Loss on the way to a node (its requests, its handshakes) is retransmitted by the caller's kernel, never by the
node's: the node's agent cannot count it, however it traces its host. The router's transports read the caller's
side instead, on the connection each response came over: `tcpi_total_retrans` of Linux's `struct tcp_info`, a
count kept per socket since it opened, read with one `getsockopt` when the response ends. The difference from the
last read of the same connection is what that request cost; the first read of a connection includes its handshake.
No eBPF, no privilege: any process may read its own sockets' `TCP_INFO`.
"""

from __future__ import annotations

import socket
import struct
import threading
import weakref
from typing import Protocol

TCPI_TOTAL_RETRANS_OFFSET = 100
"""Byte offset of `tcpi_total_retrans` (a u32) in Linux's `struct tcp_info` (include/uapi/linux/tcp.h): eight u8
fields, then 23 u32 fields before it. The struct only grows at its end, so the offset holds on every kernel since
2.6.33."""
_TCP_INFO_BYTES = TCPI_TOTAL_RETRANS_OFFSET + 4
_TOTAL_RETRANS = struct.Struct("=I")


class _Sock(Protocol):
    def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes: ...


def total_retransmits(sock: _Sock) -> int | None:
    """The segments `sock` has retransmitted since it opened (SYNs included); None where the kernel does not say
    (not Linux, not TCP, closed)."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_BYTES)
    except (OSError, ValueError, TypeError):
        return None
    if len(raw) < _TCP_INFO_BYTES:
        return None
    return int(_TOTAL_RETRANS.unpack_from(raw, TCPI_TOTAL_RETRANS_OFFSET)[0])


class Retransmits:
    """Per connection, the count read last; `since_last` gives what the connection retransmitted since then.

    Connections are keyed by their network stream, weakly: a closed connection's entry goes with it. Shared by
    the requests of one transport, from any thread."""

    def __init__(self) -> None:
        self._seen: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def since_last(self, stream: object) -> int | None:
        """The segments the connection of `stream` (a response's `network_stream` extension) retransmitted since
        the last call for it, or since it opened; None where it cannot be read (no such extension, an HTTP/2 or
        non-TCP stream, a closed socket)."""
        extra = getattr(stream, "get_extra_info", None)
        if extra is None:
            return None
        try:
            sock = extra("socket")
        except Exception:  # a transport's own stream type: the count is lost, never the response
            return None
        if sock is None or not hasattr(sock, "getsockopt"):
            return None
        total = total_retransmits(sock)
        if total is None:
            return None
        with self._lock:
            try:
                last = self._seen.get(stream, 0)
                self._seen[stream] = total
            except TypeError:  # a stream that takes no weak reference: its count cannot be told apart
                return None
        return max(0, total - last)
