"""route()'s C fast path (`_fastroute`) chooses exactly what the pure-Python path does: `Group.pick`, the one
Python definition of bounded load around the ring's pick."""

from __future__ import annotations

import dataclasses
import gc
import random
import shutil
import sys
import sysconfig
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import msgspec
import pytest

from prismlb.router import Endpoint, Request, Router, Settings, position
from prismlb.router._keys import GOLDEN
from prismlb.router._snapshot import Group
from prismlb.wire import RoutingTable, SliceTable, TableNode

try:
    from prismlb.router import _fastroute as fastroute
except ImportError:  # test_the_extension_is_built_here tells whether that is expected
    fastroute = None  # type: ignore[assignment]
needs_c = pytest.mark.skipif(fastroute is None, reason="the C extension prismlb.router._fastroute is not built")
NOW = 1000.0
INVERSE_GOLDEN: int = pow(GOLDEN, -1, 2**64)


def test_the_extension_is_built_here() -> None:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if fastroute is None and shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here: the extension is optional, route() runs pure Python")
    assert fastroute is not None, "a C compiler exists but prismlb.router._fastroute did not build or import"
    router = Router.from_table(table(nodes(5, random.Random(0))))
    assert router._snapshot is not None
    assert all(r.group.fast is not None for r in router._snapshot.plain.values())


def nodes(count: int, rng: random.Random, loads: bool = False, prefix: str = "n") -> list[TableNode]:
    return [
        TableNode(
            node_id=f"{prefix}{i}",
            endpoint=f"{prefix}{i}:8000",
            weight=rng.choice([0.05, 0.25, 0.5, 0.75, 1.0]),
            load=rng.choice([None, 0.0, 1.5, 4.0, 10.0]) if loads else None,
        )
        for i in range(count)
    ]


def table(*slices: Sequence[TableNode] | SliceTable, version: int = 1) -> RoutingTable:
    listed = [s if isinstance(s, SliceTable) else SliceTable(name="llm", nodes=list(s)) for s in slices]
    return RoutingTable(epoch=1, version=version, issued_unix_s=time.time(), slices=listed)


def keys(rng: random.Random, count: int) -> list[str | bytes | int]:
    """Random str (ASCII and not, short and long), bytes and int (negative, past 64 bits) keys."""
    out: list[str | bytes | int] = []
    for _ in range(count):
        size = rng.randrange(0, 40)
        match rng.randrange(6):
            case 0:
                out.append(f"conversation-{rng.randrange(10**6)}")
            case 1:
                out.append(
                    "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(128, 0x2FFF)])) for _ in range(size))
                )
            case 2:
                out.append(rng.randbytes(size))
            case 3:
                out.append(rng.getrandbits(64))
            case 4:
                out.append(rng.randrange(-(2**70), 2**70))
            case _:
                out.append(rng.randrange(-1000, 1000))
    return out


@contextmanager
def python_only(router: Router) -> Iterator[None]:
    """The router's current table with the C path off: same rings, entries, states and counters."""
    snapshot = router._snapshot
    assert snapshot is not None
    plain = {
        name: dataclasses.replace(route, group=dataclasses.replace(route.group, fast=None))
        for name, route in snapshot.plain.items()
    }
    router._snapshot = dataclasses.replace(snapshot, plain=plain)
    try:
        yield
    finally:
        router._snapshot = snapshot


def group(router: Router, slice_name: str | None = None) -> Group:
    assert router._snapshot is not None
    return router._snapshot.plain[slice_name].group


def load(router: Router, rng: random.Random, most: int, slice_name: str | None = None) -> None:
    """Random requests in flight on each entry of a slice, and their sum in the group's counter."""
    g = group(router, slice_name)
    for state, *_ in g.entries:
        state.load = rng.randrange(most + 1)
    g.inflight.value = sum(state.load for state, *_ in g.entries)


def picked(g: Group, key: object) -> Endpoint | None:
    """`Group.pick` for a bare key with nothing excluded, as the C table decides it; None for another type."""
    if key.__class__ not in (str, bytes, int):
        return None
    index = g.pick(position(key), (), NOW)  # type: ignore[arg-type]
    return None if index is None else g.entries[index][4]


def assert_same(router: Router, inputs: Sequence[object], slice_name: str | None = None) -> int:
    """Both paths choose alike for every input, and whatever the C table decides is `Group.pick`'s choice;
    returns how many the C path decided itself."""
    g = group(router, slice_name)
    assert g.fast is not None
    chosen = [router.route(k, slice_name) for k in inputs]  # type: ignore[arg-type]
    decided = [g.fast(k) for k in inputs]
    with python_only(router):
        expected = [router.route(k, slice_name) for k in inputs]  # type: ignore[arg-type]
    assert chosen == expected
    assert all(d is None or d == e for d, e in zip(decided, expected, strict=True))
    assert all(d is None or d == picked(g, k) for d, k in zip(decided, inputs, strict=True))
    return sum(d is not None for d in decided)


@needs_c
def test_positions_match_crc32_and_fibonacci_hashing() -> None:
    rng = random.Random(1)
    inputs = keys(rng, 5000) + [b"", "", "\u00e9" * 100, rng.randbytes(1000), 2**64, -(2**64), 2**64 - 1]
    for key in inputs:
        assert fastroute.position(key) == position(key), key
    assert fastroute.position(12345) == ((12345 * GOLDEN) % 2**64) >> 32
    for other in (True, 1.5, None, bytearray(b"x"), Request(key="x")):
        assert fastroute.position(other) is None


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_idle_tables_route_alike_and_in_c(seed: int) -> None:
    rng = random.Random(seed)
    router = Router.from_table(table(nodes(rng.randrange(1, 60), rng)), clock=lambda: NOW)
    inputs = keys(rng, 3000)
    assert assert_same(router, inputs) == len(inputs)


@needs_c
@pytest.mark.parametrize("seed", range(6))
def test_busy_tables_route_alike_and_walk_the_probe_order_in_c(seed: int) -> None:
    rng = random.Random(seed)
    router = Router.from_table(table(nodes(rng.randrange(2, 60), rng, loads=True)), clock=lambda: NOW)
    g = group(router)
    walked = 0
    for _ in range(5):
        load(router, rng, rng.choice([2, 10, 40]))
        inputs = keys(rng, 1000)
        assert assert_same(router, inputs) == len(inputs)
        walked += sum(not g.fits(g.ring.owner(position(k))) for k in inputs)
    assert walked > 0


def key_at(pos: int) -> int:
    """An int key whose ring position is `pos` (Fibonacci hashing inverted)."""
    return (pos << 32) * INVERSE_GOLDEN % 2**64


@needs_c
def test_keys_on_and_beside_ring_points_route_alike() -> None:
    rng = random.Random(5)
    router = Router.from_table(table(nodes(30, rng, loads=True)), clock=lambda: NOW)
    load(router, rng, 10)
    points = group(router).ring.points
    assert all(position(key_at(p)) == p for p in points)
    inputs = [key_at(p + d) for p in points for d in (-1, 0, 1) if 0 <= p + d < 2**32] + [key_at(0), key_at(2**32 - 1)]
    assert assert_same(router, inputs) == len(inputs)


@needs_c
@pytest.mark.parametrize(("count", "balance"), [(4, 1.25), (2, 2.0)])
@pytest.mark.parametrize("value", [0, 3, 15, 31])
def test_loads_at_the_limit_and_ties_route_alike(count: int, balance: float, value: int) -> None:
    """Equal weights and no load estimates: in-flight counts meet `safe` and the limit exactly, and loads tie."""
    layout = [TableNode(node_id=f"n{i}", endpoint=f"n{i}:8000", weight=1.0) for i in range(count)]
    router = Router.from_table(table(layout), settings=Settings(balance=balance), clock=lambda: NOW)
    rng = random.Random(value)
    g = group(router)
    for _ in range(50):
        most = rng.choice([2, 10])
        for state, *_ in g.entries:
            state.load = rng.randrange(most)
        g.inflight.value = value  # states are shared by label across slices: the counter need not be their sum
        inputs = keys(rng, 100)
        assert assert_same(router, inputs) == len(inputs)


@needs_c
def test_with_balance_zero_the_walk_takes_the_first_available_entry() -> None:
    """`Group.bounded` with balance 0, which a router never reaches in C (its `safe` counts are then infinite)."""
    router = Router.from_table(table(nodes(20, random.Random(6))), clock=lambda: NOW)
    load(router, random.Random(6), 30)
    g = group(router)
    entries = tuple((state, -1.0, base, share, endpoint) for state, _, base, share, endpoint in g.entries)
    fast = fastroute.Table(g.ring.points, g.ring.owners, g.ring.slots, g.ring.shift, entries, 0.0, g.inflight, 0.0)
    unbounded = dataclasses.replace(g, entries=entries, base_total=0.0, balance=0.0, fast=fast.route)
    for key in keys(random.Random(6), 1000):
        assert fast.route(key) == g.entries[g.ring.owner(position(key))][4] == picked(unbounded, key)


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_gated_entries_are_left_to_python_and_route_alike(seed: int) -> None:
    rng = random.Random(seed)
    layout = [*nodes(rng.randrange(2, 30), rng, loads=True), *nodes(3, rng, prefix="spare")]
    spare = SliceTable(name="spare", nodes=layout[-3:])
    llm = SliceTable(name="llm", nodes=layout[:-3], fallback="spare")
    router = Router.from_table(table(llm, spare), clock=lambda: NOW)
    g = group(router, "llm")
    for _ in range(6):
        load(router, rng, rng.choice([0, 5, 20]), "llm")
        for state, *_ in g.entries:
            state.gated = rng.random() < 0.3
            state.down_until = NOW + 5 if rng.random() < 0.5 else 0.0  # gated but admitted, or down
        assert_same(router, keys(rng, 1000), "llm")
    for state, *_ in g.entries:  # every entry down: the fallback slice takes the requests
        state.gated, state.down_until = True, NOW + 5
    inputs = keys(rng, 300)
    assert assert_same(router, inputs, "llm") == 0
    assert {router.route(k, "llm").node_id for k in inputs} <= {n.node_id for n in spare.nodes}


@needs_c
def test_balance_zero_routes_alike() -> None:
    rng = random.Random(7)
    router = Router.from_table(table(nodes(40, rng, loads=True)), settings=Settings(balance=0), clock=lambda: NOW)
    load(router, rng, 50)
    inputs = keys(rng, 3000)
    assert assert_same(router, inputs) == len(inputs)
    g = group(router)
    g.entries[0][0].gated = True
    assert_same(router, inputs)


@needs_c
def test_table_swaps_route_alike() -> None:
    rng = random.Random(8)
    layout = nodes(50, rng, loads=True)
    router = Router.from_table(table(layout), clock=lambda: NOW)
    for version in range(2, 12):
        i = rng.randrange(len(layout))
        if rng.random() < 0.3 and len(layout) > 2:
            del layout[i]
        else:
            layout[i] = msgspec.structs.replace(layout[i], weight=rng.choice([0.05, 0.5, 1.0]), load=rng.random() * 10)
        assert router.apply(table(layout, version=version))
        load(router, rng, rng.choice([0, 8, 30]))
        inputs = keys(rng, 500)
        assert assert_same(router, inputs) == len(inputs)


@needs_c
def test_other_inputs_take_the_python_path() -> None:
    class Text(str):
        pass

    router = Router.from_table(table(nodes(10, random.Random(9))), clock=lambda: NOW)
    inputs = [True, Text("x"), Request(key="x"), Request(key=5, modality="text")]
    assert assert_same(router, inputs) == 0
    with pytest.raises(UnicodeEncodeError):
        router.route("\ud800")


@needs_c
@pytest.mark.parametrize(("attribute", "value"), [("load", 2**53 + 1), ("load", True), ("gated", 0)])
def test_unusual_state_values_are_left_to_python(attribute: str, value: object) -> None:
    router = Router.from_table(table(nodes(10, random.Random(13))), clock=lambda: NOW)
    for state, *_ in group(router).entries:
        setattr(state, attribute, value)
    assert assert_same(router, keys(random.Random(13), 500)) == 0


@needs_c
def test_route_keeps_reference_counts() -> None:
    router = Router.from_table(table(nodes(10, random.Random(10), loads=True)), clock=lambda: NOW)
    load(router, random.Random(10), 30)
    endpoints: list[Endpoint] = [entry[4] for entry in group(router).entries]
    before = [sys.getrefcount(e) for e in endpoints]
    for key in keys(random.Random(11), 5000):
        router.route(key)
    assert [sys.getrefcount(e) for e in endpoints] == before


@needs_c
def test_tables_refuse_inconsistent_rings() -> None:
    router = Router.from_table(table(nodes(3, random.Random(12))), clock=lambda: NOW)
    g = group(router)
    ring, entries, counter = g.ring, g.entries, g.inflight
    fastroute.Table(ring.points, ring.owners, ring.slots, ring.shift, entries, 0.0, counter, 1.25)
    with pytest.raises(ValueError):  # an owner past the last entry
        fastroute.Table(ring.points, [*ring.owners[:-1], 3], ring.slots, ring.shift, entries, 0.0, counter, 1.25)
    with pytest.raises(ValueError):  # a bucket short
        fastroute.Table(ring.points, ring.owners, ring.slots[:-1], ring.shift, entries, 0.0, counter, 1.25)
    with pytest.raises(ValueError):  # points out of order
        fastroute.Table(ring.points[::-1], ring.owners, ring.slots, ring.shift, entries, 0.0, counter, 1.25)
    mixed = (*entries[:2], (object(), *entries[2][1:]))
    with pytest.raises(TypeError):  # states of two types
        fastroute.Table(ring.points, ring.owners, ring.slots, ring.shift, mixed, 0.0, counter, 1.25)  # type: ignore[arg-type]


@needs_c
def test_a_router_nothing_refers_to_is_collected_with_its_tables() -> None:
    """A table's entries refer back to their router (each state's peer-load callback), so the C table must show the
    collector what it holds: hidden, it kept every discarded router alive, a few MB each in a replay's process."""
    router = Router.from_table(table(nodes(5, random.Random(0))))
    assert router.route("k") is not None
    assert router._snapshot is not None and all(r.group.fast is not None for r in router._snapshot.plain.values())
    gone = weakref.ref(router)
    router.close()
    del router
    gc.collect()
    assert gone() is None
