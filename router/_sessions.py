"""Sticky sessions: which entry a session token was last routed to, kept for a TTL after its last request."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Session:
    """Where a session went last, on which model version, its context signature (so a new node can load it), and the
    prompt its last request there began with."""

    label: str
    node_id: str
    model_version: str
    context: str | None
    expires: float
    blocks: int = 0
    """How many block hashes the last request's prompt had: what the node computed of the conversation, for turns whose
    blocks no KV event names (text blocks), which the index knows only while the placements' claims last."""
    last_block: int = 0
    """The last of those hashes: a prompt whose block at the same place has it begins with all of them (chained)."""
    before_last: int = 0
    """The one before it: where a caller's last block is partial (as Mooncake's `hash_ids` are), the next turn's
    block at its place differs, and the turn begins with all blocks but that one."""


class SessionTable:
    """Session token → `Session`, bounded; safe to use from many threads without blocking.

    Reads and writes are single dict operations (atomic in CPython). Past `capacity` entries, the writer that
    gets the trim lock drops expired sessions, then the least recently written down to 90% of `capacity`;
    others do not wait for it.
    """

    def __init__(self, ttl_s: float, capacity: int) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._sessions: dict[str, Session] = {}
        self._trim_lock = threading.Lock()

    def get(self, token: str, now: float) -> Session | None:
        """The session's last placement while it has not expired."""
        session = self._sessions.get(token)
        return session if session is not None and session.expires > now else None

    def put(
        self,
        token: str,
        label: str,
        node_id: str,
        model_version: str,
        context: str | None,
        now: float,
        blocks: Sequence[int] = (),
    ) -> None:
        sessions = self._sessions
        sessions.pop(token, None)  # re-insert, so dict order is least recently written first
        last, before = blocks[-1] if blocks else 0, blocks[-2] if len(blocks) > 1 else 0
        sessions[token] = Session(label, node_id, model_version, context, now + self.ttl_s, len(blocks), last, before)
        if len(sessions) > self.capacity and self._trim_lock.acquire(blocking=False):
            try:
                self._trim(now)
            finally:
                self._trim_lock.release()

    def __len__(self) -> int:
        return len(self._sessions)

    def _trim(self, now: float) -> None:
        sessions = self._sessions
        for token, session in list(sessions.items()):
            if session.expires <= now:
                sessions.pop(token, None)
        excess = len(sessions) - self.capacity * 9 // 10
        if excess > 0:
            for token in list(sessions)[:excess]:
                sessions.pop(token, None)
