"""Identity bound to key: over real CURVE sockets a node may only send vectors under its own key file's name."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from prismlb.brain._identity import IdentityPolicy
from prismlb.wire import (
    AuthorizedKeys,
    ClientCurve,
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

LOG = logging.getLogger("test.identity")


def vector(node_id: str, seq: int = 1) -> NodeVector:
    return NodeVector(
        node_id=node_id,
        host="h",
        endpoint="e",
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
        self.auth = start_authenticator(ctx, server, self.authorized)
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

    def pump(self, sends: list[tuple[str, str]], until: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Send (key, claimed node id) pairs and drain until `until()` holds or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for key, node_id in sends:
                self._seq += 1
                self.senders[key].send(vector(node_id, self._seq))
            self.receiver.socket.poll(20)
            self.got.extend(self.receiver.drain())
            if until():
                return True
        return False

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
    assert authorized.callback("*", public_b) and not authorized.callback("*", public_a)


def test_policy_without_a_user_id_refuses(keys: Path) -> None:
    policy = IdentityPolicy(AuthorizedKeys(keys / "authorized"))
    with pytest.raises(UnknownKeyError):
        policy.check(vector("node-a"), None)
