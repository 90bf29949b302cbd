"""Bounded-load consistent hashing: no endpoint exceeds its bound, overflow follows the key's probe order."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prismlb.router import Lease, Request, Ring, Router, Settings, position
from prismlb.wire import RoutingTable, SliceTable, TableNode

WEIGHTS = st.sampled_from([0.05, 0.25, 0.5, 0.75, 1.0])

REQUESTS_1_25 = Settings(load="requests", balance=1.25)
"""Bounded load over requests in flight and the brain's estimates, with c = 1.25 (Mirrokni et al.'s bounds)."""


def table(nodes: list[TableNode]) -> RoutingTable:
    return RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=nodes)])


@st.composite
def clusters(draw: st.DrawFn, loads: bool) -> list[TableNode]:
    count = draw(st.integers(2, 8))
    return [
        TableNode(
            node_id=f"n{i}",
            endpoint=f"n{i}:8000",
            weight=draw(WEIGHTS),
            load=draw(st.sampled_from([None, 0.0, 1.5, 4.0, 10.0])) if loads else None,
        )
        for i in range(count)
    ]


# Each step starts a request for a key (an int) or, for None, ends the oldest request still in flight.
STEPS = st.lists(st.one_of(st.integers(0, 40), st.none()), min_size=1, max_size=120)


def run(router: Router, steps: list[int | None]) -> list[str]:
    held: list[Lease] = []
    chosen = []
    for step in steps:
        if step is None:
            if held:
                held.pop(0).end()
            continue
        lease = router.request(f"key-{step}")
        lease.begin()
        held.append(lease)
        chosen.append(lease.node_id)
    return chosen


@settings(max_examples=60, deadline=None, derandomize=True)
@given(nodes=clusters(loads=False), keys=st.lists(st.integers(0, 40), min_size=1, max_size=120))
def test_with_balance_1_25_no_endpoint_exceeds_its_bound(nodes: list[TableNode], keys: list[int]) -> None:
    router = Router.from_table(table(nodes), settings=REQUESTS_1_25)
    weight = {n.node_id: n.weight for n in nodes}
    total_weight = sum(weight.values())
    load = dict.fromkeys(weight, 0)
    for in_flight, key in enumerate(keys, start=1):
        lease = router.request(f"key-{key}")
        lease.begin()
        load[lease.node_id] += 1
        # Mirrokni et al.: with c = 1.25, every endpoint holds at most ceil(c × its weighted share of the load).
        for node_id, held in load.items():
            assert held <= math.ceil(1.25 * in_flight * weight[node_id] / total_weight), (node_id, load)
        assert router.status()[lease.label].inflight == load[lease.node_id]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(nodes=clusters(loads=True), steps=STEPS)
def test_the_chosen_endpoint_was_under_its_bound_with_the_brains_load_estimates(
    nodes: list[TableNode], steps: list[int | None]
) -> None:
    router = Router.from_table(table(nodes), settings=REQUESTS_1_25)
    weight = {n.node_id: n.weight for n in nodes}
    base = {n.node_id: n.load or 0.0 for n in nodes}
    total_weight = sum(weight.values())
    held: list[Lease] = []
    local = dict.fromkeys(weight, 0)
    for step in steps:
        if step is None:
            if held:
                ended = held.pop(0)
                ended.end()
                local[ended.node_id] -= 1
            continue
        total = sum(base.values()) + sum(local.values())
        under = [n for n in weight if (local[n] + base[n]) < 1.25 * (total + 1) * weight[n] / total_weight]
        lease = router.request(f"key-{step}")
        lease.begin()
        held.append(lease)
        if under:  # with fractional estimates every endpoint may be at its bound: then the least loaded one
            assert lease.node_id in under
        else:
            assert (local[lease.node_id] + base[lease.node_id]) / weight[lease.node_id] == min(
                (local[n] + base[n]) / weight[n] for n in weight
            )
        local[lease.node_id] += 1


@settings(max_examples=40, deadline=None, derandomize=True)
@given(nodes=clusters(loads=True), steps=STEPS)
def test_placement_is_deterministic_for_the_same_table_and_load(
    nodes: list[TableNode], steps: list[int | None]
) -> None:
    assert run(Router.from_table(table(nodes)), steps) == run(Router.from_table(table(list(reversed(nodes)))), steps)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(nodes=clusters(loads=False), key=st.integers(0, 1000))
def test_overflow_walks_the_keys_probe_order(nodes: list[TableNode], key: int) -> None:
    router = Router.from_table(table(nodes))
    ring = Ring.build(nodes)
    order = [ring.entries[i].node_id for i in ring.probe(ring.index(position(f"key-{key}")))]
    seen: list[str] = []
    for _ in range(200):
        lease = router.request(f"key-{key}")
        lease.begin()
        if lease.node_id not in seen:
            seen.append(lease.node_id)
    # One key alone: each new endpoint it reaches is the next one in its probe order.
    assert seen == order[: len(seen)]
    owner_share = ring.weights[ring.labels.index(order[0])] / sum(ring.weights)
    assert (len(seen) > 1) == (1.25 * owner_share < 0.99)


NOW = 1000.0


@settings(max_examples=150, deadline=None, derandomize=True)
@given(nodes=clusters(loads=True), data=st.data())
def test_group_pick_takes_the_first_entry_under_its_bound_along_the_probe_order(
    nodes: list[TableNode], data: st.DataObject
) -> None:
    """`Group.pick`, the rule every Python path uses, against the rule as stated: along the key's probe order,
    passing over entries that are down or excluded, the first under its bound; with none under it, the least
    loaded for its weight; with none available, None (the caller then tries fallbacks, then panics)."""
    router = Router.from_table(table(nodes), settings=REQUESTS_1_25, clock=lambda: NOW)
    assert router._snapshot is not None
    group = router._snapshot.plain[None].group
    ring = group.ring
    count = len(ring.entries)
    entry = st.integers(0, count - 1)
    hot = data.draw(st.sets(entry, min_size=1, max_size=count))  # loaded past their bound, most likely
    local = [data.draw(st.integers(10, 40) if i in hot else st.integers(0, 3)) for i in range(count)]
    inflight = data.draw(st.integers(0, sum(local)))  # the group's own: states are shared across slices
    down = data.draw(st.sets(entry, max_size=2))
    flaky = data.draw(st.sets(entry, max_size=2))  # gated, but admitted (the circuit is closed)
    excluded = data.draw(st.sets(entry, max_size=2))
    pos = data.draw(st.integers(0, 2**32 - 1))
    for i, (state, *_) in enumerate(group.entries):
        state.load = local[i]
        state.gated = i in down or i in flaky
        state.down_until = NOW + 5 if i in down else 0.0
    group.inflight.value = inflight
    base = [n.load or 0.0 for n in ring.entries]
    bound = 1.25 * (sum(base) + inflight + 1) / sum(ring.weights)
    available = [i for i in ring.probe(ring.index(pos)) if i not in down and i not in excluded]
    under = [i for i in available if (local[i] + base[i]) / ring.weights[i] < bound]
    chosen = group.pick(pos, {ring.labels[i] for i in excluded}, NOW)
    if not available:
        assert chosen is None
    elif under:
        assert chosen == under[0]
    else:
        assert chosen in available
        assert (local[chosen] + base[chosen]) / ring.weights[chosen] == min(
            (local[i] + base[i]) / ring.weights[i] for i in available
        )


def test_balance_zero_turns_the_bound_off() -> None:
    nodes = [TableNode(node_id=f"n{i}", endpoint=f"n{i}:8000", weight=1.0, load=50.0 * i) for i in range(3)]
    router = Router.from_table(table(nodes), settings=Settings(balance=0))
    owner = router.route("hot-key")
    leases = [router.request("hot-key") for _ in range(50)]
    for lease in leases:
        lease.begin()
    assert {lease.endpoint for lease in leases} == {owner}
    assert router.route("hot-key") == owner


def test_the_brains_load_estimates_steer_new_requests() -> None:
    # n0 owns the key, but the brain says it is far busier than its share: the key goes to the next probe.
    idle = [TableNode(node_id=f"n{i}", endpoint=f"n{i}:8000", weight=1.0) for i in range(3)]
    owner = Router.from_table(table(idle), settings=REQUESTS_1_25).route("key").node_id
    busy = [
        TableNode(node_id=n.node_id, endpoint=n.endpoint, weight=1.0, load=30.0 if n.node_id == owner else 1.0)
        for n in idle
    ]
    assert Router.from_table(table(busy), settings=REQUESTS_1_25).route("key").node_id != owner


def test_prefill_load_counts_prompt_tokens_until_the_first_token() -> None:
    nodes = [TableNode(node_id=f"n{i}", endpoint=f"n{i}:8000", weight=1.0, load=50.0) for i in range(4)]
    router = Router.from_table(table(nodes), settings=Settings(load="prefill"))
    key = 12345
    home = router.route(key)
    big = router.request(Request(key=key, cost=60_000))
    big.begin()
    assert big.node_id == home.node_id
    assert router.route(key).node_id != home.node_id  # 60k tokens queued there: the key spills down its probe order
    states = {label: s for label, s in router._states.items()}  # noqa: SLF001
    assert states[big.label].load == 60_000 and states[big.label].inflight == 1
    big.first_token()  # prefill done: its tokens no longer count, the request is still in flight
    assert states[big.label].load == 0 and states[big.label].inflight == 1
    assert router.route(key).node_id == home.node_id
    big.end()
    assert states[big.label].load == 0 and states[big.label].inflight == 0
    assert all(group.inflight.value == 0 for group in (router._snapshot.slices["llm"].group,))  # type: ignore[union-attr]  # noqa: SLF001


def test_prefill_load_ignores_the_brains_request_counts_and_ends_cleanly_without_a_first_token() -> None:
    nodes = [TableNode(node_id=f"n{i}", endpoint=f"n{i}:8000", weight=1.0, load=1000.0 * i) for i in range(4)]
    by_requests = Router.from_table(table(nodes), settings=Settings(load="requests"))
    by_prefill = Router.from_table(table(nodes), settings=Settings(load="prefill"))
    keys = range(2000)
    busiest = sum(by_requests.route(k).node_id == "n3" for k in keys)
    assert busiest < 100  # counting requests, the brain's 3,000 on n3 keep keys away
    assert sum(by_prefill.route(k).node_id == "n3" for k in keys) > 300  # its share of an idle prefill ring
    lease = by_prefill.request(Request(key=1, cost=500))
    with lease:
        pass  # failed before any token: the cost is released at the end
    assert all(s.load == 0 and s.inflight == 0 for s in by_prefill._states.values())  # noqa: SLF001


def test_request_cost_and_load_mode_are_validated() -> None:
    with pytest.raises(ValueError, match="cost"):
        Request(key=1, cost=0)
    with pytest.raises(ValueError, match="load must be one of"):
        Settings(load="tokens")


def test_prefix_memory_keeps_a_key_where_its_cache_is() -> None:
    nodes = [TableNode(node_id=f"n{i}", endpoint=f"n{i}:8000", weight=1.0) for i in range(4)]
    plain = Router.from_table(table(nodes), settings=Settings(prefix_memory=0))
    remembering = Router.from_table(table(nodes), settings=Settings(load="prefill", balance=1.05, prefix_memory=100))
    key = 777
    for router in (plain, remembering):
        first = router.request(Request(key=key, cost=8_000))
        first.begin()
        first.first_token()
        first.end()
        busy = router.request(Request(key=key, cost=3_000))  # the owner now has 3k tokens queued, the others none
        busy.begin()
        turn = router.request(Request(key=key, cost=10_000))  # the next turn: ~8k of it cached on the owner
        assert (turn.node_id == first.node_id) is (router is remembering)
        busy.end()
    assert len(remembering._memory or ()) == 1  # noqa: SLF001


def test_prefix_memory_gives_way_when_the_saving_does_not_cover_the_queue() -> None:
    nodes = [TableNode(node_id=f"n{i}", endpoint=f"n{i}:8000", weight=1.0) for i in range(4)]
    router = Router.from_table(table(nodes), settings=Settings(load="prefill", balance=1.05, prefix_memory=100))
    with router.request(Request(key=5, cost=1_000)) as first:
        pass
    queued = router.request(
        Request(key=6, cost=50_000), exclude=[n.node_id for n in nodes if n.node_id != first.node_id]
    )
    queued.begin()
    assert queued.node_id == first.node_id
    turn = router.request(Request(key=5, cost=2_000))  # saves 1k, but 50k are queued there
    assert turn.node_id != first.node_id
    excluded = router.request(Request(key=5, cost=2_000), exclude=[turn.node_id])
    assert excluded.node_id != turn.node_id
    with pytest.raises(ValueError, match="prefix_memory"):
        Settings(prefix_memory=-1)
