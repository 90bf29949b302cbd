"""CURVE keys and the authenticator: a policy layer applied to sockets, separate from the transport.

A server's authorised-keys folder holds one public key file per client, `<name>.key`; the file's name is the
client's identity (for an agent, its node id). The folder is re-read when it changes.

Clients come in roles, and each role has its own folder and its own ZAP domain: the brain's ingest socket
admits only keys filed in the agents' folder, its table and snapshot sockets only keys filed in the routers'
folder. A router's key therefore cannot push node vectors, and an agent's key cannot read routing tables.
Next to an agent's key, `<node_id>.endpoints` may list the hosts its vectors may advertise as the node's
endpoint (see `AuthorizedKeys.endpoints_of`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from prometheus_client import CollectorRegistry, Counter
from zmq.auth.thread import ThreadAuthenticator

from ._exceptions import ConfigError

_log = logging.getLogger("prism.curve")

AGENTS_DOMAIN = "prism-agents"
"""ZAP domain of the brain's ingest socket: only agent keys are admitted there."""
ROUTERS_DOMAIN = "prism-routers"
"""ZAP domain of the brain's table (PUB) and snapshot (ROUTER) sockets: only router keys are admitted there."""
ANY_DOMAIN = "*"
"""pyzmq's catch-all domain, for a server with a single role (one folder for every client)."""

ANY_ENDPOINT = "*"
"""The `.endpoints` host that matches any host: the operator's explicit opt-out of the endpoint binding."""
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?")


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
    """Server side: our key pair, the folder of client public keys admitted, and the ZAP domain that names
    this role to the authenticator (`start_authenticator` gives each domain its own folder)."""

    secret_file: Path
    authorized_dir: Path
    domain: str = ANY_DOMAIN

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = _load(self.secret_file, want_secret=True)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        if self.domain != ANY_DOMAIN:  # pyzmq's authenticator files a socket without a domain under "*"
            sock.zap_domain = self.domain.encode()


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


@dataclass(frozen=True)
class EndpointRule:
    """One `.endpoints` line: a host (any port) or host:port. Hosts are lower-cased, IP literals normalised."""

    host: str
    port: int | None = None

    @classmethod
    def parse(cls, line: str) -> EndpointRule:
        """`host`, `host:port`, `[v6]`, `[v6]:port`, a bare IPv6 address or `*` (any host); ValueError otherwise."""
        text = line.strip()
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise ValueError(f"bad bracketed address {line!r}")
            port = rest[1:] or None
        elif text.count(":") == 1:
            host, port = text.split(":")
        else:
            host, port = text, None
        host = normal_host(host)
        if not (host == ANY_ENDPOINT or _HOST_NAME.fullmatch(host) or _is_ip(host)):
            raise ValueError(f"not a host, host:port or IP address: {line!r}")
        number = int(port) if port is not None else None
        if number is not None and not 0 < number < 65536:
            raise ValueError(f"port out of range in {line!r}")
        return cls(host, number)

    def allows(self, host: str, port: int) -> bool:
        """Whether an endpoint at `host` (in `normal_host` form) and `port` matches this line."""
        return self.host in (ANY_ENDPOINT, host) and self.port in (None, port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def normal_host(host: str) -> str:
    """The form hosts are compared in: lower case, IP literals compressed (an IPv4-mapped IPv6 as IPv4)."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host.rstrip(".")
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


class AuthorizedKeys:
    """An authorised-keys folder as a map from Z85 public key to name (`<name>.key`), shared by threads.

    The folder is checked at most every `reload_s` seconds and re-read when its modification time changed,
    so add, remove or replace key files (and `.endpoints` lists) by creating, deleting or renaming them (not by
    rewriting in place). A key found in two files names no one and is refused."""

    def __init__(self, directory: Path, reload_s: float = 2.0) -> None:
        self.directory = directory
        self.reload_s = reload_s
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}
        self._endpoints: dict[str, frozenset[EndpointRule]] = {}
        self._stamp: int | None = None
        self._next_check = 0.0

    def name_of(self, z85_public_key: str) -> str | None:
        """The name whose key file holds this public key, or None when the key is not authorised."""
        with self._lock:
            self._maybe_refresh()
            return self._names.get(z85_public_key)

    def endpoints_of(self, name: str) -> frozenset[EndpointRule] | None:
        """The endpoint hosts filed for `name` in `<name>.endpoints` (one host or host:port a line, `#`
        comments; a `*` line allows any), or None when no list is filed. Unparsable lines are logged and
        skipped, so a typo narrows what is allowed rather than widening it."""
        with self._lock:
            self._maybe_refresh()
            return self._endpoints.get(name)

    def _maybe_refresh(self) -> None:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.reload_s
            self._refresh()

    def _refresh(self) -> None:
        try:
            stamp = self.directory.stat().st_mtime_ns
        except OSError as exc:
            if self._stamp != -1:
                _log.warning("authorised-keys folder unreadable, no client is admitted: %s", exc)
            self._names, self._endpoints, self._stamp = {}, {}, -1
            return
        if stamp == self._stamp:
            return
        names = self._read_keys()
        self._endpoints = self._read_endpoints()
        # a change within the clock's granularity of this read could share its timestamp: look again next time
        self._stamp = None if time.time_ns() - stamp < 2_000_000_000 else stamp
        if names != self._names:
            _log.info("authorised keys: %d in %s", len(names), self.directory)
            self._names = names

    def _read_keys(self) -> dict[str, str]:
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

    def _read_endpoints(self) -> dict[str, frozenset[EndpointRule]]:
        lists: dict[str, frozenset[EndpointRule]] = {}
        for path in sorted(self.directory.glob("*.endpoints")):
            try:
                lines = path.read_text().splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                _log.warning("endpoint list %s unreadable, %s may advertise no endpoint: %s", path, path.stem, exc)
                lines = []
            rules: set[EndpointRule] = set()
            for number, raw in enumerate(lines, 1):
                line = raw.split("#", 1)[0].strip()
                if line:
                    try:
                        rules.add(EndpointRule.parse(line))
                    except ValueError as exc:
                        _log.warning("%s:%d skipped: %s", path, number, exc)
            lists[path.stem] = frozenset(rules)
        return lists


class CurveRefusals:
    """Refused CURVE handshakes, counted per ZAP domain (`prism_brain_curve_refused_total{domain}` on
    `registry`: the brain is Prism's only CURVE server) and logged once per run of refusals of one key in one
    domain: a refused client retries every second or so, and a line per attempt would bury everything else.
    The run ends when that key is admitted in that domain, so a key refused again later is logged again."""

    MAX_REMEMBERED = 4096  # keys in a refused run remembered at once; a flood of fresh keys only re-logs

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._lock = threading.Lock()
        self._refusing: set[tuple[str, str]] = set()
        self._counts: dict[str, int] = {}
        self._metric: Counter | None = None
        if registry is not None:
            self._metric = Counter(
                "prism_brain_curve_refused", "CURVE handshakes refused, by ZAP domain", ["domain"], registry=registry
            )

    def track(self, domain: str) -> None:
        """Export `domain`'s count from zero before its first refusal, so alerts see the series."""
        with self._lock:
            self._counts.setdefault(domain, 0)
        if self._metric is not None:
            self._metric.labels(domain)

    def refused(self, domain: str, key: str, reason: str) -> None:
        with self._lock:
            self._counts[domain] = self._counts.get(domain, 0) + 1
            first = (domain, key) not in self._refusing
            if first:
                if len(self._refusing) >= self.MAX_REMEMBERED:
                    self._refusing.clear()
                self._refusing.add((domain, key))
        if self._metric is not None:
            self._metric.labels(domain).inc()
        if first:
            _log.warning(
                "CURVE handshake refused in domain %s: key %s %s (further attempts are only counted)",
                domain,
                key,
                reason,
            )

    def admitted(self, domain: str, key: str) -> None:
        with self._lock:
            self._refusing.discard((domain, key))

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _DomainKeys:
    """pyzmq's credentials provider for one ZAP domain: admits the keys filed in that domain's folder; a
    refusal says where the key is filed instead, since a key presented in the wrong role is the likely slip."""

    def __init__(
        self, domain: str, keys: AuthorizedKeys, roles: Mapping[str, AuthorizedKeys], refusals: CurveRefusals
    ) -> None:
        self.domain, self.keys, self.roles, self.refusals = domain, keys, roles, refusals
        refusals.track(domain)

    def callback(self, domain: str, z85_public_key: bytes) -> bool:
        key = z85_public_key.decode("ascii", "replace")
        if self.keys.name_of(key) is not None:
            self.refusals.admitted(self.domain, key)
            return True
        elsewhere = [
            f"{name}.key in {other.directory} (domain {role})"
            for role, other in self.roles.items()
            if role != self.domain and (name := other.name_of(key)) is not None
        ]
        where = f"is filed as {', '.join(elsewhere)}" if elsewhere else "is filed nowhere"
        self.refusals.refused(self.domain, key, f"is not in {self.keys.directory}; it {where}")
        return False


def start_authenticator(
    ctx: zmq.Context,
    *curves: ServerCurve,
    keys: Mapping[str, AuthorizedKeys] | None = None,
    refusals: CurveRefusals | None = None,
) -> ThreadAuthenticator:
    """Start a ZAP handler on `ctx` with one credentials provider per curve's domain, each admitting only the
    clients whose public keys are in that curve's folder (`keys[domain]` when the caller shares the folder,
    e.g. with an identity check); keys added or removed later take effect. A socket whose domain has no
    provider admits no one. Refusals are logged and counted by `refusals` (a fresh, unexported one if None)."""
    if not curves:
        raise ConfigError("the authenticator needs at least one server curve")
    domains = [curve.domain for curve in curves]
    if len(set(domains)) != len(domains):
        raise ConfigError(f"each role needs its own ZAP domain, got {domains}")
    for curve in curves:
        if not curve.authorized_dir.is_dir():
            raise ConfigError(f"authorised-keys folder {curve.authorized_dir} does not exist")
    shared = keys or {}
    roles = {curve.domain: shared.get(curve.domain) or AuthorizedKeys(curve.authorized_dir) for curve in curves}
    refusals = refusals or CurveRefusals()
    providers = {domain: _DomainKeys(domain, folder, roles, refusals) for domain, folder in roles.items()}
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("prism.zap"))
    auth.start()
    for domain, provider in providers.items():
        auth.configure_curve_callback(domain=domain, credentials_provider=provider)
        _log.info("CURVE on: clients in domain %s must hold a key in %s", domain, roles[domain].directory)
    return auth
