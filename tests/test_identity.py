"""Identity bound to key: over real CURVE sockets a node may only send vectors under its own key file's name."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
from prometheus_client import CollectorRegistry

from prismlb.brain._cli import add_parser
from prismlb.brain._config import resolve_config
from prismlb.brain._identity import IdentityPolicy, exposed, start_curve
from prismlb.wire import (
    AGENTS_DOMAIN,
    ROUTERS_DOMAIN,
    AuthorizedKeys,
    ClientCurve,
    ConfigError,
    EndpointNotAllowedError,
    EndpointRule,
    KvBlocks,
    NodeMetrics,
    NodeVector,
    RejectCounter,
    ServerCurve,
    UnknownKeyError,
    VectorReceiver,
    VectorSender,
    generate_keypair,
    start_authenticator,
)

from .conftest import wait_for

LOG = logging.getLogger("test.identity")


LOCAL = "http://127.0.0.1:8000"  # the address loopback connections come from: allowed without a list


def vector(node_id: str, seq: int = 1, endpoint: str = LOCAL) -> NodeVector:
    return NodeVector(
        node_id=node_id,
        host="h",
        endpoint=endpoint,
        seq=seq,
        sample_time_unix_s=time.time(),
        period_s=1.0,
        metrics=NodeMetrics(),
    )


def authorise(keys: Path, name: str) -> None:
    """File `name`'s public key in the authorised folder the documented way (written aside, renamed in)."""
    tmp = keys / "authorized" / f".{name}.tmp"
    shutil.copyfile(keys / f"{name}.key", tmp)
    os.replace(tmp, keys / "authorized" / f"{name}.key")


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    for name in ("brain", "node-a", "node-b", "node-c"):
        generate_keypair(tmp_path, name)
    (tmp_path / "authorized").mkdir()
    authorise(tmp_path, "node-a")
    authorise(tmp_path, "node-b")
    return tmp_path


class Ingest:
    """A brain's CURVE ingest with the identity policy, and a sender per node key."""

    def __init__(self, ctx: zmq.Context, keys: Path, endpoint: str) -> None:
        server = ServerCurve(keys / "brain.key_secret", keys / "authorized")
        self.authorized = AuthorizedKeys(server.authorized_dir, reload_s=0.05)
        self.auth = start_authenticator(ctx, server, keys={server.domain: self.authorized})
        self.rejects = RejectCounter("brain", LOG)
        self.receiver = VectorReceiver(
            ctx, endpoint, self.rejects, curve=server, identity=IdentityPolicy(self.authorized)
        )
        self._ctx, self._keys, self._endpoint = ctx, keys, endpoint
        self.senders: dict[str, VectorSender] = {}
        for name in ("node-a", "node-b"):
            self.connect(name)
        self.got: list[NodeVector] = []
        self._seq = 0

    def connect(self, name: str) -> None:
        """A (new) agent connection holding `name`'s key pair."""
        if name in self.senders:
            self.senders[name].close()
        curve = ClientCurve(self._keys / f"{name}.key_secret", self._keys / "brain.key")
        self.senders[name] = VectorSender(self._ctx, self._endpoint, curve=curve)

    def pump(
        self, sends: list[tuple[str, str] | tuple[str, str, str]], until: Callable[[], bool], timeout_s: float = 5.0
    ) -> bool:
        """Send (key, claimed node id[, endpoint]) and drain until `until()` holds or time runs out."""

        def step() -> bool:
            for key, node_id, *endpoint in sends:
                self._seq += 1
                self.senders[key].send(vector(node_id, self._seq, *endpoint))
            self.receiver.socket.poll(20)
            self.got.extend(self.receiver.drain())
            return until()

        return wait_for(step, timeout_s)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        self.receiver.close()
        self.auth.stop()


@pytest.fixture
def ingest(ctx: zmq.Context, keys: Path, endpoint: str) -> Iterator[Ingest]:
    ingest = Ingest(ctx, keys, endpoint)
    yield ingest
    ingest.close()


def test_a_node_claiming_another_nodes_id_is_rejected_and_counted(
    ingest: Ingest, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOG.name)
    done = ingest.pump(
        [("node-a", "node-b"), ("node-a", "node-a")],
        lambda: ingest.rejects.counts().get("spoofed_identity", 0) >= 5 and len(ingest.got) >= 5,
    )
    assert done, (ingest.rejects.counts(), len(ingest.got))
    assert {v.node_id for v in ingest.got} == {"node-a"}
    assert set(ingest.rejects.counts()) == {"spoofed_identity"}
    logged = [r.getMessage() for r in caplog.records if "spoofed_identity" in r.getMessage()]
    assert len(logged) == 1 and "key of node-a" in logged[0] and "node-b" in logged[0]


def test_kv_blocks_are_taken_only_under_their_nodes_key(ingest: Ingest) -> None:
    """A node's KV blocks carry no endpoint: the key must be filed under the node id they claim (`check_node`)."""
    kv: list[KvBlocks] = []
    sent = 0

    def step() -> bool:
        nonlocal sent
        sent += 1
        ingest.senders["node-a"].send(KvBlocks(node_id="node-a", seq=sent, stored=[sent]))
        ingest.senders["node-a"].send(KvBlocks(node_id="node-b", seq=sent, stored=[sent]))
        ingest.receiver.socket.poll(20)
        ingest.receiver.drain(kv=kv)
        return bool(kv) and ingest.rejects.counts().get("spoofed_identity", 0) >= 3

    wait_for(step, 5.0)
    assert kv and {message.node_id for message in kv} == {"node-a"}
    assert set(ingest.rejects.counts()) == {"spoofed_identity"}


def test_each_node_is_accepted_under_its_own_key(ingest: Ingest) -> None:
    assert ingest.pump(
        [("node-a", "node-a"), ("node-b", "node-b")], lambda: {v.node_id for v in ingest.got} == {"node-a", "node-b"}
    )
    assert ingest.rejects.total == 0


def test_a_key_added_later_is_admitted_and_bound(ingest: Ingest, keys: Path) -> None:
    ingest.connect("node-c")
    ingest.pump([("node-c", "node-c")], lambda: False, timeout_s=0.5)
    assert ingest.got == []  # not authorised yet: the authenticator refuses the connection
    authorise(keys, "node-c")
    ingest.connect("node-c")  # libzmq does not retry a connection the authenticator refused
    assert ingest.pump([("node-c", "node-c"), ("node-c", "node-a")], lambda: len(ingest.got) >= 3, timeout_s=8)
    assert {v.node_id for v in ingest.got} == {"node-c"}
    assert ingest.rejects.counts().get("spoofed_identity", 0) >= 1


def test_a_removed_key_stops_vectors_on_an_open_connection(ingest: Ingest, keys: Path) -> None:
    assert ingest.pump([("node-b", "node-b")], lambda: len(ingest.got) >= 1)
    (keys / "authorized" / "node-b.key").unlink()
    assert ingest.pump([("node-b", "node-b")], lambda: ingest.rejects.counts().get("unknown_key", 0) >= 3)
    ingest.got.clear()
    ingest.pump([("node-b", "node-b")], lambda: False, timeout_s=0.3)
    assert ingest.got == []


def test_key_folder_maps_keys_to_file_names_and_refuses_ambiguity(keys: Path) -> None:
    folder = keys / "authorized"
    (folder / "broken.key").write_text("no key here\n")
    shutil.copyfile(keys / "node-a.key", folder / "node-a-copy.key")
    (folder / "node-c.key_secret").write_bytes((keys / "node-c.key_secret").read_bytes())
    authorized = AuthorizedKeys(folder, reload_s=0)
    public_a, _ = zmq.auth.load_certificate(keys / "node-a.key")
    public_b, _ = zmq.auth.load_certificate(keys / "node-b.key")
    public_c, _ = zmq.auth.load_certificate(keys / "node-c.key")
    assert authorized.name_of(public_b.decode()) == "node-b"
    assert authorized.name_of(public_a.decode()) is None  # filed twice: names no one
    assert authorized.name_of(public_c.decode()) is None  # a secret key file is not an authorisation


def test_policy_without_a_user_id_refuses(keys: Path) -> None:
    policy = IdentityPolicy(AuthorizedKeys(keys / "authorized"))
    with pytest.raises(UnknownKeyError):
        policy.check(vector("node-a"), None, "127.0.0.1")


def file_endpoints(keys: Path, name: str, text: str) -> None:
    """File `name`'s endpoint allow-list next to its key, written aside and renamed in like a key."""
    tmp = keys / "authorized" / f".{name}.endpoints.tmp"
    tmp.write_text(text)
    os.replace(tmp, keys / "authorized" / f"{name}.endpoints")


def test_an_endpoint_outside_the_nodes_list_is_rejected_and_counted(ingest: Ingest, keys: Path) -> None:
    file_endpoints(keys, "node-a", "10.0.0.7:8000  # the GPU host\nnode-a.cluster\n")
    wait_for(lambda: ingest.authorized.endpoints_of("node-a") is not None, what="the folder to be reloaded")
    allowed = {"http://10.0.0.7:8000", "https://node-a.cluster", "http://node-a.cluster:9000"}
    sends = [("node-a", "node-a", url) for url in (*allowed, "http://attacker:80", "http://10.0.0.7:9000", LOCAL)]
    assert ingest.pump(sends, lambda: ingest.rejects.counts().get("endpoint_not_allowed", 0) >= 9)
    assert {v.endpoint for v in ingest.got} == allowed  # a filed list replaces the connection's address
    assert set(ingest.rejects.counts()) == {"endpoint_not_allowed"}


def test_without_a_list_the_endpoint_must_be_the_connections_address(ingest: Ingest) -> None:
    sends = [("node-b", "node-b", url) for url in (LOCAL, "http://attacker:80", "http://10.1.2.3:8000", "e")]
    assert ingest.pump(sends, lambda: ingest.rejects.counts().get("endpoint_not_allowed", 0) >= 6)
    assert {v.endpoint for v in ingest.got} == {LOCAL}


def test_endpoint_lists_parse_hosts_and_ports(keys: Path) -> None:
    assert EndpointRule.parse("Node-A.Cluster.") == EndpointRule("node-a.cluster")
    assert EndpointRule.parse("[::1]:8000") == EndpointRule("::1", 8000)
    assert EndpointRule.parse("::ffff:10.0.0.1") == EndpointRule("10.0.0.1")
    for bad in ("host:0", "host:x", "http://host", "[::1", ""):
        with pytest.raises(ValueError):
            EndpointRule.parse(bad)
    file_endpoints(keys, "node-a", "bad:port:x:\nhttp://nope\n10.0.0.7\n")
    file_endpoints(keys, "node-b", "*\n")
    policy = IdentityPolicy(AuthorizedKeys(keys / "authorized", reload_s=0))
    public_a = zmq.auth.load_certificate(keys / "node-a.key")[0].decode()
    public_b = zmq.auth.load_certificate(keys / "node-b.key")[0].decode()
    assert policy.keys.endpoints_of("node-a") == {EndpointRule("10.0.0.7")}  # bad lines skipped, not widened
    policy.check(vector("node-a", endpoint="http://10.0.0.7:1234"), public_a, "192.0.2.1")
    with pytest.raises(EndpointNotAllowedError):
        policy.check(vector("node-a", endpoint=LOCAL), public_a, "127.0.0.1")
    policy.check(vector("node-b", endpoint="http://anywhere:1"), public_b, "192.0.2.1")  # `*`: the opt-out


def curve_args(keys: Path, **extra: str) -> argparse.Namespace:
    return argparse.Namespace(
        curve_secret=str(keys / "brain.key_secret"), curve_clients=str(keys / "authorized"), **extra
    )


def test_curve_needs_a_separate_routers_folder(keys: Path) -> None:
    with pytest.raises(ConfigError, match="--curve-routers"):
        resolve_config(curve_args(keys), {})
    with pytest.raises(ConfigError, match="different folders"):
        resolve_config(curve_args(keys, curve_routers=str(keys / "authorized")), {})
    config = resolve_config(curve_args(keys), {"PRISM_CURVE_ROUTERS": str(keys / "routers")})
    assert config.curve is not None and config.curve.domain == AGENTS_DOMAIN
    assert config.curve_routers is not None and config.curve_routers.domain == ROUTERS_DOMAIN


def test_the_brains_ingest_refuses_a_router_key(ctx: zmq.Context, keys: Path, endpoint: str) -> None:
    generate_keypair(keys / "routers", "router-1")
    config = resolve_config(curve_args(keys, ingest=endpoint, curve_routers=str(keys / "routers")), {})
    registry = CollectorRegistry()
    auth, identity = start_curve(ctx, config, registry)
    rejects = RejectCounter("brain", LOG)
    receiver = VectorReceiver(ctx, config.ingest, rejects, curve=config.curve, identity=identity)
    router = ClientCurve(keys / "routers" / "router-1.key_secret", keys / "brain.key")
    senders = {
        "router-1": VectorSender(ctx, endpoint, curve=router),
        "node-a": VectorSender(ctx, endpoint, curve=ClientCurve(keys / "node-a.key_secret", keys / "brain.key")),
    }
    got: list[NodeVector] = []

    def step() -> bool:
        for name, sender in senders.items():
            sender.send(vector(name))
        receiver.socket.poll(50)
        got.extend(receiver.drain())
        return bool(got) and senders["router-1"].refused > 0

    wait_for(step, 5)
    for closable in (receiver, *senders.values()):
        closable.close()
    assert auth is not None
    auth.stop()
    assert {v.node_id for v in got} == {"node-a"} and rejects.total == 0  # refused at the handshake, not later
    assert (registry.get_sample_value("prism_brain_curve_refused_total", {"domain": AGENTS_DOMAIN}) or 0) >= 1
    assert registry.get_sample_value("prism_brain_curve_refused_total", {"domain": ROUTERS_DOMAIN}) == 0


def brain_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["brain", *argv])


def plaintext_warnings(ctx: zmq.Context, caplog: pytest.LogCaptureFixture, *argv: str, **environ: str) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prism.brain"):
        assert start_curve(ctx, resolve_config(brain_args(*argv), environ), CollectorRegistry()) == (None, None)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_plaintext_on_a_public_bind_is_warned_about_unless_allowed(
    ctx: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    warned = plaintext_warnings(ctx, caplog, "--ingest", "tcp://0.0.0.0:5555")
    assert len(warned) >= 3 and "CURVE IS OFF" in warned[0] and "ingest tcp://0.0.0.0:5555" in warned[0]
    assert any("--allow-plaintext" in line for line in warned)
    assert plaintext_warnings(ctx, caplog, "--ingest", "tcp://0.0.0.0:5555", "--allow-plaintext") == []
    assert plaintext_warnings(ctx, caplog, "--updates", "tcp://*:5556", PRISM_BRAIN_ALLOW_PLAINTEXT="1") == []
    assert plaintext_warnings(ctx, caplog) == []  # the defaults are loopback
    assert plaintext_warnings(ctx, caplog, "--snapshot", "tcp://localhost:5557") == []


@pytest.mark.parametrize(
    ("endpoint", "public"),
    [
        ("tcp://0.0.0.0:5555", True),
        ("tcp://*:5555", True),
        ("tcp://[::]:5555", True),
        ("tcp://10.0.0.2:5555", True),
        ("tcp://eth0:5555", True),
        ("tcp://brain.example:5555", True),
        ("tcp://127.0.0.1:5555", False),
        ("tcp://127.0.0.2:5555", False),
        ("tcp://[::1]:5555", False),
        ("tcp://localhost:5555", False),
        ("ipc:///run/prism/ingest", False),
    ],
)
def test_which_binds_reach_beyond_this_host(endpoint: str, public: bool) -> None:
    assert exposed(endpoint) is public
