"""Queued prefill shared between routers: each router's report, the brain's sums, each router's peers' share."""

from __future__ import annotations

import time

import zmq

from prismlb.brain import LoadRelay
from prismlb.router import Request, Router, Settings, block_hashes
from prismlb.router._router import _spread
from prismlb.sim._cluster import Simulation
from prismlb.sim._eval import TEXT_CLUSTER, capacity
from prismlb.sim._families import family_workload
from prismlb.sim._prism import PrismPolicy
from prismlb.sim._workload import scale_to_utilisation
from prismlb.wire import (
    MAX_PLACED_BLOCKS,
    MAX_ROUTER_LOAD_NODES,
    BrainAddress,
    ClusterLoad,
    NodeMetrics,
    NodeVector,
    Placed,
    RouterLoad,
    RoutingTable,
    SliceTable,
    TableNode,
    VectorSender,
    decode,
    encode,
)

from .conftest import Clock, free_port, running_brain, wait_for

BLOCK = 16
PROMPT = list(range(64 * BLOCK))
BLOCKS = tuple(block_hashes(PROMPT, BLOCK))
OTHER = tuple(block_hashes([t + 100_000 for t in PROMPT], BLOCK))


def report(router_id: str, seq: int, **loads: float) -> RouterLoad:
    return RouterLoad(router_id=router_id, seq=seq, loads=loads)


def table(*names: str) -> RoutingTable:
    nodes = [TableNode(node_id=n, endpoint=f"http://{n}:8000", weight=1.0) for n in names]
    return RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=nodes)])


# --- the brain's relay ---------------------------------------------------------------------------------------


def test_relay_sums_every_routers_latest_report() -> None:
    relay = LoadRelay("b")
    relay.accept(report("r1", 1, a=100.0, b=50.0), 0.0)
    relay.accept(report("r2", 1, a=30.0), 0.0)
    first = relay.due(0.0)
    assert first is not None and first.loads == {"a": 130.0, "b": 50.0} and first.routers == 2 and first.seq == 1
    relay.accept(report("r1", 2, b=10.0), 0.01)  # r1's a finished: its whole figure replaces the last one
    assert relay.due(0.01) is None, "at most one publication per publish_s"
    second = relay.due(0.03)
    assert second is not None and second.loads == {"a": 30.0, "b": 10.0} and second.seq == 2
    assert relay.due(0.06) is None, "nothing changed and no refresh due"


def test_relay_drops_stale_reports_and_expired_routers_and_refreshes() -> None:
    relay = LoadRelay("b", expiry_s=2.0, refresh_s=0.5)
    relay.accept(report("r1", 5, a=10.0), 0.0)
    relay.accept(report("r1", 4, a=99.0), 0.0)  # arrived after a newer one
    assert relay.counts["stale"] == 1
    assert relay.due(0.0).loads == {"a": 10.0}  # type: ignore[union-attr]
    relay.accept(report("r2", 1, a=5.0), 1.9)
    refreshed = relay.due(2.5)  # r1 last heard at 0.0: expired at the refresh
    assert refreshed is not None and refreshed.loads == {"a": 5.0} and refreshed.routers == 1
    assert relay.counts["expired"] == 1
    assert relay.next_due() == 3.0


def test_relay_refuses_routers_past_its_cap() -> None:
    relay = LoadRelay("b", max_routers=2)
    for i in range(3):
        relay.accept(report(f"r{i}", 1, a=1.0), 0.0)
    assert relay.routers == 2 and relay.counts["overflow"] == 1
    assert relay.due(0.0).loads == {"a": 2.0}  # type: ignore[union-attr]


# --- the router's side ---------------------------------------------------------------------------------------


def test_router_reports_its_queued_prefill_per_node_when_it_changes() -> None:
    clock = Clock()
    r = Router.from_table(table("a", "b"), clock=clock)
    assert r.load_report() is None, "nothing queued: nothing new to say"
    lease = r.request(Request(blocks=BLOCKS, cost=len(PROMPT), block_size=BLOCK))
    lease.begin()
    first = r.load_report()
    assert first is not None and first.loads == {lease.node_id: float(len(PROMPT))} and first.seq == 1
    assert r.load_report() is None and r.load_report(force=True) is not None
    assert [(p.node_id, p.blocks) for p in first.placed] == [(lease.node_id, list(BLOCKS))]
    lease.first_token()
    done = r.load_report()
    assert done is not None and done.loads == {} and done.placed == []
    wire = decode(encode(done), (RouterLoad,), 65536)
    assert wire.router_id == r.router_id


def test_router_reports_its_heaviest_nodes_past_the_message_cap() -> None:
    names = [f"n{i}" for i in range(MAX_ROUTER_LOAD_NODES + 10)]
    r = Router.from_table(table(*names))
    for i, name in enumerate(names):
        state = r._states[name]
        state.load = i + 1
    sent = r.load_report()
    assert sent is not None and len(sent.loads) == MAX_ROUTER_LOAD_NODES
    assert min(sent.loads.values()) == 11.0, "the ten lightest are left out"


def test_a_placement_past_the_reports_cap_goes_on_in_the_next_report() -> None:
    r = Router.from_table(table("a", "b"))
    long_prompt = tuple(range(1, MAX_PLACED_BLOCKS + 101))
    r._placed_out.append(("a", long_prompt))
    first, second = r.load_report(), r.load_report()
    assert first is not None and second is not None
    assert [len(p.blocks) for p in first.placed] == [MAX_PLACED_BLOCKS]
    assert second.placed[0].blocks == list(long_prompt[MAX_PLACED_BLOCKS:]) and r.load_report() is None


def test_peers_queue_steers_placement_until_it_goes_stale() -> None:
    clock = Clock()
    r = Router.from_table(table("a", "b"), clock=clock)
    fresh = Request(blocks=BLOCKS, cost=len(PROMPT), block_size=BLOCK)
    idle_choice = r.route(fresh).node_id
    other = "b" if idle_choice == "a" else "a"
    r.apply_cluster_load({idle_choice: 50_000.0})  # peers queued 50,000 tokens there
    assert r.route(fresh).node_id == other
    clock.now += Settings().peer_load_ttl_s + 0.1  # the brain went quiet: peers' figures no longer count
    assert r.route(fresh).node_id == idle_choice


def test_peers_placements_are_claimed_in_the_index_and_own_ones_skipped() -> None:
    clock = Clock()
    r = Router.from_table(table("a", "b"), clock=clock)
    relay = LoadRelay("b")
    relay.accept(RouterLoad(router_id="peer", seq=1, placed=[Placed(node_id="b", blocks=list(BLOCKS[:10]))]), 0.0)
    relay.accept(RouterLoad(router_id=r.router_id, seq=1, placed=[Placed(node_id="a", blocks=list(BLOCKS))]), 0.0)
    sums = relay.due(0.0)
    assert sums is not None and [p.router_id for p in sums.placed] == ["peer", r.router_id]
    r.apply_cluster_load(sums.loads, sums.placed)
    assert r.index.match(list(BLOCKS), clock.now) == {"b": 10}, "its own placement came back and was skipped"
    clock.now += Settings().placed_ttl_s + 1
    assert r.index.match(list(BLOCKS), clock.now) == {}, "claims expire as the router's own do"
    assert relay.due(0.1) is None
    refresh = relay.due(1.0)
    assert refresh is not None and refresh.placed == [], "placements go out once"


def test_relay_bounds_the_placements_it_holds() -> None:
    relay = LoadRelay("b", max_placed=15)
    relay.accept(RouterLoad(router_id="r", seq=1, placed=[Placed(node_id="a", blocks=list(BLOCKS[:10]))] * 2), 0.0)
    sums = relay.due(0.0)
    assert sums is not None and len(sums.placed) == 1 and relay.counts["placed_dropped"] == 1


def test_router_subtracts_its_own_report_from_the_sums() -> None:
    clock = Clock()
    r = Router.from_table(table("a", "b"), clock=clock)
    lease = r.request(Request(blocks=BLOCKS, cost=len(PROMPT), block_size=BLOCK))
    lease.begin()
    mine = r.load_report()
    assert mine is not None
    r.apply_cluster_load(mine.loads)  # the sums hold this router's work alone
    assert r._peer_load == {}
    r.apply_cluster_load({lease.node_id: len(PROMPT) + 300.0})
    assert r._peer_load == {lease.node_id: 300.0}


def _prompt(n: int) -> Request:
    tokens = [t + 1_000_000 * n for t in range(1000)]
    return Request(blocks=tuple(block_hashes(tokens, BLOCK)), cost=len(tokens), block_size=BLOCK)


def _echo_run(routers: int) -> tuple[str, str]:
    """Where a router puts two new prompts after its peers' sums arrive: 'a' holds this router's 1,000 tokens
    and 3,500 of its peers', 'b' 2,000 of its peers'."""
    clock = Clock()
    r = Router.from_table(table("a", "b"), clock=clock)
    r.apply_cluster_load({"b": 100_000.0})
    r.request(_prompt(0)).begin()  # lands on the idle 'a'
    mine = r.load_report()
    assert mine is not None and mine.loads == {"a": 1000.0}
    r.apply_cluster_load({"a": 4500.0, "b": 2000.0}, routers=routers)
    first = r.request(_prompt(1))
    first.begin()
    return first.node_id, r.request(_prompt(2)).node_id


def test_peers_are_taken_to_place_alike_until_their_next_sums() -> None:
    # With three peers queueing 5,500 tokens to this router's 1,000, each token it places counts as three of
    # theirs too until the next sums: a burst it places is spread as the peers' part of it would be.
    assert _echo_run(routers=4) == ("b", "a")
    # Alone (the sums are its own) it counts only what it knows: both go to the emptier 'b'.
    assert _echo_run(routers=1) == ("b", "b")


def test_new_sums_replace_the_echo_of_placements() -> None:
    clock = Clock()
    r = Router.from_table(table("a", "b"), clock=clock)
    sums = {"a": 6000.0, "b": 8500.0}
    r.apply_cluster_load(sums, routers=4)  # busy peers, an idle router: each token it places echoes three times
    first = r.request(_prompt(1))
    first.begin()
    assert first.node_id == "a"
    assert r.route(_prompt(2)).node_id == "b", "a: 6,000 + 1,000 + 3 × 1,000 echoed + 1,000 over b's 9,500"
    r.apply_cluster_load(sums, routers=4)  # the next sums: the peers placed nothing meanwhile after all
    assert r.route(_prompt(2)).node_id == "a", "a: 8,000 with the echo gone"


def test_spread_takes_the_entry_each_copy_of_a_burst_would_fill() -> None:
    # (expected time, the request's own part) per entry: copies fill 0 (1 -> 2), then 1 (1.5 -> 2.5), then 0 again.
    expected = {0: (1.0, 1.0), 1: (1.5, 1.0), 2: (10.0, 1.0)}
    slot = 1 << 32
    assert _spread(expected, 1, slot - 1) == 0, "one copy: the least expected time, whatever the draw"
    assert [_spread(expected, 3, k * slot // 3 + 1) for k in range(3)] == [0, 1, 0]
    assert all(_spread(expected, 3, d) != 2 for d in range(0, slot, slot // 97)), "never past the burst's fill"


def _burst(routers: int, queued: dict[str, float]) -> list[list[str]]:
    """Where four routers, each told the same sums for `routers` routers, put two new prompts each before the
    next sums: every router's picks, in order."""
    names = sorted(queued)
    picks = []
    for k in range(4):
        r = Router.from_table(table(*names), clock=Clock())
        r.apply_cluster_load(queued, routers=routers)
        mine = []
        for n in range(2):
            lease = r.request(_prompt(10 * k + n))
            lease.begin()
            mine.append(lease.node_id)
        picks.append(mine)
    return picks


def test_routers_placing_a_burst_at_once_spread_it_over_the_emptiest_nodes() -> None:
    queued = {f"n{i}": 100.0 * i for i in range(8)}  # n0 empty, n7 700 tokens behind: less than one prompt apart
    alone = _burst(1, queued)
    assert [p[0] for p in alone] == ["n0"] * 4, "a router alone takes the least expected time"
    shared = _burst(4, queued)
    firsts = [p[0] for p in shared]
    assert len(set(firsts)) > 1, f"four routers' first picks all on one node: {firsts}"
    placed = [node for p in shared for node in p]
    assert max(placed.count(node) for node in placed) <= 3 and set(placed) <= {"n0", "n1", "n2", "n3", "n4"}, placed


def test_a_burst_sharing_a_cached_prefix_stays_with_the_node_that_holds_it() -> None:
    # 'a' holds 60 of a 64-block context and has 1,000 tokens queued; 'b'...'d' are idle and hold nothing. Each prompt
    # adds a different tail to the context: on 'a' its 4 new blocks, elsewhere all 68.
    context = list(range(64 * BLOCK))
    held = tuple(block_hashes(context, BLOCK))[:60]
    picks = []
    for k in range(4):
        r = Router.from_table(table("a", "b", "c", "d"), clock=Clock())
        r.apply_kv("a", True, held, ())
        r.apply_cluster_load({"a": 1000.0}, routers=4)
        for n in range(2):
            tokens = context + [2_000_000 + 100 * k + 10 * n + t for t in range(4 * BLOCK)]
            lease = r.request(Request(blocks=tuple(block_hashes(tokens, BLOCK)), cost=len(tokens), block_size=BLOCK))
            lease.begin()
            picks.append(lease.node_id)
    assert picks == ["a"] * 8, "the draw stays within what the cache rule prefers"


def test_a_lull_keeps_the_peers_share() -> None:
    r = Router.from_table(table("a", "b"), clock=Clock())
    r.apply_cluster_load({"a": 3000.0}, routers=4)  # three busy peers, this router idle
    assert r._echo == 3.0
    r.apply_cluster_load({}, routers=4)  # the cluster went idle: the next burst still comes from every router
    assert r._echo == 3.0
    alone = Router.from_table(table("a", "b"), clock=Clock())
    alone.apply_cluster_load({"a": 3000.0}, routers=1)
    assert alone._echo == 0.0, "no peers, no echo"


# --- over ZeroMQ, through the brain service -----------------------------------------------------------------


def test_two_routers_see_each_others_queue_through_the_brain() -> None:
    with running_brain() as brain, zmq.Context() as ctx, VectorSender(ctx, brain.config.ingest) as sender:
        address = BrainAddress(brain.config.updates, brain.config.snapshot)
        with Router.connect(address) as one, Router.connect(address) as two:
            for seq, name in enumerate(("n1", "n2")):
                sender.send(
                    NodeVector(
                        node_id=name,
                        host=name,
                        endpoint=f"http://{name}:8000",
                        seq=seq,
                        sample_time_unix_s=time.time(),
                        period_s=1.0,
                        metrics=NodeMetrics(cpu_util_ratio=0.1, requests_running=0, requests_waiting=0),
                    )
                )
            assert one.wait_for_table(15) and two.wait_for_table(15)
            assert wait_for(lambda: all(len(r.status()) == 2 for r in (one, two)))
            request = Request(blocks=BLOCKS, cost=len(PROMPT), block_size=BLOCK)
            lease = one.request(request)
            lease.begin()
            busy = lease.node_id
            assert wait_for(lambda: two._peer_load.get(busy) == float(len(PROMPT)))
            assert two.index.match(list(BLOCKS), time.monotonic()) == {busy: len(BLOCKS)}, "the placement is shared"
            other = Request(blocks=OTHER, cost=len(PROMPT), block_size=BLOCK)
            assert two.route(other).node_id != busy, "the second router sends another prompt to the idle node"
            assert one._peer_load.get(busy) is None, "a router does not count its own work twice"
            lease.first_token()
            assert wait_for(lambda: busy not in two._peer_load)
            assert brain.loads.routers == 2
            published = brain.metrics.get_sample_value("prism_brain_router_load_total", {"kind": "published"})
            assert published is not None and published >= 2


def test_routers_that_do_not_share_load_send_and_take_nothing() -> None:
    r = Router.connect(BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"))
    quiet = Router.connect(
        BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"),
        settings=Settings(share_load=False),
    )
    try:
        assert r._subscriber is not None and quiet._subscriber is not None
        assert ClusterLoad in r._subscriber._kinds and ClusterLoad not in quiet._subscriber._kinds
        assert quiet._subscriber._load_report is None
    finally:
        r.close()
        quiet.close()


# --- in the replay ------------------------------------------------------------------------------------------


def test_shared_queues_keep_several_gateways_from_piling_onto_one_node() -> None:
    workload = family_workload("tenants", 800)
    scaled = scale_to_utilisation(workload, 1.5, capacity(TEXT_CLUSTER)[0])
    p99 = {}
    for share in (True, False):
        policy = PrismPolicy(block_tokens=workload.block_tokens, gateways=8, settings=Settings(share_load=share))
        result = Simulation(scaled, policy, TEXT_CLUSTER, utilisation=1.5, seed=1).run()
        p99[share] = result.slices["all"].ttft_p99_ms
        if share:
            assert policy.loads.counts["reports"] > 0 and policy.loads.routers == 8
    assert p99[True] < p99[False], p99
