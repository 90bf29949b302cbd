"""Sticky sessions: which entry a session token was last routed to, kept for a TTL after its last request."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Session:
    """Where a session went last, on which model version, and its context signature (so a new node can load it)."""

    label: str
    node_id: str
    model_version: str
    context: str | None
    expires: float


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

    def put(self, token: str, label: str, node_id: str, model_version: str, context: str | None, now: float) -> None:
        sessions = self._sessions
        sessions.pop(token, None)  # re-insert, so dict order is least recently written first
        sessions[token] = Session(label, node_id, model_version, context, now + self.ttl_s)
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
