"""CURVE on both links: authorised keys get through, others do not."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import zmq
from prometheus_client import CollectorRegistry

from prismlb.cli import main as prism
from prismlb.wire import (
    AGENTS_DOMAIN,
    ROUTERS_DOMAIN,
    AuthorizedKeys,
    BrainAddress,
    ClientCurve,
    ConfigError,
    CurveRefusals,
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

from .conftest import free_port, wait_for

LOG = logging.getLogger("test")


def vector(node_id: str) -> NodeVector:
    return NodeVector(
        node_id=node_id,
        host="h",
        endpoint="e",
        seq=1,
        sample_time_unix_s=time.time(),
        period_s=1.0,
        metrics=NodeMetrics(),
    )


def table() -> RoutingTable:
    return RoutingTable(
        epoch=1,
        version=1,
        issued_unix_s=time.time(),
        slices=[SliceTable(name="default", nodes=[TableNode(node_id="a", endpoint="http://a", weight=1.0)])],
    )


def subscribed_tables(
    ctx: zmq.Context,
    keys: Path,
    curve: ServerCurve,
    names: tuple[str, ...],
    refusals: CurveRefusals,
    *,
    heartbeat: bool = False,
) -> dict[str, list[RoutingTable]]:
    """Publish `table()` under `curve` to a subscriber per key name in `names` (snapshots served, heartbeats sent
    with `heartbeat`) until a subscriber has the table and `refusals` has counted two refused handshakes (a refused
    key's SUB and DEALER: libzmq does not retry a refused key, so nothing reaches it after that), and return the
    tables each got."""
    address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    publisher = TablePublisher(ctx, address.updates, address.snapshot, RejectCounter("brain", LOG), curve=curve)
    publisher.publish(table())
    got: dict[str, list[RoutingTable]] = {name: [] for name in names}
    subscribers = [
        TableSubscriber(
            ctx,
            [address],
            lambda t, name=name: got[name].append(t) is None,
            RejectCounter("router", LOG),
            curve=ClientCurve(keys / f"{name}.key_secret", keys / "brain.key"),
        )
        for name in names
    ]
    for s in subscribers:
        s.start()

    def served() -> bool:
        publisher.serve_snapshots()
        if heartbeat:
            publisher.heartbeat()
        return any(got.values()) and sum(refusals.counts().values()) >= 2

    wait_for(served)
    for s in subscribers:
        s.stop()
    publisher.close()
    return got


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    authorized = tmp_path / "authorized"
    generate_keypair(tmp_path, "brain")
    public, _ = generate_keypair(tmp_path, "good")
    generate_keypair(tmp_path, "evil")
    authorized.mkdir()
    (authorized / "good.key").write_bytes(public.read_bytes())
    return tmp_path


def roles(keys: Path) -> tuple[ServerCurve, ServerCurve]:
    """The brain's two roles: `good` filed as an agent (in `authorized`), `router` in the routers' folder."""
    public, _ = generate_keypair(keys, "router")
    (keys / "routers").mkdir()
    (keys / "routers" / "router.key").write_bytes(public.read_bytes())
    secret = keys / "brain.key_secret"
    agents = ServerCurve(secret, keys / "authorized", AGENTS_DOMAIN)
    return agents, ServerCurve(secret, keys / "routers", ROUTERS_DOMAIN)


def refused(registry: CollectorRegistry, domain: str) -> float | None:
    return registry.get_sample_value("prism_brain_curve_refused_total", {"domain": domain})


def test_prism_keys_writes_a_private_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prism(["keys", "node-a", "--dir", str(tmp_path)]) == 0
    assert (tmp_path / "node-a.key").exists()
    assert (tmp_path / "node-a.key_secret").stat().st_mode & 0o777 == 0o600
    assert "node-a.key_secret" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["../../etc/x", "/tmp/abs", ".hidden", "a/b", ""])
def test_prism_keys_refuses_a_name_that_is_not_a_file_name_in_its_folder(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        prism(["keys", name, "--dir", str(tmp_path)])
    assert exit_.value.code == 2 and "is not a key name" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_prism_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        prism(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("prism 0.")


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
    auth = start_authenticator(ctx, server, keys={server.domain: AuthorizedKeys(keys / "authorized")})
    receiver = VectorReceiver(ctx, endpoint, RejectCounter("brain", LOG), curve=server)
    public, _ = generate_keypair(keys, "late")
    late = VectorSender(ctx, endpoint, curve=ClientCurve(keys / "late.key_secret", keys / "brain.key"), retry_s=0.2)
    got: list[NodeVector] = []

    def run(seconds: float, until_received: bool = False) -> None:
        """Send and receive for `seconds`, or with `until_received` only until a vector has come through."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until_received and got):
            late.send(vector("late"))
            receiver.socket.poll(50)
            got.extend(receiver.drain())

    run(1.0)
    assert not got and late.refused >= 1  # refused, and counted
    (keys / "authorized" / "late.key").write_bytes(public.read_bytes())
    run(4.0, until_received=True)
    assert {v.node_id for v in got} == {"late"}  # started over with a new socket once its key was filed
    late.close()
    receiver.close()
    auth.stop()


def test_tables_reach_only_authorised_routers(ctx: zmq.Context, keys: Path) -> None:
    server = ServerCurve(keys / "brain.key_secret", keys / "authorized")
    refusals = CurveRefusals()
    auth = start_authenticator(ctx, server, refusals=refusals)
    got = subscribed_tables(ctx, keys, server, ("good", "evil"), refusals)
    auth.stop()
    assert [t.order for t in got["good"]] == [(1, 1)]
    assert got["evil"] == []
    assert refusals.counts()[server.domain] >= 2  # the evil key's SUB and DEALER


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


def test_prism_keys_says_where_a_roles_key_belongs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prism(["keys", "r1", "--dir", str(tmp_path), "--role", "router"]) == 0
    assert "--curve-routers" in capsys.readouterr().out
    assert prism(["keys", "node-a", "--dir", str(tmp_path), "--role", "agent"]) == 0
    out = capsys.readouterr().out
    assert "--curve-clients" in out and "node-a.endpoints" in out


def test_a_router_key_cannot_push_vectors(
    ctx: zmq.Context, keys: Path, endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    agents, routers = roles(keys)
    registry = CollectorRegistry()
    auth = start_authenticator(ctx, agents, routers, refusals=CurveRefusals(registry))
    receiver = VectorReceiver(ctx, endpoint, RejectCounter("brain", LOG), curve=agents)
    router = VectorSender(ctx, endpoint, curve=ClientCurve(keys / "router.key_secret", keys / "brain.key"), retry_s=0.1)
    good = VectorSender(ctx, endpoint, curve=ClientCurve(keys / "good.key_secret", keys / "brain.key"))
    got: list[NodeVector] = []
    with caplog.at_level(logging.WARNING, logger="prism.curve"):
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            router.send(vector("router"))
            good.send(vector("good"))
            receiver.socket.poll(50)
            got.extend(receiver.drain())
    for closable in (receiver, router, good):
        closable.close()
    auth.stop()
    assert {v.node_id for v in got} == {"good"}
    assert router.refused >= 2  # refused at the handshake, again on every retry ...
    assert (refused(registry, AGENTS_DOMAIN) or 0) >= router.refused  # ... each counted in the agents' domain
    assert refused(registry, ROUTERS_DOMAIN) == 0
    logged = [r.getMessage() for r in caplog.records if "handshake refused" in r.getMessage()]
    assert len(logged) == 1, logged  # logged once for the run of refusals, not per attempt
    assert AGENTS_DOMAIN in logged[0] and f"router.key in {keys / 'routers'}" in logged[0]


def test_an_agent_key_cannot_subscribe_to_tables(ctx: zmq.Context, keys: Path) -> None:
    agents, routers = roles(keys)
    registry = CollectorRegistry()
    refusals = CurveRefusals(registry)
    auth = start_authenticator(ctx, agents, routers, refusals=refusals)
    got = subscribed_tables(ctx, keys, routers, ("good", "router"), refusals, heartbeat=True)
    auth.stop()
    assert [t.order for t in got["router"]] == [(1, 1)]
    assert got["good"] == []  # the agent's key is refused on the table and snapshot sockets
    assert (refused(registry, ROUTERS_DOMAIN) or 0) >= 2  # its SUB and its DEALER
    assert refused(registry, AGENTS_DOMAIN) == 0


def test_refusals_are_logged_once_per_run_of_a_key(caplog: pytest.LogCaptureFixture) -> None:
    refusals = CurveRefusals()
    with caplog.at_level(logging.WARNING, logger="prism.curve"):
        for _ in range(3):
            refusals.refused(AGENTS_DOMAIN, "k1", "is filed nowhere")
        refusals.refused(ROUTERS_DOMAIN, "k1", "is filed nowhere")  # another domain: another run
        refusals.admitted(AGENTS_DOMAIN, "k1")
        refusals.refused(AGENTS_DOMAIN, "k1", "is filed nowhere")  # a new run after an admission
    assert len([r for r in caplog.records if "handshake refused" in r.getMessage()]) == 3
    assert refusals.counts() == {AGENTS_DOMAIN: 4, ROUTERS_DOMAIN: 1}


def test_each_role_needs_its_own_domain(ctx: zmq.Context, keys: Path) -> None:
    agents, routers = roles(keys)
    with pytest.raises(ConfigError):
        start_authenticator(ctx, agents, ServerCurve(routers.secret_file, routers.authorized_dir, AGENTS_DOMAIN))
    with pytest.raises(ConfigError):
        start_authenticator(ctx)
