"""The replay's baselines: each one's defining behaviour, `exclude`, and how each stops using a dead node."""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter
from collections.abc import Callable, Sequence

import pytest

from prismlb.sim._types import ClusterView, EngineStats, KvEvent, Outcome, Policy, SimNode, SimRequest, Workload
from prismlb.sim.policies import (
    BASELINES,
    AIBrixPrefixCache,
    DynamoKvRouter,
    LeastConnections,
    LLMDScorer,
    NginxConsistentHash,
    RoundRobin,
    SGLangCacheAware,
    VllmKvAware,
)
from prismlb.sim.policies._aibrix import PrefixHashTable
from prismlb.sim.policies._llmd import PrefixIndex
from prismlb.sim.policies._nginx_hash import ring_points
from prismlb.sim.policies._sglang import PrefixTree

IDLE = EngineStats(running=0, waiting=0, kv_usage=0.0, prefix_queries_tokens=0, prefix_hits_tokens=0)


class FakeView:
    """A ClusterView over named nodes whose `/metrics` answers unless the node is dead."""

    def __init__(self, names: Sequence[str]) -> None:
        self.nodes = [SimNode(n, f"http://10.0.0.{i + 1}:8000", "h100", 0) for i, n in enumerate(names)]
        self.live: dict[str, EngineStats] = dict.fromkeys(names, IDLE)
        self.dead: set[str] = set()

    def stats(self, name: str) -> EngineStats | None:
        return None if name in self.dead else self.live[name]

    def vectors(self) -> list[object]:
        return []


def req(i: int, blocks: tuple[int, ...] = (), signature: str = "text") -> SimRequest:
    """Request `i` with prefix `blocks` and a modality signature."""
    tokens = 512 * max(1, len(blocks))
    return SimRequest(id=i, arrival_s=0.0, input_tokens=tokens, output_tokens=8, blocks=blocks, signature=signature)


def started(policy: Policy, names: Sequence[str] = ("a", "b", "c")) -> tuple[Policy, FakeView]:
    """`policy` started on a fresh view of `names`."""
    view = FakeView(names)
    policy.start(view, 0.0)
    return policy, view


def send(policy: Policy, view: FakeView, request: SimRequest, now: float, keep: bool = False) -> list[str]:
    """Send one request as the simulator does (dead nodes refuse; live ones finish it unless `keep`): nodes tried."""
    tried: list[str] = []
    exclude: frozenset[str] = frozenset()
    while len(exclude) < len(view.nodes):
        node = policy.choose(request, now, exclude)
        assert node not in exclude
        tried.append(node)
        policy.dispatched(node, request, now)
        if node not in view.dead:
            if not keep:
                policy.finished(node, request, now, Outcome.OK)
            return tried
        policy.finished(node, request, now, Outcome.CONNECT_ERROR)
        exclude |= {node}
    return tried


def run(
    policy: Policy,
    view: FakeView,
    until: float,
    every: float = 0.1,
    blocks: Callable[[int], tuple[int, ...]] = lambda i: (),
) -> list[tuple[float, list[str]]]:
    """Requests every `every` s up to `until`, the policy's ticks in between; (time, nodes tried) per request."""
    out: list[tuple[float, list[str]]] = []
    next_tick = 0.0
    for i in range(int(until / every) + 1):
        now = round(i * every, 6)
        while next_tick <= now:
            policy.tick(view, next_tick)
            next_tick = round(next_tick + policy.tick_s, 6)
        out.append((now, send(policy, view, req(i, blocks(i)), now)))
    return out


# --- every baseline -------------------------------------------------------------------------------------------


def test_baselines_are_named_by_their_key() -> None:
    assert sorted(BASELINES) == ["least-conn", "llm-d", "llm-d-chart", "nginx-hash", "round-robin", "sglang"]
    for name, make in BASELINES.items():
        assert make().name == name


@pytest.mark.parametrize("make", [*BASELINES.values(), AIBrixPrefixCache], ids=[*BASELINES, "aibrix-prefix"])
def test_every_baseline_respects_exclude(make: Callable[[], Policy]) -> None:
    policy, view = started(make(), ("a", "b", "c", "d"))
    policy.tick(view, 0.0)
    for i in range(40):
        for exclude in (frozenset({"a"}), frozenset({"a", "b", "c"}), frozenset({"b", "d"})):
            node = policy.choose(req(i, (i, 1000 + i)), 0.0, exclude)
            assert node not in exclude
            policy.dispatched(node, req(i), 0.0)
            policy.finished(node, req(i), 0.0, Outcome.OK)
    assert policy.choose(req(99), 0.0, frozenset({"a", "b", "c", "d"})) in {"a", "b", "c", "d"}


# --- nginx round robin, least_conn, hash ----------------------------------------------------------------------


def test_round_robin_cycles_in_upstream_order() -> None:
    policy, view = started(RoundRobin())
    assert [send(policy, view, req(i), 0.0)[0] for i in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_skips_a_failed_server_for_fail_timeout_then_probes_it() -> None:
    policy, view = started(RoundRobin())
    view.dead.add("b")
    assert send(policy, view, req(0), 1.0) == ["a"]
    assert send(policy, view, req(1), 1.0) == ["b", "c"]  # refused: b fails once (max_fails=1)
    within = [send(policy, view, req(i), 1.0 + i * 0.5)[0] for i in range(2, 21)]  # through 11.0 s: fail_timeout
    assert "b" not in within
    view.dead.clear()
    after = [send(policy, view, req(i), 11.5 + i * 0.1)[0] for i in range(30, 36)]
    assert "b" in after  # probed after fail_timeout, and back for good once it answers
    assert Counter(send(policy, view, req(i), 20.0)[0] for i in range(40, 49)) == {"a": 3, "b": 3, "c": 3}


def test_least_conn_picks_the_fewest_in_flight_and_breaks_ties_by_round_robin() -> None:
    policy, view = started(LeastConnections())
    assert [send(policy, view, req(i), 0.0)[0] for i in range(6)] == ["a", "b", "c", "a", "b", "c"]  # all tied at 0
    for i, node in enumerate("aab"):
        policy.dispatched(node, req(10 + i), 1.0)
    assert send(policy, view, req(20), 1.0, keep=True) == ["c"]  # a has 2 in flight, b 1, c 0
    assert send(policy, view, req(21), 1.0, keep=True) == ["b"]  # a 2, b 1, c 1: round robin between b and c
    policy.finished("a", req(10), 2.0, Outcome.OK)
    policy.finished("a", req(11), 2.0, Outcome.OK)
    assert send(policy, view, req(22), 2.0, keep=True) == ["a"]


def test_least_conn_skips_a_failed_server() -> None:
    policy, view = started(LeastConnections())
    view.dead.add("a")
    assert send(policy, view, req(0), 0.0) == ["a", "b"]
    assert {send(policy, view, req(i), 0.0 + i)[0] for i in range(1, 10)} <= {"b", "c"}


def test_nginx_ring_has_160_points_per_weight_unit_hashed_like_nginx() -> None:
    servers = {"10.0.0.1:8000": 1, "10.0.0.2:8000": 2, "unix:/run/engine.sock": 1}
    points = ring_points(servers)
    assert Counter(s for _, s in points) == {"10.0.0.1:8000": 160, "10.0.0.2:8000": 320, "unix:/run/engine.sock": 160}
    assert [h for h, _ in points] == sorted(h for h, _ in points)
    first = zlib.crc32(b"10.0.0.1\x008000" + bytes(4))  # crc32(HOST \0 PORT PREV_HASH), PREV_HASH = 0
    second = zlib.crc32(b"10.0.0.1\x008000" + first.to_bytes(4, "little"))
    assert {first, second} <= {h for h, s in points if s == "10.0.0.1:8000"}
    assert zlib.crc32(b"/run/engine.sock\x00" + bytes(4)) in {h for h, _ in points}
    policy, _ = started(NginxConsistentHash(weights={"b": 2}), ("a", "b", "c", "d"))
    assert isinstance(policy, NginxConsistentHash) and len(policy.ring) == 160 * 5


def test_nginx_hash_sends_one_signature_to_one_node() -> None:
    policy, view = started(NginxConsistentHash(), ("a", "b", "c", "d"))
    for signature in ("text", "image+text", "audio+text", "video+text"):
        assert len({send(policy, view, req(i, signature=signature), i * 0.1)[0] for i in range(50)}) == 1


def test_nginx_hash_removing_a_node_moves_only_its_keys() -> None:
    four, view4 = started(NginxConsistentHash(), ("a", "b", "c", "d"))
    three, view3 = started(NginxConsistentHash(), ("a", "b", "c", "d"))
    three.start(FakeView(("a", "b", "c")), 0.0)  # same addresses for a, b, c; d gone
    keys = [f"key-{i}" for i in range(400)]
    before = {k: send(four, view4, req(i, signature=k), 0.0)[0] for i, k in enumerate(keys)}
    after = {k: send(three, view3, req(i, signature=k), 0.0)[0] for i, k in enumerate(keys)}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "d"}
    assert 50 < len(moved) < 150  # about a quarter of the keys


def test_nginx_hash_marks_a_failed_server_down_for_fail_timeout_and_restores_it() -> None:
    policy, view = started(NginxConsistentHash(), ("a", "b", "c", "d"))
    home = send(policy, view, req(0), 0.0)[0]
    view.dead.add(home)
    tried = send(policy, view, req(1), 1.0)
    assert tried[0] == home and len(tried) == 2  # refused, then the next point's server
    fallback = tried[1]
    assert {send(policy, view, req(i), 1.0 + i)[0] for i in range(2, 11)} == {fallback}  # up to 10 s later
    view.dead.clear()
    assert send(policy, view, req(20), 12.0) == [home]  # fail_timeout over: probed, and it answers
    assert {send(policy, view, req(i), 12.0 + i)[0] for i in range(21, 30)} == {home}


@pytest.mark.parametrize("make", [RoundRobin, LeastConnections, NginxConsistentHash])
def test_nginx_balancers_probe_a_dead_server_at_most_once_per_fail_timeout(make: Callable[[], Policy]) -> None:
    policy, view = started(make(), ("a", "b", "c", "d"))
    dead = send(policy, view, req(0), 0.0)[0]
    view.dead.add(dead)
    hits = [t for t, tried in run(policy, view, 60.0) if dead in tried]
    assert hits and all(later - earlier > 10.0 for earlier, later in zip(hits, hits[1:]))


# --- SGLang cache-aware -----------------------------------------------------------------------------------------


def test_sglang_routes_a_prefix_match_above_threshold_to_the_matching_worker() -> None:
    policy, view = started(SGLangCacheAware())
    assert send(policy, view, req(0, (1, 2, 3, 4)), 0.0) == ["a"]  # empty trees: the first smallest
    assert send(policy, view, req(1, (5, 6)), 0.1) == ["b"]  # no match: smallest tree
    assert send(policy, view, req(2, (1, 2, 3, 9)), 0.2) == ["a"]  # 3/4 matched > 0.3
    assert send(policy, view, req(3, (5, 7, 8, 10)), 0.3) == ["c"]  # 1/4 matched <= 0.3: smallest tree


def test_sglang_balances_by_load_only_beyond_both_thresholds() -> None:
    policy, view = started(SGLangCacheAware())
    send(policy, view, req(0, (1, 2, 3)), 0.0)  # a's tree holds (1, 2, 3)

    def load(a: int, b: int, c: int) -> None:
        assert isinstance(policy, SGLangCacheAware)
        for name, n in zip("abc", (a, b, c)):
            policy.workers[name].load = n

    load(70, 10, 10)  # range 60 <= 64: cache-aware
    assert send(policy, view, req(1, (1, 2, 3)), 1.0, keep=True) == ["a"]
    load(300, 231, 240)  # range 69 > 64 but 300 <= 1.5 * 231: cache-aware
    assert send(policy, view, req(2, (1, 2, 3)), 2.0, keep=True) == ["a"]
    load(70, 5, 3)  # range 67 > 64 and 70 > 1.5 * 3: least loaded
    assert send(policy, view, req(3, (1, 2, 3)), 3.0, keep=True) == ["c"]


def test_sglang_tree_evicts_least_recently_used_leaves_down_to_max_size() -> None:
    tree = PrefixTree(["a", "b"])
    tree.insert((1, 2, 3), "a", 1.0)
    tree.insert((1, 4, 5), "a", 2.0)
    tree.insert((1, 2, 3), "b", 3.0)
    assert tree.size == {"a": 5, "b": 3}
    tree.evict(3)
    assert tree.size == {"a": 3, "b": 3}
    assert tree.match((1, 4, 5), 4.0) == (3, "a")
    assert tree.match((1, 2, 3), 4.0) == (3, "b")  # a's oldest leaves went; b still holds them
    tree.remove("b")
    assert tree.match((1, 2, 3), 5.0) == (1, "a") and set(tree.nodes) == {1, 4, 5}


def test_sglang_evicts_every_eviction_interval() -> None:
    policy, view = started(SGLangCacheAware())
    assert isinstance(policy, SGLangCacheAware)
    policy.max_tree_blocks = 2
    send(policy, view, req(0, (1, 2, 3, 4)), 0.0)
    policy.tick(view, 60.0)
    assert policy.tree.size["a"] == 4
    policy.tick(view, 120.0)
    assert policy.tree.size["a"] == 2
    assert policy.max_tree_blocks == 2 and SGLangCacheAware(block_tokens=512).max_tree_blocks == 2**26 // (4 * 512)


def test_sglang_health_checker_marks_a_dead_worker_unhealthy_after_three_failed_checks() -> None:
    policy, view = started(SGLangCacheAware())
    assert isinstance(policy, SGLangCacheAware)
    policy.tick(view, 0.0)
    view.dead.add("b")
    for t in (60.0, 120.0):
        policy.tick(view, t)
        assert policy.workers["b"].healthy
    policy.tick(view, 180.0)
    assert not policy.workers["b"].healthy
    assert {send(policy, view, req(i, (i,)), 181.0 + i)[0] for i in range(30)} == {"a", "c"}
    view.dead.clear()
    policy.tick(view, 240.0)
    assert not policy.workers["b"].healthy
    policy.tick(view, 300.0)
    assert policy.workers["b"].healthy  # two good checks in a row


def test_sglang_circuit_breaker_opens_after_ten_refused_attempts() -> None:
    policy, view = started(SGLangCacheAware())
    assert isinstance(policy, SGLangCacheAware)
    send(policy, view, req(0, (1, 2)), 0.0)  # a's tree holds (1, 2): a matching request picks a
    view.dead.add("a")
    for i in range(1, 11):
        assert send(policy, view, req(i, (1, 2)), float(i))[0] == "a"
    assert policy.workers["a"].breaker == "open"
    assert all(send(policy, view, req(i, (1, 2)), 11.0 + i)[0] != "a" for i in range(20))
    assert "a" not in policy.tree.size  # chosen while unavailable: dropped from the tree, as sgl-router does


def test_sglang_stops_choosing_a_dead_worker() -> None:
    policy, view = started(SGLangCacheAware(), ("a", "b", "c", "d"))
    view.dead.add("c")
    picks = run(policy, view, 400.0, every=0.5, blocks=lambda i: (10 * i, 10 * i + 1))
    assert any("c" in tried for _, tried in picks)
    assert all(tried[0] != "c" for t, tried in picks if t > 180.0)  # unhealthy after three 60 s checks


# --- llm-d ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [(2.0, 2.0, 3.0), (3.0, 2.0, 2.0)])
def test_llmd_scores_are_weighted_prefix_queue_kv_and_the_max_wins(weights: tuple[float, float, float]) -> None:
    policy, view = started(LLMDScorer(weights=weights))
    wp, wq, wk = weights
    assert isinstance(policy, LLMDScorer)
    view.live.update(
        a=EngineStats(4, 10, 0.5, 0, 0),
        b=EngineStats(4, 0, 0.5, 0, 0),
        c=EngineStats(4, 5, 0.9, 0, 0),
    )
    policy.tick(view, 0.0)
    policy.index.add((1, 2, 3, 4), "a")
    policy.index.add((1, 2), "c")
    scores = policy.scores(req(0, (1, 2, 3, 4)), ["a", "b", "c"])
    expected = {
        "a": wp * 1.0 + wq * 0.0 + wk * 0.5,
        "b": wp * 0.0 + wq * 1.0 + wk * 0.5,
        "c": wp * 0.5 + wq * 0.5 + wk * 0.1,
    }
    assert scores == pytest.approx(expected)
    assert send(policy, view, req(0, (1, 2, 3, 4)), 0.01) == ["a"]
    assert send(policy, view, req(1, (7, 8)), 0.02) == ["b"]  # no prefix anywhere: the empty queue wins


def test_llmd_prefix_index_matches_leading_blocks_per_pod_with_an_lru() -> None:
    index = PrefixIndex(capacity=3)
    index.add((1, 2, 3), "a")
    index.add((1, 2), "b")
    assert index.match((1, 2, 3, 4)) == {"a": 3, "b": 2}
    assert index.match((9, 1, 2)) == {}  # stops at the first block nobody holds
    index.add((5,), "a")  # a's least recently added block (1) goes
    assert index.match((1, 2, 3)) == {"a": 2, "b": 2}  # every held block of the leading run counts, as in the EPP
    index.remove_pod("b")
    assert index.match((1, 2, 3)) == {}


def test_llmd_prefix_routes_repeats_to_the_same_pod_and_truncates_to_4096_tokens() -> None:
    policy, view = started(LLMDScorer())
    assert isinstance(policy, LLMDScorer) and policy.max_blocks == 8 and policy.index.capacity == 500_000 // 512
    policy.tick(view, 0.0)
    first = send(policy, view, req(0, tuple(range(20))), 0.01)[0]
    assert all(send(policy, view, req(i, tuple(range(20))), 0.01 * i)[0] == first for i in range(1, 10))
    assert set(policy.index.pods) == set(range(8))


def test_llmd_tie_breaks_are_seeded() -> None:
    picks = []
    for _ in range(2):
        policy, view = started(LLMDScorer(seed=7), ("a", "b", "c", "d"))
        policy.tick(view, 0.0)
        picks.append([send(policy, view, req(i, (1000 + i,)), 0.0)[0] for i in range(20)])
    assert picks[0] == picks[1] and len(set(picks[0])) > 1


def test_llmd_keeps_stale_metrics_and_drops_a_pod_when_readiness_fails_three_times() -> None:
    policy, view = started(LLMDScorer(), ("a", "b", "c", "d"))
    assert isinstance(policy, LLMDScorer)
    view.live.update(a=EngineStats(2, 3, 0.5, 0, 0), b=EngineStats(1, 0, 0.1, 0, 0), c=EngineStats(2, 3, 0.5, 0, 0))
    view.live["d"] = view.live["a"]
    policy.tick(view, 0.0)
    view.dead.add("b")
    picks = run(policy, view, 30.0, every=0.25)
    assert policy.metrics["b"] == EngineStats(1, 0, 0.1, 0, 0)  # a failed scrape keeps the last metrics
    assert "b" not in policy.ready
    assert any("b" in tried for t, tried in picks if t < 10.0)
    assert all("b" not in tried for t, tried in picks if t >= 15.0)  # probes at 5, 10, 15 s failed
    view.dead.clear()
    policy.tick(view, 35.0)
    assert "b" in policy.ready


# --- Dynamo KV router, vLLM router kv_aware -------------------------------------------------------------------


class EventView(FakeView):
    """A FakeView whose nodes' KV events are handed out by `kv_events` as the test queues them."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__(names)
        self.events: list[KvEvent] = []

    def kv_events(self) -> list[KvEvent]:
        out, self.events = self.events, []
        return out

    def store(self, node: str, *blocks: int) -> None:
        self.events.append(KvEvent(node, 0.0, (), blocks))


def events_started(policy: Policy, names: Sequence[str] = ("a", "b", "c")) -> tuple[Policy, EventView]:
    view = EventView(names)
    policy.start(view, 0.0)
    return policy, view


def test_dynamo_cost_is_weighted_prefill_blocks_plus_decode_blocks_and_the_lowest_wins() -> None:
    policy, view = events_started(DynamoKvRouter(block_tokens=512))
    assert isinstance(policy, DynamoKvRouter)
    view.store("a", 1, 2, 3)
    view.store("b", 1)
    policy.tick(view, 0.05)
    busy = req(100, (50, 51))  # 1024 prompt tokens, none cached on b: 2 prefill blocks, 2 active blocks
    policy.dispatched("b", busy, 0.05)
    request = req(1, (1, 2, 3, 4))  # 2048 prompt tokens
    # a: 3 blocks cached -> (2048 - 3 * 512) / 512 = 1 prefill block; 0 active + 4 new decode blocks -> 5
    # b: 1 block cached -> (1024 + 2048 - 512) / 512 = 5 prefill blocks; 2 active + 4 new -> 11
    # c: nothing cached -> 2048 / 512 = 4 prefill blocks; 4 new decode blocks -> 8
    assert policy.logits(request, ["a", "b", "c"]) == {"a": 5.0, "b": 11.0, "c": 8.0}
    assert policy.choose(request, 0.1, frozenset()) == "a"
    assert policy.choose(request, 0.1, frozenset({"a"})) == "c"
    policy.first_token("b", busy, 0.2)  # prefill done: b keeps its decode blocks only
    assert policy.logits(request, ["b"]) == {"b": 3.0 + 6.0}
    heavy = DynamoKvRouter(block_tokens=512, overlap_score_weight=0.0)
    heavy.start(view, 0.0)
    heavy.dispatched("a", req(101, (60, 61, 62)), 0.0)  # weight 0: decode blocks alone, a has 3 more
    assert heavy.logits(request, ["a", "c"]) == {"a": 7.0, "c": 4.0}


def test_dynamo_counts_held_blocks_against_the_text_never_the_media() -> None:
    policy, view = events_started(DynamoKvRouter(block_tokens=512))
    assert isinstance(policy, DynamoKvRouter)
    view.store("a", 1)
    policy.tick(view, 0.05)
    image = dataclasses.replace(req(1, (1,)), input_tokens=1200, media={"image": 1}, media_tokens=1000)
    assert policy.new_tokens(image, 1) == 1000  # the block holds the 200 text tokens, not 512 of the prompt
    assert policy.new_tokens(req(2, (1, 2)), 1) == 1024 - 512
    policy.dispatched("a", image, 0.1)
    assert policy.active["a"].prefill_tokens[1] == 1000


def test_dynamo_index_follows_stored_and_removed_events_and_ties_go_to_the_smallest_tree() -> None:
    policy, view = events_started(DynamoKvRouter(block_tokens=512))
    assert isinstance(policy, DynamoKvRouter)
    view.store("a", 7, 8)
    view.store("b", 7, 8)
    view.store("b", 30)
    policy.tick(view, 0.05)
    assert policy.index.overlap((7, 8, 9)) == {"a": 2, "b": 2}
    assert policy.choose(req(1, (7, 8)), 0.1, frozenset()) == "a"  # a and b cost 2, a's tree is smaller
    view.events.append(KvEvent("a", 0.1, (8,), ()))
    policy.tick(view, 0.15)
    assert policy.index.overlap((7, 8)) == {"a": 1, "b": 2}
    assert policy.choose(req(2, (7, 8)), 0.2, frozenset()) == "b"


def test_dynamo_temperature_draws_by_softmax_of_the_negated_cost_deterministically_per_seed() -> None:
    def draws(seed: int, temperature: float) -> list[str]:
        policy, view = events_started(DynamoKvRouter(block_tokens=512, temperature=temperature, seed=seed))
        view.store("a", 1, 2, 3)
        view.store("b", 1)
        policy.tick(view, 0.05)
        policy.dispatched("b", req(100, (50, 51)), 0.05)
        return [policy.choose(req(1, (1, 2, 3, 4)), 0.1, frozenset()) for _ in range(2000)]

    assert set(draws(0, 0.0)) == {"a"}
    first = draws(7, 1.0)
    assert first == draws(7, 1.0) and first != draws(8, 1.0)
    counts = Counter(first)
    # costs 5, 11, 8 over a range of 6: weights e^0, e^-1, e^-0.5 -> 0.50, 0.19, 0.31
    assert counts["a"] / 2000 == pytest.approx(0.50, abs=0.04)
    assert counts["b"] / 2000 == pytest.approx(0.19, abs=0.04)
    assert counts["c"] / 2000 == pytest.approx(0.31, abs=0.04)


def test_dynamo_drops_a_worker_that_refuses_until_discovery_lists_it_again() -> None:
    policy, view = events_started(DynamoKvRouter(block_tokens=512))
    assert isinstance(policy, DynamoKvRouter)
    view.store("a", 1, 2)
    policy.tick(view, 0.05)
    view.dead.add("a")
    tried = send(policy, view, req(1, (1, 2)), 0.1)
    assert tried[0] == "a" and tried[1] in {"b", "c"}  # a refused; b and c tie (empty trees): a seeded draw
    assert "a" not in policy.up and policy.index.overlap((1, 2)) == {}
    assert "a" not in send(policy, view, req(2, (1, 2)), 0.2)
    view.dead.clear()
    policy.tick(view, 0.25)
    assert "a" in policy.up


def test_vllm_kv_aware_picks_the_longest_gapless_prefix_the_last_of_ties() -> None:
    policy, view = events_started(VllmKvAware(), ("a", "b", "c", "d"))
    assert isinstance(policy, VllmKvAware)
    view.store("a", 1, 2)
    view.store("b", 1, 3)  # gap at block 2: score 1
    view.store("c", 1, 2)
    view.store("d", 2, 3)  # misses the first block: no score
    policy.tick(view, 0.05)
    assert policy.index.scores((1, 2, 3), 0.1) == {"a": 2, "b": 1, "c": 2}
    assert policy.choose(req(1, (1, 2, 3)), 0.1, frozenset()) == "c"  # a and c tie: Rust's max_by_key, the last
    assert policy.choose(req(2, (1, 2, 3, 4)), 0.2, frozenset()) == "c"  # c speculatively holds block 3 now
    assert policy.choose(req(3, (1, 2)), 0.3, frozenset({"c"})) == "a"


def test_vllm_kv_aware_falls_back_to_least_load_and_speculates_for_two_seconds() -> None:
    policy, view = events_started(VllmKvAware(), ("a", "b", "c", "d"))
    policy.tick(view, 0.0)
    send(policy, view, req(100, (500,)), 0.0, keep=True)  # a: one in flight (least load, first of ties)
    assert send(policy, view, req(1, (9, 10)), 0.0) == ["b"]  # nothing cached: least loaded, first of ties
    assert send(policy, view, req(2, (9, 10, 11)), 1.0, keep=True) == ["b"]  # speculative (9, 10) on b
    assert send(policy, view, req(3, (9, 10)), 2.5) == ["c"]  # expired after 2 s; a and b are busy
    view.store("d", 9, 10)
    policy.tick(view, 2.55)
    assert [send(policy, view, req(4 + i, (9,)), 10.0 + i)[0] for i in range(2)] == ["d", "d"]  # real: no TTL


def test_kv_routers_run_in_a_replay_with_a_kill_and_receive_delayed_events() -> None:
    from prismlb.sim._cluster import KV_EVENT_DELAY_S, Kill, NodeSpec, Simulation
    from prismlb.sim._eval import Case, run_case

    for name in ("dynamo-kv", "vllm-kv-aware"):
        result = run_case(Case("mooncake", name, 0.8, 1, 300, kill=True))
        assert result.policy == name and result.killed_node == "a100-3"
        assert result.completed >= 290 and result.kv_hit_rate > 0.0

    delivered: list[tuple[float, KvEvent]] = []

    class Recording(DynamoKvRouter):
        def tick(self, view: ClusterView, now: float) -> None:
            events = view.kv_events()
            delivered.extend((now, e) for e in events)
            for event in events:
                self.index.removed(event.node, event.removed)
                self.index.stored(event.node, event.stored)

    requests = [SimRequest(i, i * 0.2, 2048, 4, (1, 2, 3, 10 + i)) for i in range(40)]
    nodes = [NodeSpec(f"n{i}", "a100") for i in range(3)]
    policy = Recording(block_tokens=512)
    Simulation(Workload("shared", requests, 512, "test"), policy, nodes, utilisation=0.5, seed=0, kill=Kill("n1")).run()
    assert delivered and all(now >= e.time_s + KV_EVENT_DELAY_S - 1e-9 for now, e in delivered)
    holders = policy.index.overlap((1, 2, 3))
    assert holders and "n1" not in {e.node for _, e in delivered if e.time_s > 4.0}
    assert sum(len(e.stored) for _, e in delivered) >= 40  # every request's own last block was cached somewhere


# --- AIBrix prefix-cache ----------------------------------------------------------------------------------------


def aibrix(holders: dict[str, tuple[int, ...]], running: dict[str, int]) -> AIBrixPrefixCache:
    """AIBrix's router on pods a-d, its index holding `holders` and the gateway counting `running` requests."""
    policy = AIBrixPrefixCache(block_tokens=512)
    policy.start(FakeView(("a", "b", "c", "d")), 0.0)
    for pod, blocks in holders.items():
        policy.index.add(blocks, pod, 0.0)
    for pod, n in running.items():
        policy.workers[pod].load = n
    return policy


def test_aibrix_prefix_percent_is_matched_text_tokens_over_the_prompt_text() -> None:
    policy = AIBrixPrefixCache(block_tokens=512)
    partial = SimRequest(1, 0.0, 2000, 8, (1, 2, 3, 4))  # the last 512-token block holds 464 tokens
    assert [policy.match_percent(partial, n) for n in (1, 3, 4)] == [25, 76, 100]  # 512, 1536, 2000 of 2000
    media = SimRequest(2, 0.0, 2048 + 1000, 8, (1, 2, 3, 4), "image+text", {"image": 1}, 1000)
    assert policy.match_percent(media, 2) == 50  # 1024 of the 2048 text tokens
    assert policy.index.capacity == 200_000 * 4 // (4 * 512) == 390


def test_aibrix_prefix_picks_the_best_match_then_fewest_running_within_mean_plus_one_stddev() -> None:
    held = {"a": (1, 2, 3, 4), "b": (1, 2, 3), "d": (1, 2)}  # 100%, 75%, 50% of req(1, (1, 2, 3, 4))
    # running 2, 1, 1, 2: mean 1.5, sample stddev sqrt(4 * 0.25 / 3) = 0.58, bound 2.08: a is within it
    assert aibrix(held, {"a": 2, "b": 1, "c": 1, "d": 2}).choose(req(1, (1, 2, 3, 4)), 1.0, frozenset()) == "a"
    # running 5, 0, 4, 3: mean 3, the sample stddev sqrt(14 / 3) = 2.16 gives 5.16 and keeps a (the population's,
    # sqrt(14 / 4) = 1.87, would not)
    assert aibrix(held, {"a": 5, "b": 0, "c": 4, "d": 3}).choose(req(1, (1, 2, 3, 4)), 1.0, frozenset()) == "a"
    # a and b both at 100%: fewer running requests first
    tied = {"a": (1, 2, 3, 4), "b": (1, 2, 3, 4)}
    assert aibrix(tied, {"a": 2, "b": 1, "c": 1, "d": 2}).choose(req(1, (1, 2, 3, 4)), 1.0, frozenset()) == "b"
    # running 9, 2, 1, 1 (range 8, not above 8: balanced): mean 3.25, stddev sqrt(44.75 / 3) = 3.86, bound 7.11;
    # a (100%) is beyond it, b (75%) is the next best
    assert aibrix(held, {"a": 9, "b": 2, "c": 1, "d": 1}).choose(req(1, (1, 2, 3, 4)), 1.0, frozenset()) == "b"
    # only a matches and it is beyond the bound (4 > 2.25 + 1.26): the fewest running requests instead
    alone = {"a": (1, 2, 3, 4)}
    assert aibrix(alone, {"a": 4, "b": 2, "c": 1, "d": 2}).choose(req(1, (1, 2, 3, 4)), 1.0, frozenset()) == "c"


def test_aibrix_prefix_matches_only_among_the_least_loaded_when_running_requests_differ_by_more_than_8() -> None:
    held = {"a": (1, 2, 3, 4), "b": (1, 2, 3), "d": (1, 2)}
    # range 9 > 8: candidates are c and d (1 running each); d holds the first two blocks, a and b are not asked
    assert aibrix(held, {"a": 10, "b": 2, "c": 1, "d": 1}).choose(req(1, (1, 2, 3, 4)), 1.0, frozenset()) == "d"
    # c alone has the fewest and matches nothing: the least running requests over every ready pod
    assert aibrix(held, {"a": 10, "b": 2, "c": 1, "d": 2}).choose(req(1, (1, 2, 3, 4)), 1.0, frozenset()) == "c"


def test_aibrix_prefix_indexes_its_own_placements_and_a_walk_drops_pods_missing_a_block() -> None:
    policy, view = started(AIBrixPrefixCache(), ("a", "b", "c", "d"))
    first = send(policy, view, req(0, (1, 2, 3)), 0.0)[0]  # nothing indexed, all idle: a seeded draw
    assert all(send(policy, view, req(i, (1, 2, 3, 10 + i)), 0.1 * i) == [first] for i in range(1, 5))
    table = PrefixHashTable(capacity=10)
    table.add((1, 2, 3), "a", 0.0)
    table.add((1, 3), "b", 0.0)  # b misses block 2: out of the walk there
    table.add((2, 3), "c", 0.0)  # c misses block 1: never in
    assert table.match((1, 2, 3), ["a", "b", "c"]) == {"a": 3, "b": 1}
    assert table.match((1, 2, 3), ["b", "c"]) == {"b": 1}  # a is no candidate: the walk ends at block 2


def test_aibrix_prefix_index_is_one_lru_by_last_write_with_a_20_minute_ttl() -> None:
    table = PrefixHashTable(capacity=3)
    table.add((1, 2), "a", 0.0)
    table.add((1, 2), "b", 1.0)  # rewritten: both pods, written at 1.0
    table.add((7,), "c", 2.0)
    assert table.match((1, 2), ["a", "b"]) == {"a": 2, "b": 2}  # a read does not refresh block 1
    table.add((8,), "c", 3.0)  # a fourth hash: block 1, the least recently written, goes
    assert list(table.entries) == [2, 7, 8]
    assert table.match((1, 2), ["a", "b"]) == {}  # block 2 is still there, but the chain breaks at block 1
    table.expire(1201.0, 1200.0)  # block 2 was written 1200 s ago: not more than 20 min
    assert list(table.entries) == [2, 7, 8]
    table.expire(1201.5, 1200.0)
    assert list(table.entries) == [7, 8]


def test_aibrix_prefix_drops_a_pod_after_five_failed_readiness_probes() -> None:
    policy, view = started(AIBrixPrefixCache(), ("a", "b", "c", "d"))
    assert isinstance(policy, AIBrixPrefixCache)
    view.dead.add("b")
    for t in range(16):
        policy.tick(view, float(t))
    assert "b" in policy.ready  # probes at 0, 5, 10, 15 s failed: four
    for t in range(16, 21):
        policy.tick(view, float(t))
    assert "b" not in policy.ready
    assert all("b" not in send(policy, view, req(i), 21.0) for i in range(20))
    view.dead.clear()
    for t in range(21, 26):
        policy.tick(view, float(t))
    assert "b" in policy.ready  # one success at 25 s


def test_aibrix_prefix_runs_in_a_replay_with_a_kill() -> None:
    from prismlb.sim._eval import Case, run_case

    result = run_case(Case("mooncake", "aibrix-prefix", 0.8, 1, 300, kill=True))
    assert result.policy == "aibrix-prefix" and result.killed_node == "a100-3"
    assert result.completed >= 290 and result.kv_hit_rate > 0.0
