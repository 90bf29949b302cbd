"""Queued prefill shared between routers: each router's report, the brain's sums, each router's peers' share."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import zmq
from prometheus_client import CollectorRegistry

from prismlb.brain import LoadRelay
from prismlb.router import Lease, Request, Router, Settings, block_hashes
from prismlb.router._metrics import RouterCollector
from prismlb.router._router import _spread, _urgency
from prismlb.router._turns import Ticket
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
    Placed,
    RoomHead,
    RouterLoad,
    RoutingTable,
    SliceTable,
    TableNode,
    VectorSender,
    WireError,
    decode,
    encode,
)

from .conftest import Clock, free_port, idle_vector, running_brain, wait_for

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


# --- one order over every router's waiting room --------------------------------------------------------------


def test_relay_passes_on_each_slices_two_most_urgent_room_heads_aged_to_the_sums() -> None:
    relay = LoadRelay("b")
    relay.accept(RouterLoad(router_id="r1", seq=1, heads=[RoomHead(slice="llm", due_s=1.0)]), 0.0)
    relay.accept(
        RouterLoad(
            router_id="r2",
            seq=1,
            heads=[RoomHead(slice="llm", due_s=0.4), RoomHead(slice="vlm", late_s=0.2)],
        ),
        0.0,
    )
    relay.accept(RouterLoad(router_id="r3", seq=1, heads=[RoomHead(slice="llm", late_s=5.0)]), 0.0)
    sums = relay.due(0.1)
    assert sums is not None
    # llm's first is in time, vlm's late: llm first; in each, in time before late, the longest late first.
    assert [(h.slice, h.router_id) for h in sums.heads] == [("llm", "r2"), ("llm", "r1"), ("vlm", "r2")]
    assert [h.due_s for h in sums.heads[:2]] == [pytest.approx(0.3), pytest.approx(0.9)]
    assert sums.heads[2].late_s == pytest.approx(0.3)
    relay.accept(RouterLoad(router_id="r2", seq=2), 0.2)  # r2's rooms emptied: r3's late head is second now
    sums = relay.due(0.3)
    assert sums is not None and [(h.router_id, h.late_s) for h in sums.heads] == [
        ("r1", None),
        ("r3", pytest.approx(5.3)),
    ]
    assert decode(encode(sums), (ClusterLoad,), 65536) == sums
    for bad in (RoomHead(slice="llm", due_s=-1.0), RoomHead(slice="llm", late_s=float("nan")), RoomHead(slice="")):
        with pytest.raises(WireError):
            decode(encode(RouterLoad(router_id="r1", seq=3, heads=[bad])), (RouterLoad,), 65536)


def _held(clock: Clock, **settings: object) -> tuple[Router, Lease]:
    """A router of one entry (hold 1,000 tokens) whose entry is full, 2,000 tokens queued there, as it reported."""
    r = Router.from_table(table("n0"), settings=Settings(hold_tokens=1000, **settings), clock=clock)  # type: ignore[arg-type]
    ticket = r.turn(Request(cost=2000))
    assert ticket.granted
    lease = r.request(ticket.request, turn=ticket)
    lease.begin()
    assert r.load_report() is not None
    return r, lease


def test_router_reports_its_room_heads_as_they_change() -> None:
    clock = Clock()
    r, _ = _held(clock)
    assert r.load_report() is None
    waiting = r.turn(Request(cost=100))  # due 0.8 s from now (τ0)
    first = r.load_report()
    assert first is not None and first.heads == [RoomHead(slice="llm", due_s=pytest.approx(0.8))]
    clock.now += 0.3
    assert r.load_report() is None, "the same head, nearer its deadline: nothing new to say"
    sooner = r.turn(Request(cost=100, slo_s=0.2))
    second = r.load_report()
    assert second is not None and second.heads == [RoomHead(slice="llm", due_s=pytest.approx(0.2))]
    clock.now += 0.25  # the sooner one is late (its deadline passed): the one in time is the head again
    third = r.load_report()
    assert third is not None and third.heads == [RoomHead(slice="llm", due_s=pytest.approx(0.25))]
    clock.now += 0.45  # both late: the first to be so is the head, late since its deadline less 2 x 10 ms
    fourth = r.load_report()
    assert fourth is not None and fourth.heads == [RoomHead(slice="llm", late_s=pytest.approx(0.52))]
    assert not (waiting.granted or sooner.granted)
    quiet, _ = _held(Clock(), share_turns=False)
    quiet.turn(Request(cost=100))
    assert quiet.load_report() is None, "share_turns=False: a request waiting changes nothing the report says"


def test_a_router_leaves_the_turn_to_a_peer_whose_head_is_due_sooner() -> None:
    clock = Clock()
    r, busy = _held(clock)
    mine = r.turn(Request(cost=100))  # due at 100.8
    busy.first_token()  # its own queue empties: room, and nothing else queued
    assert mine.granted, "an idle engine is filled at once, whoever's turn it is"
    r.request(mine.request, turn=mine).end()
    r, busy = _held(clock)
    mine = r.turn(Request(cost=100))
    peer = RoomHead(slice="llm", due_s=0.1, router_id="peer")  # due at 100.1, before this router's head
    r.apply_cluster_load({"n0": 2700.0}, heads=[peer])  # the peers have 700 tokens queued there
    busy.first_token()  # 700 queued: room (1,000), but more than half of it, so the peer's head goes first
    assert not mine.granted and r.turns.deferred == 1
    registry = CollectorRegistry()
    registry.register(RouterCollector(r))
    assert registry.get_sample_value("prism_router_turns_deferred_total") == 1
    r.apply_cluster_load({"n0": 2400.0}, heads=[peer])  # 400 queued: the engine would idle before the peer acts
    assert mine.granted
    r.request(mine.request, turn=mine).end()
    r, busy = _held(clock)
    mine = r.turn(Request(cost=100))
    r.apply_cluster_load({"n0": 2700.0}, heads=[peer])
    busy.first_token()
    assert not mine.granted
    own = RoomHead(slice="llm", due_s=0.05, router_id=r.router_id)
    r.apply_cluster_load({"n0": 2700.0}, heads=[own])  # the peer let its head go: only this router's own is left
    assert mine.granted
    r.request(mine.request, turn=mine).end()


def test_a_late_head_waits_for_a_peers_in_time_one_and_a_stale_peer_head_counts_no_more() -> None:
    clock = Clock()
    r, busy = _held(clock)
    late = r.turn(Request(cost=100))
    clock.now += 1.0  # late
    r.apply_cluster_load({"n0": 2700.0}, heads=[RoomHead(slice="llm", due_s=5.0, router_id="peer")])
    busy.first_token()
    assert not late.granted, "a late request goes after a peer's request still in time, however far its deadline"
    r.apply_cluster_load({"n0": 2700.0}, heads=[RoomHead(slice="llm", late_s=0.1, router_id="peer")])
    assert late.granted, "a peer's request late since after this one became late goes after it"
    r.request(late.request, turn=late).end()
    r, busy = _held(clock)
    r.apply_cluster_load({"n0": 2700.0}, heads=[RoomHead(slice="llm", due_s=0.01, router_id="peer")])
    busy.first_token()
    clock.now += Settings().peer_load_ttl_s + 0.1  # the brain went silent: its figures and heads are stale
    assert r.turn(Request(cost=100)).granted
    off, busy = _held(clock, share_turns=False)
    off.apply_cluster_load({"n0": 2700.0}, heads=[RoomHead(slice="llm", due_s=0.01, router_id="peer")])
    ticket = off.turn(Request(cost=100))
    busy.first_token()
    assert ticket.granted, "share_turns=False: the router keeps its own order alone"


def test_two_routers_see_each_others_queue_through_the_brain() -> None:
    with running_brain() as brain, zmq.Context() as ctx, VectorSender(ctx, brain.config.ingest) as sender:
        address = BrainAddress(brain.config.updates, brain.config.snapshot)
        with Router.connect(address) as one, Router.connect(address) as two:
            for seq, name in enumerate(("n1", "n2")):
                sender.send(idle_vector(name, f"http://{name}:8000", seq, host=name))
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


def test_a_routers_room_head_reaches_its_peer_through_the_brain() -> None:
    settings = Settings(hold_tokens=10)
    with running_brain() as brain, zmq.Context() as ctx, VectorSender(ctx, brain.config.ingest) as sender:
        address = BrainAddress(brain.config.updates, brain.config.snapshot)
        with Router.connect(address, settings=settings) as one, Router.connect(address, settings=settings) as two:
            sender.send(idle_vector("n1", "http://n1:8000"))
            assert one.wait_for_table(15) and two.wait_for_table(15)
            busy = one.request(Request(cost=500))  # the one node full: 500 tokens queued, room for 10
            busy.begin()
            waiting = one.turn(Request(cost=100))
            assert not waiting.granted
            slice_key = waiting.slice_key
            assert wait_for(lambda: slice_key in two._peer_heads), "the head went out in a report and came back"
            assert slice_key not in one._peer_heads, "a router's own head is not its peer's"
            assert two._peer_heads[slice_key][1] == pytest.approx(waiting.deadline, abs=0.5)  # on two's own clock
            busy.first_token()
            assert waiting.granted
            one.request(waiting.request, turn=waiting).end()
            busy.end()
            assert wait_for(lambda: slice_key not in two._peer_heads)


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


def test_routers_sharing_their_room_heads_let_fewer_requests_go_before_a_peers_sooner_one() -> None:
    workload = family_workload("tenants", 800)
    scaled = scale_to_utilisation(workload, 3.0, capacity(TEXT_CLUSTER)[0])
    jumped: dict[bool, float] = {}
    attained: dict[bool, float] = {}
    for share in (True, False):
        policy = PrismPolicy(block_tokens=workload.block_tokens, gateways=4, settings=Settings(share_turns=share))
        counts = [0, 0]  # turns given for room; of those, while a peer held a request due sooner

        def counted(router: Router, grant: Callable[..., None]) -> Callable[..., None]:
            def wrapped(ticket: Ticket, now: float, *, expired: bool = False) -> None:
                if not expired:
                    rooms = [p.turns.rooms.get(ticket.slice_key) for p in policy.routers if p is not router]
                    heads = [room.head(now) for room in rooms if room is not None]
                    counts[0] += 1
                    counts[1] += any(h is not None and _urgency(h, now) < _urgency(ticket, now) for h in heads)
                grant(ticket, now, expired=expired)

            return wrapped

        for router in policy.routers:
            router.turns.grant = counted(router, router.turns.grant)  # type: ignore[method-assign]
        result = Simulation(scaled, policy, TEXT_CLUSTER, utilisation=3.0, seed=1).run()
        jumped[share] = counts[1] / counts[0]
        attained[share] = result.slices["all"].slo_attainment
    assert jumped[True] < jumped[False] and attained[True] > attained[False], (jumped, attained)
