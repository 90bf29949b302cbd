"""Placement by expected time to first token over the prefix index (`Settings.prefix_index`)."""

from __future__ import annotations

import time

import pytest

from prismlb.router import Lease, Request, Router, Settings, block_hashes
from prismlb.wire import RoutingTable, SliceTable, TableNode

BLOCK = 16
PROMPT = list(range(64 * BLOCK))
BLOCKS = tuple(block_hashes(PROMPT, BLOCK))
COST = len(PROMPT)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(*nodes: TableNode) -> RoutingTable:
    return RoutingTable(
        epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=list(nodes))]
    )


def node(name: str, *, weight: float = 1.0, rate: float | None = None) -> TableNode:
    return TableNode(node_id=name, endpoint=f"http://{name}:8000", weight=weight, prefill_tokens_per_s=rate)


def router(*nodes: TableNode, **settings: object) -> tuple[Router, Clock]:
    clock = Clock()
    return Router.from_table(table(*nodes), settings=Settings(**settings), clock=clock), clock  # type: ignore[arg-type]


def request(blocks: tuple[int, ...] = BLOCKS, cost: int = COST, key: int | None = None) -> Request:
    return Request(key=key, blocks=blocks, cost=cost, block_size=BLOCK)


def sent(r: Router, req: Request) -> Lease:
    lease = r.request(req)
    lease.begin()
    return lease


def owner_of(r: Router, key: int) -> str:
    return r.route(key).node_id


def test_a_request_goes_to_the_node_caching_its_prefix_whatever_its_key() -> None:
    r, _ = router(node("a"), node("b"), node("c"))
    for key in range(20):
        holder = next(n for n in "abc" if n != owner_of(r, key))
        r.index.reset(holder, BLOCKS[:40])
        assert r.route(request(key=key)).node_id == holder
        r.index.drop(holder)


def test_the_lease_counts_only_the_tokens_the_chosen_node_must_compute() -> None:
    r, _ = router(node("a"), node("b"))
    r.index.stored("a", BLOCKS[:40])
    lease = sent(r, request())
    assert lease.node_id == "a"
    assert r.status()["a"].inflight == 1
    # 40 of 64 blocks cached: the queued work the next placement sees is the other 24 blocks' tokens.
    assert r.status()["a"].load == COST - 40 * BLOCK
    lease.first_token()
    assert r.status()["a"].load == 0


def test_a_busy_holder_keeps_the_request_within_the_affinity_factor() -> None:
    for filler in range(8):
        r, _ = router(node("a"), node("b"), cache_affinity=1.5, balance=0)
        r.index.stored("a", BLOCKS[:32])  # half the prompt cached on a: a computes 512 tokens, b all 1024
        for i in range(filler):  # queued prefill work on a alone
            sent_to = r.request(request(tuple(block_hashes([i + 7] * BLOCK, BLOCK)), cost=256), exclude=["b"])
            sent_to.begin()
        expected_a = filler * 256 + COST // 2
        expected_b = COST
        assert r.route(request()).node_id == ("a" if expected_a <= 1.5 * expected_b else "b"), filler


def test_equal_queues_and_no_cache_go_to_the_faster_node() -> None:
    r, _ = router(node("slow", rate=6_000), node("fast", rate=20_000), balance=0)
    fresh = [tuple(block_hashes([i] * BLOCK * 4, BLOCK)) for i in range(1, 40)]
    chosen = [sent(r, request(b, cost=4 * BLOCK)).node_id for b in fresh]
    # Expected times (queued + own) / rate: the fast node takes about 20/26 of the work.
    assert 0.65 < chosen.count("fast") / len(chosen) < 0.9


def test_a_low_weight_node_is_stretched() -> None:
    r, _ = router(node("sick", weight=0.25), node("well", weight=1.0), balance=0)
    fresh = [tuple(block_hashes([i] * BLOCK, BLOCK)) for i in range(1, 41)]
    chosen = [sent(r, request(b, cost=BLOCK)).node_id for b in fresh]
    assert chosen.count("well") >= 4 * chosen.count("sick") - 2


def test_placements_stand_in_for_events_until_they_expire() -> None:
    r, clock = router(node("a"), node("b"), node("c"), placed_ttl_s=10.0)
    first = sent(r, request()).node_id
    first_lease_load = r.status()[first].load
    assert first_lease_load == COST
    # The next request with the same prompt follows the first although no event said it is cached.
    assert r.route(request()).node_id == first
    clock.now += 11.0
    assert r.index.match(BLOCKS, clock.now) == {}


def test_an_eviction_event_withdraws_the_placement_claim() -> None:
    r, clock = router(node("a"), node("b"))
    lease = sent(r, request())
    lease.first_token()
    lease.end()
    r.index.removed(lease.node_id, BLOCKS)
    assert r.index.match(BLOCKS, clock.now) == {}


def test_excluded_and_open_holders_are_passed_over() -> None:
    r, _ = router(node("a"), node("b"))
    r.index.stored("a", BLOCKS)
    lease = r.request(request(), exclude=["a"])
    assert lease.node_id == "b"


def test_off_the_index_a_request_with_blocks_takes_its_key_on_the_ring() -> None:
    r, _ = router(node("a"), node("b"), node("c"), prefix_index=False)
    for key in range(10):
        holder = next(n for n in "abc" if n != owner_of(r, key))
        r.index.stored(holder, BLOCKS)
        assert r.route(request(key=key)).node_id == owner_of(r, key)
        r.index.drop(holder)


def test_settings_refuse_an_affinity_below_one() -> None:
    with pytest.raises(ValueError, match="cache_affinity"):
        Settings(cache_affinity=0.5)
    with pytest.raises(ValueError, match="block_size"):
        Request(blocks=BLOCKS, block_size=0)
