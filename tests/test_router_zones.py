"""The brain's zone split in the router (`Settings.zone`, `RoutingTable.zones`)."""

from __future__ import annotations

import time
from collections import Counter

from prismlb.router import Request, Router, Settings
from prismlb.wire import (
    Experiment,
    ExperimentArm,
    RoutingTable,
    SliceTable,
    SliceUpdate,
    TableHead,
    TableNode,
    ZoneRoute,
    ZoneShare,
    decode,
    encode,
)
from prismlb.wire._tables import TableAssembler, TableEncoder

from .conftest import Clock

NODES = [("a1", "a"), ("a2", "a"), ("b1", "b"), ("b2", "b"), ("c1", "c")]


def split(caller: str, **shares: float) -> ZoneRoute:
    return ZoneRoute(caller=caller, shares=[ZoneShare(zone=z, fraction=f) for z, f in shares.items()])


def table(*rows: ZoneRoute, version: int = 1, nodes: list[tuple[str, str]] = NODES) -> RoutingTable:
    entries = [TableNode(node_id=n, endpoint=f"http://{n}:8000", weight=1.0, zone=z) for n, z in nodes]
    return RoutingTable(
        epoch=1,
        version=version,
        issued_unix_s=time.time(),
        slices=[SliceTable(name="llm", nodes=entries)],
        zones=list(rows),
    )


def zone_of(node_id: str) -> str:
    return dict(NODES)[node_id]


def placed_zones(r: Router, keys: range) -> Counter[str]:
    return Counter(zone_of(r.route(Request(key=f"k{k}", slice="llm")).node_id) for k in keys)


def test_a_routers_keys_follow_its_zones_row() -> None:
    t = table(split("a", a=1.0), split("b", a=0.25, b=0.75))
    in_a = Router.from_table(t, settings=Settings(zone="a"), clock=Clock())
    in_b = Router.from_table(t, settings=Settings(zone="b"), clock=Clock())
    assert placed_zones(in_a, range(400)) == Counter({"a": 400})
    b = placed_zones(in_b, range(2000))
    assert set(b) == {"a", "b"} and 0.2 < b["a"] / 2000 < 0.3
    # bare keys take the same path as Requests: the split is not bypassed by the C fast path
    assert {zone_of(in_a.route(f"k{k}", "llm").node_id) for k in range(200)} == {"a"}


def test_without_a_zone_or_a_row_every_entry_takes_requests() -> None:
    t = table(split("a", a=1.0))
    for settings in (Settings(), Settings(zone="elsewhere")):
        r = Router.from_table(t, settings=settings, clock=Clock())
        assert set(placed_zones(r, range(600))) == {"a", "b", "c"}


def test_a_key_keeps_its_zone_while_the_split_holds_and_moves_only_near_the_boundary() -> None:
    r = Router.from_table(table(split("b", a=0.2, b=0.8)), settings=Settings(zone="b"), clock=Clock())
    before = {k: zone_of(r.route(Request(key=f"k{k}", slice="llm")).node_id) for k in range(1000)}
    assert before == {k: zone_of(r.route(Request(key=f"k{k}", slice="llm")).node_id) for k in range(1000)}
    assert r.apply(table(split("b", a=0.3, b=0.7), version=2))
    after = {k: zone_of(r.route(Request(key=f"k{k}", slice="llm")).node_id) for k in range(1000)}
    moved = [k for k in before if before[k] != after[k]]
    assert all(before[k] == "b" and after[k] == "a" for k in moved)  # only b -> a, as the split moved
    assert 0.05 < len(moved) / 1000 < 0.15


def test_a_zone_whose_entries_are_all_down_sends_its_share_to_the_rest() -> None:
    clock = Clock()
    r = Router.from_table(table(split("a", a=1.0)), settings=Settings(zone="a"), clock=clock)
    for node in ("a1", "a2"):
        lease = r.request(Request(key=node, slice="llm"), exclude={n for n, _ in NODES if n != node})
        assert lease.endpoint.node_id == node
        lease.begin()
        lease.end(ConnectionRefusedError())
    healthy = {e.node_id for e in (r.route(Request(key=f"k{k}", slice="llm")) for k in range(200))}
    assert healthy and not healthy & {"a1", "a2"}


def test_an_experiment_on_the_slice_decides_before_the_split() -> None:
    nodes = [
        TableNode(node_id=n, endpoint=f"http://{n}:8000", weight=1.0, zone=z, model_version="v2" if n == "b1" else "v1")
        for n, z in NODES
    ]
    t = RoutingTable(
        epoch=1,
        version=1,
        issued_unix_s=time.time(),
        slices=[SliceTable(name="llm", nodes=nodes)],
        experiments=[Experiment(name="x", slice="llm", arms=[ExperimentArm(model_version="v2", fraction=1.0)])],
        zones=[split("a", a=1.0)],
    )
    r = Router.from_table(t, settings=Settings(zone="a"), clock=Clock())
    assert {r.route(Request(key=f"k{k}", slice="llm")).node_id for k in range(50)} == {"b1"}


def test_the_split_travels_in_the_table_head_of_per_slice_updates() -> None:
    t = table(split("a", a=0.5, b=0.5), split("b", b=1.0))
    assert decode(encode(t), (RoutingTable,), 1 << 24).zones == t.zones
    assembler = TableAssembler()
    rebuilt = None
    for frames in TableEncoder().update(t):
        msg = decode(frames, (SliceUpdate, TableHead), 1 << 24)
        rebuilt = assembler.slice_update(msg) if isinstance(msg, SliceUpdate) else assembler.head(msg)
    assert rebuilt == t
