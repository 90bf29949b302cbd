"""The weighted consistent-hash ring: minimal disruption, determinism, probe order, weight and NUMA shares."""

from __future__ import annotations

import hashlib
import random
import zlib
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prismlb.router import Ring, _ring, position
from prismlb.router._ring import bucket_index
from prismlb.semantics import CROSS_NUMA, SAME_NUMA
from prismlb.wire import TableNode

KEYS = [f"session-{i}" for i in range(2000)]
NODE_IDS = st.from_regex(r"[a-z][a-z0-9-]{0,11}", fullmatch=True)
WEIGHTS = st.sampled_from([0.1, 0.25, 0.3, 0.5, 0.7, 0.9, 1.0])


def node(node_id: str, weight: float = 1.0) -> TableNode:
    return TableNode(node_id=node_id, endpoint=f"{node_id}.example:8000", weight=weight)


def owners(ring: Ring, keys: list[str] = KEYS) -> list[str]:
    return [ring.lookup(key).node_id for key in keys]


def spec_point(name: str) -> int:
    """A ring point as specified: the first 32 bits of blake2b of `node#i`."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big")


@st.composite
def node_sets(draw: st.DrawFn, min_size: int, max_size: int) -> list[TableNode]:
    ids = draw(st.lists(NODE_IDS, min_size=min_size, max_size=max_size, unique=True))
    return [node(i, draw(WEIGHTS)) for i in ids]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(nodes=node_sets(2, 12), data=st.data())
def test_removing_a_node_moves_exactly_its_keys(nodes: list[TableNode], data: st.DataObject) -> None:
    gone = data.draw(st.sampled_from(nodes)).node_id
    before = owners(Ring.build(nodes))
    after = owners(Ring.build([n for n in nodes if n.node_id != gone]))
    assert gone in before
    for old, new in zip(before, after, strict=True):
        assert new == old if old != gone else new != gone


@settings(max_examples=40, deadline=None, derandomize=True)
@given(ids=st.lists(NODE_IDS, min_size=2, max_size=13, unique=True))
def test_adding_a_node_moves_its_fair_share_only_onto_it(ids: list[str]) -> None:
    nodes = [node(i) for i in ids]
    new = nodes.pop()
    before = owners(Ring.build(nodes))
    after = owners(Ring.build([*nodes, new]))
    moved = [(old, now) for old, now in zip(before, after, strict=True) if old != now]
    assert all(now == new.node_id for _, now in moved)
    fair = len(KEYS) / (len(nodes) + 1)
    assert 0.5 * fair <= len(moved) <= 1.8 * fair


@settings(max_examples=40, deadline=None, derandomize=True)
@given(nodes=node_sets(2, 10), data=st.data())
def test_reweighting_a_node_moves_keys_only_to_or_from_it(nodes: list[TableNode], data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(nodes) - 1))
    target = nodes[index]
    weight = data.draw(WEIGHTS.filter(lambda w: w != target.weight))
    changed = [*nodes[:index], node(target.node_id, weight), *nodes[index + 1 :]]
    before = owners(Ring.build(nodes))
    after = owners(Ring.build(changed))
    assert all(old == new or target.node_id in (old, new) for old, new in zip(before, after, strict=True))
    moved = sum(old != new for old, new in zip(before, after, strict=True))
    assert moved > 0
    if weight > target.weight:
        assert all(new == target.node_id for old, new in zip(before, after, strict=True) if old != new)
    else:
        assert all(old == target.node_id for old, new in zip(before, after, strict=True) if old != new)


@settings(max_examples=30, deadline=None)
@given(nodes=node_sets(1, 10), order=st.randoms(use_true_random=False))
def test_input_order_does_not_matter(nodes: list[TableNode], order: random.Random) -> None:
    shuffled = list(nodes)
    order.shuffle(shuffled)
    assert owners(Ring.build(nodes)) == owners(Ring.build(shuffled))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(nodes=node_sets(2, 6))
def test_key_share_follows_weight(nodes: list[TableNode]) -> None:
    keys = [f"user-{i}" for i in range(20_000)]
    counts = Counter(owners(Ring.build(nodes, base_points=1024), keys))
    total_weight = sum(n.weight for n in nodes)
    for n in nodes:
        expected = len(keys) * n.weight / total_weight
        assert abs(counts[n.node_id] / expected - 1) < 0.35, (n, counts, expected)


def test_lookup_matches_a_linear_scan_of_the_specified_points() -> None:
    nodes = [node("gpu-0", 0.05), node("gpu-1", 0.1), node("gpu-2", 0.02)]
    ring = Ring.build(nodes, base_points=100)
    points = sorted(
        (spec_point(f"{n.node_id}#{i}"), n.node_id) for n in nodes for i in range(max(1, round(100 * n.weight)))
    )
    assert len(points) == 5 + 10 + 2
    assert points[0][1] != points[-1][1]  # so a lookup that fails to wrap would be caught
    wrapped = 0
    for key in KEYS:
        h = zlib.crc32(key.encode())
        expected = next((owner for point, owner in points if point >= h), points[0][1])
        wrapped += h > points[-1][0]
        assert ring.lookup(key).node_id == expected
        assert ring.lookup(key.encode()).node_id == expected
    assert wrapped > 0


def test_an_entry_keeps_one_array_of_points_however_its_weight_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights change with every table and entries with the fleet: the points kept stay one array per entry, at
    most `_POINTS_KEPT` points, and a ring built after its entry's points were grown, cut or dropped is the same."""
    monkeypatch.setattr(_ring, "_POINTS", type(_ring._POINTS)())
    monkeypatch.setattr(_ring, "_points_held", 0)
    monkeypatch.setattr(_ring, "_POINTS_KEPT", 4 * 128)
    monkeypatch.setattr(_ring, "_LAYOUTS", type(_ring._LAYOUTS)())  # built anew, not taken from earlier tests
    first = owners(Ring.build([node("a", 0.5), node("b", 0.25)]))
    for step in range(1, 21):
        Ring.build([node("a", step / 20), node("b", 1 - step / 40)])
    assert set(_ring._POINTS) == {"a", "b"}
    assert len(_ring._POINTS["a"]) == 128 and _ring._POINTS["a"].itemsize == 4
    assert list(_ring._POINTS["a"]) == [spec_point(f"a#{i}") for i in range(128)]
    _ring._LAYOUTS.clear()
    assert owners(Ring.build([node("a", 0.5), node("b", 0.25)])) == first  # a prefix of the grown array
    for name in "cdef":
        Ring.build([node(name)])
    assert list(_ring._POINTS) == ["c", "d", "e", "f"] and _ring._points_held == 4 * 128  # least recently used out
    _ring._LAYOUTS.clear()
    assert owners(Ring.build([node("a", 0.5), node("b", 0.25)])) == first  # dropped, then computed again


def test_int_keys_are_fibonacci_hashed_so_small_ints_spread() -> None:
    assert position(1) == (0x9E3779B97F4A7C15 & (2**64 - 1)) >> 32
    assert position(2**64 + 5) == position(5)
    ring = Ring.build([node(f"n{i}") for i in range(8)])
    counts = Counter(ring.lookup(i).node_id for i in range(8000))
    assert len(counts) == 8 and max(counts.values()) < 2.5 * min(counts.values())


@settings(max_examples=40, deadline=None, derandomize=True)
@given(nodes=node_sets(1, 12), positions=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50))
def test_probe_order_is_every_entry_once_from_the_owner_and_deterministic(
    nodes: list[TableNode], positions: list[int]
) -> None:
    ring = Ring.build(nodes)
    again = Ring.build(list(reversed(nodes)))
    for pos in positions:
        order = list(ring.probe(ring.index(pos)))
        assert sorted(order) == list(range(len(nodes)))
        assert ring.entries[order[0]] == ring.entries[ring.owners[ring.index(pos)]]
        assert [ring.labels[i] for i in order] == [again.labels[i] for i in again.probe(again.index(pos))]
        # Each entry appears where the ring walk first meets one of its points.
        walk = [ring.owners[(ring.index(pos) + step) % len(ring.points)] for step in range(len(ring.points))]
        assert order == list(dict.fromkeys(walk))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(nodes=node_sets(1, 12), data=st.data())
def test_bucket_index_agrees_with_bisecting_the_ring(nodes: list[TableNode], data: st.DataObject) -> None:
    ring = Ring.build(nodes, base_points=data.draw(st.sampled_from([1, 8, 128])))
    shift, slots = bucket_index(ring.points, ring.owners)
    assert len(slots) == 1 << (32 - shift) and len(slots) >= 8 * len(ring.points)
    near_points = [(p + d) % 2**32 for p in ring.points[:40] for d in (-1, 0, 1)]
    for pos in [*near_points, 0, 2**32 - 1, *data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=50))]:
        expected = ring.owners[ring.index(pos)]
        slot = slots[pos >> shift]
        assert slot is None or slot == expected


def test_gpu_entries_are_their_own_ring_members_weighted_by_numa() -> None:
    gpus = [TableNode(node_id="h", endpoint="h:8000", weight=1.0, gpu=g, numa_node=g // 2) for g in range(4)]
    ring = Ring.build(gpus, base_points=1024, numa_node=0)
    assert ring.labels == ("h/gpu0", "h/gpu1", "h/gpu2", "h/gpu3")
    assert ring.weights == (SAME_NUMA, SAME_NUMA, CROSS_NUMA, CROSS_NUMA) == (1.0, 1.0, 0.4, 0.4)
    counts = Counter(ring.lookup(f"expert-{i}").gpu for i in range(40_000))
    same, cross = counts[0] + counts[1], counts[2] + counts[3]
    assert 2.2 < same / cross < 2.9  # 1.0 : 0.4 by weight
    assert Ring.build(gpus).weights == (1.0,) * 4  # no caller NUMA node: every GPU weighs the same
    with pytest.raises(ValueError, match="'h/gpu1' appears more than once"):
        Ring.build([*gpus, gpus[1]])


def test_every_node_gets_at_least_one_point() -> None:
    ring = Ring.build([node("heavy"), node("light", 0.001)], base_points=128)
    assert "light" in owners(ring, [f"k{i}" for i in range(20_000)])


def test_invalid_node_lists_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least one node"):
        Ring.build([])
    with pytest.raises(ValueError, match="'a' appears more than once"):
        Ring.build([node("a"), node("b"), node("a", 0.5)])
    with pytest.raises(ValueError, match="outside"):
        Ring.build([node("a", 1.5)])
    with pytest.raises(ValueError, match="base_points"):
        Ring.build([node("a")], base_points=0)
