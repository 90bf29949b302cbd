"""CURVE on both links: authorised keys get through, others do not."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import zmq

from prismlb.cli import main as prism
from prismlb.wire import (
    AuthorizedKeys,
    BrainAddress,
    ClientCurve,
    ConfigError,
    NodeMetrics,
    NodeVector,
    RejectCounter,
    RoutingTable,
    ServerCurve,
    SliceTable,
    TableNode,
    TablePublisher,
    TableSubscriber,
    VectorReceiver,
    VectorSender,
    generate_keypair,
    start_authenticator,
)

from .conftest import free_port

LOG = logging.getLogger("test")


def vector(node_id: str) -> NodeVector:
    return NodeVector(
        node_id=node_id, host="h", endpoint="e", seq=1, sample_time_unix_s=time.time(), period_s=1.0, metrics=NodeMetrics()
    )


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    authorized = tmp_path / "authorized"
    generate_keypair(tmp_path, "brain")
    public, _ = generate_keypair(tmp_path, "good")
    generate_keypair(tmp_path, "evil")
    authorized.mkdir()
    (authorized / "good.key").write_bytes(public.read_bytes())
    return tmp_path


def test_prism_keys_writes_a_private_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prism(["keys", "node-a", "--dir", str(tmp_path)]) == 0
    assert (tmp_path / "node-a.key").exists()
    assert (tmp_path / "node-a.key_secret").stat().st_mode & 0o777 == 0o600
    assert "node-a.key_secret" in capsys.readouterr().out


def test_vectors_from_unauthorised_keys_are_refused(ctx: zmq.Context, keys: Path, endpoint: str) -> None:
    server = ServerCurve(keys / "brain.key_secret", keys / "authorized")
    auth = start_authenticator(ctx, server)
    receiver = VectorReceiver(ctx, endpoint, RejectCounter("brain", LOG), curve=server)
    evil = VectorSender(ctx, endpoint, curve=ClientCurve(keys / "evil.key_secret", keys / "brain.key"))
    plain = VectorSender(ctx, endpoint)
    good = VectorSender(ctx, endpoint, curve=ClientCurve(keys / "good.key_secret", keys / "brain.key"))
    got: list[NodeVector] = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        for sender, node in ((evil, "evil"), (plain, "plain"), (good, "good")):
            sender.send(vector(node))
        receiver.socket.poll(100)
        got.extend(receiver.drain())
    assert {v.node_id for v in got} == {"good"}
    for closable in (receiver, evil, plain, good):
        closable.close()
    auth.stop()


def test_an_agent_refused_before_its_key_is_filed_gets_in_later(ctx: zmq.Context, keys: Path, endpoint: str) -> None:
    server = ServerCurve(keys / "brain.key_secret", keys / "authorized")
    authorized = AuthorizedKeys(keys / "authorized")
    auth = start_authenticator(ctx, server, authorized)
    receiver = VectorReceiver(ctx, endpoint, RejectCounter("brain", LOG), curve=server)
    public, _ = generate_keypair(keys, "late")
    late = VectorSender(ctx, endpoint, curve=ClientCurve(keys / "late.key_secret", keys / "brain.key"), retry_s=0.2)
    got: list[NodeVector] = []

    def run(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            late.send(vector("late"))
            receiver.socket.poll(50)
            got.extend(receiver.drain())

    run(1.0)
    assert not got and late.refused >= 1  # refused, and counted
    (keys / "authorized" / "late.key").write_bytes(public.read_bytes())
    run(4.0)
    assert {v.node_id for v in got} == {"late"}  # started over with a new socket once its key was filed
    late.close()
    receiver.close()
    auth.stop()


def test_tables_reach_only_authorised_routers(ctx: zmq.Context, keys: Path) -> None:
    server = ServerCurve(keys / "brain.key_secret", keys / "authorized")
    auth = start_authenticator(ctx, server)
    address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    publisher = TablePublisher(ctx, address.updates, address.snapshot, RejectCounter("brain", LOG), curve=server)
    publisher.publish(
        RoutingTable(
            epoch=1,
            version=1,
            issued_unix_s=time.time(),
            slices=[SliceTable(name="default", nodes=[TableNode(node_id="a", endpoint="http://a", weight=1.0)])],
        )
    )
    got: dict[str, list[RoutingTable]] = {"good": [], "evil": []}
    subscribers = [
        TableSubscriber(
            ctx,
            [address],
            lambda t, name=name: got[name].append(t) is None,
            RejectCounter("router", LOG),
            curve=ClientCurve(keys / f"{name}.key_secret", keys / "brain.key"),
        )
        for name in ("good", "evil")
    ]
    for s in subscribers:
        s.start()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        publisher.serve_snapshots()
        time.sleep(0.02)
    for s in subscribers:
        s.stop()
    publisher.close()
    auth.stop()
    assert [t.order for t in got["good"]] == [(1, 1)]
    assert got["evil"] == []


def test_missing_key_files_are_a_config_error(tmp_path: Path, ctx: zmq.Context) -> None:
    sock = ctx.socket(zmq.PUSH)
    with pytest.raises(ConfigError):
        ClientCurve(tmp_path / "nope.key_secret", tmp_path / "brain.key").apply(sock)
    public, _ = generate_keypair(tmp_path, "x")
    with pytest.raises(ConfigError):
        ClientCurve(public, public).apply(sock)
    with pytest.raises(ConfigError):
        start_authenticator(ctx, ServerCurve(tmp_path / "x.key_secret", tmp_path / "missing"))
    sock.close()
