"""CURVE keys and the authenticator: a policy layer applied to sockets, separate from the transport."""

from __future__ import annotations

import logging
import os
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


def start_authenticator(ctx: zmq.Context, curve: ServerCurve) -> ThreadAuthenticator:
    """Start a ZAP handler on `ctx` that admits only clients whose public keys are in the folder."""
    if not curve.authorized_dir.is_dir():
        raise ConfigError(f"authorised-keys folder {curve.authorized_dir} does not exist")
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("prism.zap"))
    auth.start()
    auth.configure_curve(domain="*", location=str(curve.authorized_dir))
    _log.info("CURVE on: clients must hold a key in %s", curve.authorized_dir)
    return auth
