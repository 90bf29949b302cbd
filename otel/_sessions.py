"""Session snapshots: what a model version needs to continue a session that another version served.

A hot model-version switch moves sessions between engines: the routers ramp an A/B arm from the old version to
the new, and a session's next request goes to a new-version engine with `X-Context-Signature`, the signature
of the session's context (an engine answers with it; the caller sends it back, and the routers carry the last one
sent to the session's next engine). Recomputing that context (the whole conversation so far) costs the session a full
prefill on its first request after the move; loading it costs a read. So after each response the engine that
served it writes the session's snapshot (`SessionSnapshot`: session id, context hash, last active, token offset,
and a reference to its KV context: the context's KV blocks by the engine's chained block hashes, the key a KV
store holds them under), and an engine that receives a moved session reads it and loads the context.

The stores (`SnapshotStore`) are shared by both versions:

- `MemorySnapshotStore`: one process's dictionary (tests, or engines of both versions in one process);
- `DirectorySnapshotStore`: one file per session in a directory every engine of the switch mounts: the old and
  the new engine processes on one host, or hosts sharing a network filesystem. A writer writes a temporary file
  and renames it over the session's, so a reader sees the previous snapshot or the new one, never part of one.

Both are bounded by count and by age (`max_sessions`, `max_age_s`: by default the routers' session TTL, past
which no router sends the session's signature any more), and neither raises for bad input or I/O errors: a
session id out of bounds, a failed write or read, an unreadable file are counted by kind in `rejects` (the first
of each kind logged) and the snapshot is skipped; the engine then recomputes the context, which is slower, never
wrong. The KV tensors themselves stay in the serving engine's KV store; a snapshot is the metadata that finds
them, a few bytes per block.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Protocol

import msgspec

from prismlb.wire import ConfigError, RejectCounter

_log = logging.getLogger("prism.otel")

MAX_SESSION_CHARS = 1024
"""Longest session id a store keeps (the routers' `X-Session-Token` is the caller's)."""
MAX_BLOCKS = 1 << 20
"""Most KV blocks one snapshot references: 16M tokens of 16-token blocks, far beyond any model's context."""
DEFAULT_MAX_SESSIONS = 100_000
"""The routers' own bound on the sessions they remember (`Settings.max_sessions`)."""
DEFAULT_MAX_AGE_S = 1800.0
"""The routers' session TTL (`Settings.session_ttl_s`): an older session's next request carries no signature."""
SNAPSHOT_SUFFIX = ".json"
_TEMP_SUFFIX = ".tmp"

_MASK_64 = (1 << 64) - 1


class SessionSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One session's state after a response, as the engine that served it wrote it."""

    session: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SESSION_CHARS)]
    context_hash: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    """The context's signature (`context_hash`), which the engine answered with as `X-Context-Signature`."""
    last_active_unix_s: Annotated[float, msgspec.Meta(ge=0)]
    token_offset: Annotated[int, msgspec.Meta(ge=0)]
    """Tokens of the session so far (its last prompt and the output that answered it)."""
    blocks: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_BLOCKS)]
    """The KV context: the last prompt's full KV blocks by chained block hash (64-bit), in prompt order."""
    model_version: str = ""
    engine: str = ""
    """The engine that wrote it (its URL): an engine loads only what another engine computed."""


def context_hash(session: str, blocks: Sequence[int], token_offset: int) -> str:
    """The signature of a session's context: a digest of the session, its KV blocks and its token offset, so a
    request naming it loads that context and no other (each turn of a session has its own)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(session.encode())
    digest.update(token_offset.to_bytes(8, "big"))
    for block in blocks:
        digest.update((block & _MASK_64).to_bytes(8, "big"))
    return digest.hexdigest()


class SnapshotStore(Protocol):
    """Where session snapshots live. Neither method raises for bad input or I/O: failures are counted in
    `rejects` and read as a failed save (False) or a missing snapshot (None)."""

    rejects: RejectCounter
    evicted: int
    """Snapshots removed for the count or age bound."""

    def save(self, snapshot: SessionSnapshot) -> bool:
        """Store `snapshot` in place of the session's previous one; False when it could not be stored."""
        ...

    def load(self, session: str) -> SessionSnapshot | None:
        """The session's latest snapshot, None when there is none younger than the age bound."""
        ...

    def __len__(self) -> int: ...


def _check_bounds(max_sessions: int, max_age_s: float) -> None:
    if not isinstance(max_sessions, int) or isinstance(max_sessions, bool) or max_sessions < 1:
        raise ConfigError(f"max_sessions must be a whole number ≥ 1, got {max_sessions!r}")
    if not isinstance(max_age_s, (int, float)) or not 0 < max_age_s < float("inf"):
        raise ConfigError(f"max_age_s must be a positive finite number of seconds, got {max_age_s!r}")


def _valid_session(session: str, rejects: RejectCounter) -> bool:
    """Whether a store keeps this session id; an empty or over-long one is counted (kind `session`)."""
    if 0 < len(session) <= MAX_SESSION_CHARS:
        return True
    rejects.count("session", f"session id of {len(session)} characters (1 to {MAX_SESSION_CHARS} are kept)")
    return False


class MemorySnapshotStore:
    """Snapshots in this process's memory, least recently saved evicted first past `max_sessions`; thread-safe."""

    def __init__(
        self,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.time,
        rejects: RejectCounter | None = None,
    ) -> None:
        _check_bounds(max_sessions, max_age_s)
        self.max_sessions = max_sessions
        self.max_age_s = max_age_s
        self._clock = clock
        self.rejects = rejects if rejects is not None else RejectCounter("session snapshots", _log)
        self.evicted = 0
        self._lock = threading.Lock()
        self._snapshots: OrderedDict[str, SessionSnapshot] = OrderedDict()

    def save(self, snapshot: SessionSnapshot) -> bool:
        if not _valid_session(snapshot.session, self.rejects):
            return False
        with self._lock:
            self._snapshots.pop(snapshot.session, None)
            self._snapshots[snapshot.session] = snapshot
            while len(self._snapshots) > self.max_sessions:
                self._snapshots.popitem(last=False)
                self.evicted += 1
        return True

    def load(self, session: str) -> SessionSnapshot | None:
        with self._lock:
            snapshot = self._snapshots.get(session)
            if snapshot is None or self._clock() - snapshot.last_active_unix_s <= self.max_age_s:
                return snapshot
            del self._snapshots[session]
            self.evicted += 1
            return None

    def __len__(self) -> int:
        return len(self._snapshots)


class DirectorySnapshotStore:
    """Snapshots as files in `path`, shared by every process that opens a store on the same directory.

    A session's file is named by a digest of its id (any id makes a safe name); its content is the snapshot as
    JSON, which holds the id again so a read checks it. A save writes a temporary file (dot-prefixed, unique to
    this process and write) and renames it over the session's file: atomic on one filesystem, local or network,
    so a concurrent reader sees the whole old snapshot or the whole new one. Durability across a power cut is
    not needed (a lost snapshot costs a recomputation, not a request), so nothing is fsynced.

    Bounds: a load ignores a snapshot older than `max_age_s`; a sweep removes files older than that, then the
    least recently written beyond `max_sessions`. Each process starts a sweep in a background thread after every
    `sweep_every` of its saves (default a tenth of `max_sessions`), so a save never waits for one; `sweep()` runs
    one now. The directory holds at most `max_sessions` snapshots after a sweep, and between sweeps up to
    `sweep_every` more per writing process. A file over `max_snapshot_bytes` or that does not decode to a
    snapshot of the session asked for is counted (kind `corrupt`) and skipped; it is not deleted (a writer may be
    renaming a good one over it), and ages out like any other.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_snapshot_bytes: int = 16 << 20,
        sweep_every: int | None = None,
        clock: Callable[[], float] = time.time,
        rejects: RejectCounter | None = None,
    ) -> None:
        _check_bounds(max_sessions, max_age_s)
        if sweep_every is not None and (not isinstance(sweep_every, int) or sweep_every < 1):
            raise ConfigError(f"sweep_every must be a whole number ≥ 1, got {sweep_every!r}")
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot use {self.path} for session snapshots: {exc.strerror}") from None
        self.max_sessions = max_sessions
        self.max_age_s = max_age_s
        self.max_snapshot_bytes = max_snapshot_bytes
        self.sweep_every = sweep_every if sweep_every is not None else max(1, max_sessions // 10)
        self._clock = clock
        self.rejects = rejects if rejects is not None else RejectCounter("session snapshots", _log)
        self.evicted = 0
        self._writes = itertools.count(1)
        self._sweeping = threading.Lock()
        self._decoder = msgspec.json.Decoder(SessionSnapshot)

    def file_of(self, session: str) -> Path:
        """The file holding the session's snapshot."""
        return self.path / (hashlib.blake2b(session.encode(), digest_size=16).hexdigest() + SNAPSHOT_SUFFIX)

    def save(self, snapshot: SessionSnapshot) -> bool:
        if not _valid_session(snapshot.session, self.rejects):
            return False
        target = self.file_of(snapshot.session)
        write = next(self._writes)
        temp = target.with_name(f".{target.stem}.{os.getpid()}.{threading.get_ident()}.{write}{_TEMP_SUFFIX}")
        try:
            with temp.open("xb") as out:
                out.write(msgspec.json.encode(snapshot))
            os.replace(temp, target)
        except OSError as exc:
            self.rejects.count("write", f"cannot write {target}: {exc}")
            with contextlib.suppress(OSError):
                temp.unlink()
            return False
        if write % self.sweep_every == 0 and not self._sweeping.locked():
            threading.Thread(target=self.sweep, name="session-snapshot-sweep", daemon=True).start()
        return True

    def load(self, session: str) -> SessionSnapshot | None:
        if not _valid_session(session, self.rejects):
            return None
        path = self.file_of(session)
        try:
            with path.open("rb") as source:
                raw = source.read(self.max_snapshot_bytes + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.rejects.count("read", f"cannot read {path}: {exc}")
            return None
        if len(raw) > self.max_snapshot_bytes:
            self.rejects.count("corrupt", f"{path} is over {self.max_snapshot_bytes} bytes")
            return None
        try:
            snapshot = self._decoder.decode(raw)
        except msgspec.DecodeError as exc:
            self.rejects.count("corrupt", f"{path} is not a session snapshot: {exc}")
            return None
        if snapshot.session != session:
            self.rejects.count("corrupt", f"{path} holds session {snapshot.session[:64]!r}, not {session[:64]!r}")
            return None
        if self._clock() - snapshot.last_active_unix_s > self.max_age_s:
            return None
        return snapshot

    def sweep(self) -> int:
        """Remove files older than `max_age_s` (left-over temporary files too), then the least recently written
        snapshots beyond `max_sessions`; the count removed. One sweep at a time per store (a call while another
        runs waits for it)."""
        with self._sweeping:
            cutoff_ns = int((self._clock() - self.max_age_s) * 1e9)
            kept: list[tuple[int, str]] = []
            old: list[str] = []
            try:
                with os.scandir(self.path) as entries:
                    for entry in entries:
                        if not entry.name.endswith((SNAPSHOT_SUFFIX, _TEMP_SUFFIX)):
                            continue
                        try:
                            written_ns = entry.stat(follow_symlinks=False).st_mtime_ns
                        except FileNotFoundError:
                            continue
                        if written_ns < cutoff_ns:
                            old.append(entry.name)
                        elif entry.name.endswith(SNAPSHOT_SUFFIX) and not entry.name.startswith("."):
                            kept.append((written_ns, entry.name))
            except OSError as exc:
                self.rejects.count("sweep", f"cannot list {self.path}: {exc}")
                return 0
            excess = len(kept) - self.max_sessions
            if excess > 0:
                kept.sort()
                old.extend(name for _, name in kept[:excess])
            removed = 0
            for name in old:
                try:
                    (self.path / name).unlink()
                except FileNotFoundError:
                    continue  # another process's sweep, or a rename, got there first
                except OSError as exc:
                    self.rejects.count("sweep", f"cannot remove {self.path / name}: {exc}")
                    continue
                removed += 1
            self.evicted += removed
            return removed

    def __len__(self) -> int:
        with os.scandir(self.path) as entries:
            return sum(1 for e in entries if e.name.endswith(SNAPSHOT_SUFFIX) and not e.name.startswith("."))
