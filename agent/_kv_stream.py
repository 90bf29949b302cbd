"""The agent's stream of KV changes to the brain: what the engine cached or evicted, within tens of ms.

The agent's main loop runs once a period (1 s), too seldom for the budget from an engine's event to the routers'
indexes (100 ms at p99). `KvStream` is a thread of its own that takes the subscriber's changes every `interval_s`
(20 ms) and sends them as `KvBlocks`. It sends over PUSH sockets of its own, created, used and closed on its thread:
ZeroMQ sockets are not thread-safe, and sharing the vector sender's would need a lock around every send of the
main loop, or a hand-off queue that adds its own latency. A second connection per brain costs one TCP connection;
the brain reads both from the same PULL socket, and nothing orders KV blocks against vectors.

Every message is numbered (`seq`, +1 each, from 0 in this process). A message a brain's full queue drops is lost
there; the brain notices the skip and ignores the node's changes until a reset, so after a drop a reset follows
within `RESYNC_S`. Resets also go at start (the subscriber's first take is one) and every `full_every_s`, which
is what brings a restarted brain, or one that lost messages the agent could not see, back to the node's set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Protocol

import zmq

from prismlb.wire import ClientCurve, VectorSender, split_kv_changes

from ._kv_events import KvChanges

_log = logging.getLogger("prism.agent.kv")

INTERVAL_S = 0.02
FULL_EVERY_S = 60.0
RESYNC_S = 1.0
"""After a message was dropped, the reset that repairs the brain's copy goes out this much later at most (not at
once: while a brain is down every send fails, and a full set every 20 ms would be wasted work)."""


class KvSource(Protocol):
    """What the stream drains: `KvEventSubscriber.take_changes`."""

    def take_changes(self, full: bool = False) -> KvChanges: ...


class KvStream:
    """Sends a node's KV changes to every brain of its group from a thread of its own; `close()` ends it."""

    def __init__(
        self,
        source: KvSource,
        node_id: str,
        endpoints: Sequence[str],
        *,
        curve: ClientCurve | None = None,
        interval_s: float = INTERVAL_S,
        full_every_s: float = FULL_EVERY_S,
        context: zmq.Context | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one brain endpoint is needed")
        if not (interval_s > 0 and full_every_s > 0):
            raise ValueError("interval_s and full_every_s must be positive")
        self.source, self.node_id, self.endpoints = source, node_id, list(endpoints)
        self.curve = curve
        self.interval_s, self.full_every_s = interval_s, full_every_s
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prism-agent-kv", daemon=True)
        self.seq = 0
        """The next message's number."""
        self.sent = 0
        """Messages every brain's queue took."""
        self.dropped = 0
        """Messages some brain's full queue dropped (each makes a reset follow)."""
        self.resets = 0
        self._next_full = 0.0

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (its sockets close on it) and end the context if the stream made it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> KvStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        try:
            with ExitStack() as stack:  # the sockets are closed on this thread, each whatever the others do
                senders = [
                    stack.enter_context(VectorSender(self._ctx, endpoint, curve=self.curve))
                    for endpoint in self.endpoints
                ]
                while not self._stop.wait(self.interval_s):
                    self.step(senders, time.monotonic())
        except Exception:  # the vectors go on without the KV stream; the routers keep their own placements
            _log.exception("the KV stream to the brain stopped")

    def step(self, senders: Sequence[VectorSender], now: float) -> int:
        """Take the changes since the last step (a reset when one is due) and send them; messages made."""
        changes = self.source.take_changes(full=now >= self._next_full)
        if changes.reset:
            self._next_full = now + self.full_every_s
            self.resets += 1
        messages = split_kv_changes(
            self.node_id,
            self.seq,
            reset=changes.reset,
            stored=changes.stored,
            removed=changes.removed,
            block_size=changes.block_size,
        )
        self.seq += len(messages)
        for message in messages:
            if all([sender.send(message) for sender in senders]):
                self.sent += 1
            else:
                self.dropped += 1
                self._next_full = min(self._next_full, now + RESYNC_S)
        return len(messages)
