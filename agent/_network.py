"""The node's TCP health per agent window, from the connection tracer (bpf/conntrack.c): retransmits per
connection and per second, client handshake P95, resets and connects that never completed, as NodeMetrics fields.

The counts come from the program's per-CPU counters (`tcp_counts`), cumulative since it was attached; a window
is the difference between two reads. Counters rather than events: a full ring buffer loses none of them, and a
connection that stays open for minutes shows its retransmits in the window they happen in, not when it closes.
Handshake times need each value for their P95, so they come from the ESTABLISHED events (a lost event is one
sample fewer, counted in the tracer's `lost_events`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from prismlb.semantics import quantile
from prismlb.wire import MAX_MS

from ._connections import Connection

MAX_HANDSHAKES = 50_000
"""Handshake times kept per window (the oldest dropped first): a bound on memory, like `Window`'s."""


class TcpCounts(NamedTuple):
    """The program's cumulative `tcp_counts`, summed over CPUs, in the order of its COUNT_* indices."""

    opened: int
    """Connections that became traced (passed the port and pid filters)."""
    ended: int
    """Traced connections that ended (their CLOSED event)."""
    retransmits: int
    """Segments retransmitted on traced connections."""
    resets: int
    """RSTs sent or received on traced connections, or on traced ports where no socket held the segment."""
    refused: int
    """Connects to traced ports that never completed: refused, timed out, unreachable or abandoned."""


class NetworkWindow:
    """`read()` returns the TCP health fields of NodeMetrics over the time since the previous read (the first:
    since construction); `established` takes the tracer's ESTABLISHED events, from its polling thread.

    `counts` reads the cumulative counters (`ConnectionTracer.tcp_counts`), `clock` gives monotonic seconds;
    both injectable so that windows can be tested on synthetic counts and events."""

    def __init__(self, counts: Callable[[], TcpCounts], clock: Callable[[], float] = time.monotonic) -> None:
        self._counts = counts
        self._clock = clock
        self._handshakes_ms: deque[float] = deque(maxlen=MAX_HANDSHAKES)
        self._lock = threading.Lock()
        self._before = counts()
        self._since = clock()

    def established(self, connection: Connection) -> None:
        """Keep a client connection's handshake time for the current window (servers have none)."""
        if connection.handshake_us is not None:
            with self._lock:
                self._handshakes_ms.append(connection.handshake_us / 1000)

    def read(self) -> dict[str, float | None]:
        """The window since the previous read, then start the next one.

        Connections active in the window are those opened by its end less those ended before its start: open
        at its start, or opened in it. Without any, retransmits per connection are not measured (None); a
        window without handshakes has no P95 (None); the rates are measured whenever the window has a length (the
        brain divides retransmits per second by requests per second for the stall a request can expect)."""
        now, counts = self._clock(), self._counts()
        with self._lock:
            handshakes = sorted(self._handshakes_ms)
            self._handshakes_ms.clear()
        before, elapsed_s = self._before, now - self._since
        self._before, self._since = counts, now
        active = counts.opened - before.ended
        return {
            "tcp_retransmits_per_conn": (counts.retransmits - before.retransmits) / active if active > 0 else None,
            # a handshake can outlast the wire's latency bound only with SYN retries raised far past the default
            "tcp_handshake_p95_ms": min(quantile(handshakes, 0.95), MAX_MS) if handshakes else None,
            "tcp_retransmits_per_s": (counts.retransmits - before.retransmits) / elapsed_s if elapsed_s > 0 else None,
            "tcp_resets_per_s": (counts.resets - before.resets) / elapsed_s if elapsed_s > 0 else None,
            "tcp_refused_per_s": (counts.refused - before.refused) / elapsed_s if elapsed_s > 0 else None,
        }
