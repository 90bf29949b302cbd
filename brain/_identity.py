"""Who may talk to the brain. With CURVE on, agents and routers hold keys in separate folders and ZAP domains,
a node's identity is its key (a vector is taken only from the key filed as `<node_id>.key`) and the endpoint
it advertises is bound to that key's registration.

Without CURVE there is no binding: the brain trusts the network, and any sender may claim any node id and
endpoint, and read every table; so the brain warns at start when it listens beyond this host in plaintext.
"""

from __future__ import annotations

import ipaddress
import logging
from urllib.parse import urlsplit

import zmq
from prometheus_client import CollectorRegistry
from zmq.auth.thread import ThreadAuthenticator

from prismlb.wire import (
    AuthorizedKeys,
    ConfigError,
    CurveRefusals,
    EndpointNotAllowedError,
    NodeVector,
    SpoofedIdentityError,
    UnknownKeyError,
    normal_host,
    start_authenticator,
)

from ._config import ENV, BrainConfig

_log = logging.getLogger("prism.brain")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _endpoint_host(endpoint: str) -> tuple[str, int] | None:
    """The (host, port) a node's endpoint URL points at, or None when it is not a URL with both."""
    try:
        parts = urlsplit(endpoint)
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return normal_host(parts.hostname), port


class IdentityPolicy:
    """The `VectorReceiver` identity check: the vector's node id must be the name of its sender's key file, and
    its endpoint's host must be one the node is registered for.

    The registration is `<node_id>.endpoints` next to the key, one host or host:port a line (`*`: any). With no
    such file the endpoint's host must be the address the agent's connection comes from (`Peer-Address`), an IP
    literal, so an agent cannot point the routers at another machine; an agent that advertises a host name, or
    sits behind NAT or a proxy, needs its list filed."""

    def __init__(self, keys: AuthorizedKeys) -> None:
        self.keys = keys

    def check_node(self, node_id: str, user_id: str | None) -> str:
        """The key's owner, `node_id`; raises unless `user_id` is filed under `node_id` (what a message without an
        endpoint, a node's KV blocks, is checked for)."""
        owner = self.keys.name_of(user_id) if user_id else None
        if owner is None:
            raise UnknownKeyError(f"message for {node_id} came over a connection whose key is not authorised")
        if owner != node_id:
            raise SpoofedIdentityError(f"key of {owner} sent a message claiming node id {node_id}")
        return owner

    def check(self, vector: NodeVector, user_id: str | None, peer_address: str | None) -> None:
        """Raise unless `user_id` (the sender's Z85 public key, as pyzmq's authenticator names it) is filed
        under `vector.node_id` and the endpoint's host is allowed for that node."""
        owner = self.check_node(vector.node_id, user_id)
        target = _endpoint_host(vector.endpoint)
        if target is None:
            raise EndpointNotAllowedError(f"{owner} advertised {vector.endpoint!r}, not a URL with a host and port")
        host, port = target
        rules = self.keys.endpoints_of(owner)
        if rules is None:
            peer = normal_host(peer_address) if peer_address else None
            if host != peer:
                raise EndpointNotAllowedError(
                    f"{owner} advertised {vector.endpoint!r} from {peer_address or 'an unknown address'}, and no "
                    f"{owner}.endpoints in {self.keys.directory} allows another host"
                )
        elif not any(rule.allows(host, port) for rule in rules):
            raise EndpointNotAllowedError(
                f"{owner} advertised {vector.endpoint!r}, not in {self.keys.directory / (owner + '.endpoints')}"
            )


def start_curve(
    ctx: zmq.Context, config: BrainConfig, registry: CollectorRegistry
) -> tuple[ThreadAuthenticator | None, IdentityPolicy | None]:
    """With CURVE on, the authenticator (agents' and routers' domains, refusals counted on `registry`) and the
    identity policy sharing the agents' folder with it; with CURVE off (None, None), after warning about a
    plaintext bind beyond this host."""
    if config.curve is None and config.curve_routers is None:
        warn_if_plaintext(config)
        return None, None
    if config.curve is None or config.curve_routers is None:
        raise ConfigError("CURVE needs both the agents' and the routers' key folders")
    agents = AuthorizedKeys(config.curve.authorized_dir)
    auth = start_authenticator(
        ctx, config.curve, config.curve_routers, keys={config.curve.domain: agents}, refusals=CurveRefusals(registry)
    )
    return auth, IdentityPolicy(agents)


def exposed(endpoint: str) -> bool:
    """Whether binding `endpoint` listens beyond this host: a tcp:// host that is not loopback or `localhost`
    (`*`, 0.0.0.0, ::, another address, an interface or host name)."""
    if not endpoint.startswith("tcp://"):
        return False  # ipc:// and inproc:// never leave the host
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]").lower()
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def warn_if_plaintext(config: BrainConfig) -> None:
    """Log loudly, once at start, that a CURVE-less brain bound beyond this host lets anyone reach it, unless the
    operator said the network is trusted (`--allow-plaintext`)."""
    binds = {"ingest": config.ingest, "updates": config.updates, "snapshot": config.snapshot}
    open_binds = [f"{name} {endpoint}" for name, endpoint in binds.items() if exposed(endpoint)]
    if not open_binds:
        return
    if config.allow_plaintext:
        _log.info("CURVE off on %s: plaintext allowed by --allow-plaintext", ", ".join(open_binds))
        return
    for line in (
        f"CURVE IS OFF and the brain listens beyond this host: {', '.join(open_binds)}.",
        "Anyone who can reach these ports can push node vectors under any node id and endpoint, steering requests",
        "to machines of their choosing, and can subscribe to every routing table (nodes, endpoints, load).",
        "Turn CURVE on (--curve-secret, --curve-clients, --curve-routers), or bind to 127.0.0.1, or pass",
        f"--allow-plaintext ({ENV['allow_plaintext']}=1) if only trusted hosts can reach this network.",
    ):
        _log.warning(line)
