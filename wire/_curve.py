"""CURVE keys and the authenticator: a policy layer applied to sockets, separate from the transport.

The server's authorised-keys folder holds one public key file per client, `<name>.key`; the file's name is
the client's identity (for an agent, its node id). The folder is re-read when it changes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ._exceptions import ConfigError

_log = logging.getLogger("prism.curve")


def generate_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write `<name>.key` (public) and `<name>.key_secret` (secret, mode 0600) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def _load(path: Path, want_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read CURVE key {path}: {exc}") from None
    if want_secret and secret is None:
        raise ConfigError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret


@dataclass(frozen=True)
class ServerCurve:
    """Server side: our key pair, and a folder of authorised client public keys."""

    secret_file: Path
    authorized_dir: Path

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = _load(self.secret_file, want_secret=True)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True


@dataclass(frozen=True)
class ClientCurve:
    """Client side: our key pair and the server's public key."""

    secret_file: Path
    server_public_file: Path

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = _load(self.secret_file, want_secret=True)
        server_public, _ = _load(self.server_public_file, want_secret=False)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public


class AuthorizedKeys:
    """The authorised-keys folder as a map from Z85 public key to name (`<name>.key`), shared by threads.

    The folder is checked at most every `reload_s` seconds and re-read when its modification time changed,
    so add, remove or replace key files by creating, deleting or renaming them (not by rewriting in place).
    A key found in two files names no one and is refused."""

    def __init__(self, directory: Path, reload_s: float = 2.0) -> None:
        self.directory = directory
        self.reload_s = reload_s
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}
        self._stamp: int | None = None
        self._next_check = 0.0

    def name_of(self, z85_public_key: str) -> str | None:
        """The name whose key file holds this public key, or None when the key is not authorised."""
        with self._lock:
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + self.reload_s
                self._refresh()
            return self._names.get(z85_public_key)

    def callback(self, domain: str, z85_public_key: bytes) -> bool:
        """pyzmq's CURVE credentials-provider hook: admit a client whose key is in the folder."""
        return self.name_of(z85_public_key.decode("ascii", "replace")) is not None

    def _refresh(self) -> None:
        try:
            stamp = self.directory.stat().st_mtime_ns
        except OSError as exc:
            if self._stamp != -1:
                _log.warning("authorised-keys folder unreadable, no client is admitted: %s", exc)
            self._names, self._stamp = {}, -1
            return
        if stamp == self._stamp:
            return
        names = self._read()
        # a change within the clock's granularity of this read could share its timestamp: look again next time
        self._stamp = None if time.time_ns() - stamp < 2_000_000_000 else stamp
        if names != self._names:
            _log.info("authorised keys: %d in %s", len(names), self.directory)
            self._names = names

    def _read(self) -> dict[str, str]:
        names: dict[str, str] = {}
        refused: set[str] = set()
        for path in sorted(self.directory.glob("*.key")):
            try:
                key = zmq.auth.load_certificate(str(path))[0].decode("ascii")
            except (OSError, ValueError, IndexError) as exc:
                _log.warning("key file %s skipped: %s", path, exc)
                continue
            if key in names:
                _log.warning("key in %s is also in %s.key: refused for both", path, names[key])
                refused.add(key)
            names.setdefault(key, path.stem)
        return {key: name for key, name in names.items() if key not in refused}


def start_authenticator(
    ctx: zmq.Context, curve: ServerCurve, keys: AuthorizedKeys | None = None
) -> ThreadAuthenticator:
    """Start a ZAP handler on `ctx` that admits only clients whose public keys are in the folder (`keys`,
    when the caller shares it, e.g. with an identity check); keys added or removed later take effect."""
    if not curve.authorized_dir.is_dir():
        raise ConfigError(f"authorised-keys folder {curve.authorized_dir} does not exist")
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("prism.zap"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=keys or AuthorizedKeys(curve.authorized_dir))
    _log.info("CURVE on: clients must hold a key in %s", curve.authorized_dir)
    return auth
