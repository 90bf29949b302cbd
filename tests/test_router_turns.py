"""The router's waiting room (`Router.turn`, `Settings.hold_tokens`): who waits, in what order, and what lets go."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from prismlb.router import Lease, Request, Router, Settings
from prismlb.router._metrics import RouterCollector
from prismlb.sim._cluster import NodeSpec, Simulation
from prismlb.sim._prism import PrismPolicy
from prismlb.sim._types import SimRequest, Workload
from prismlb.wire import RoutingTable, SliceTable, TableNode

from .conftest import Clock

RATE = 10_000.0  # prompt tokens per second on every node of the table


def router(nodes: int = 1, *, clock: Clock | None = None, **settings: object) -> Router:
    """A router on one slice of `nodes` entries of known speed; `hold_tokens` 1,000 unless `settings` say."""
    entries = [
        TableNode(node_id=f"n{i}", endpoint=f"http://n{i}:8000", weight=1.0, prefill_tokens_per_s=RATE)
        for i in range(nodes)
    ]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=entries)])
    values = {"hold_tokens": 1000, **settings}
    return Router.from_table(table, settings=Settings(**values), clock=clock or Clock())  # type: ignore[arg-type]


def placed(r: Router, cost: int, **fields: object) -> Lease:
    """A request granted its turn at once, placed and begun."""
    ticket = r.turn(Request(cost=cost, **fields))  # type: ignore[arg-type]
    assert ticket.granted
    lease = r.request(ticket.request, turn=ticket)
    lease.begin()
    return lease


def test_on_by_default_off_at_0_and_without_prefill_load() -> None:
    assert Router(settings=Settings()).holds
    assert not Router(settings=Settings(hold_tokens=0)).holds
    assert not Router(settings=Settings(load="requests")).holds
    with pytest.raises(ValueError, match="hold_tokens"):
        Settings(hold_tokens=-1)
    with pytest.raises(ValueError, match="hold_max_s"):
        Settings(hold_max_s=0)
    with pytest.raises(ValueError, match="assumed_prefill_tokens_per_s"):
        Settings(assumed_prefill_tokens_per_s=float("nan"))
    with pytest.raises(ValueError, match="slo_s"):
        Request(slo_s=0)


def test_a_request_waits_while_every_entry_is_full_and_goes_at_the_first_token() -> None:
    r = router(2)
    registry = CollectorRegistry()
    registry.register(RouterCollector(r))
    first, second = placed(r, 2000), placed(r, 2000)  # both entries over 1,000 queued tokens
    ticket = r.turn(Request(cost=10))
    assert not ticket.granted and registry.get_sample_value("prism_router_waiting_requests") == 1
    first.first_token()  # its entry's queue falls to 0
    assert ticket.granted and registry.get_sample_value("prism_router_waiting_requests") == 0
    second.end()
    assert r.turns.counts == {"granted": 3, "expired": 0, "left": 0, "passed": 0}
    assert registry.get_sample_value("prism_router_turns_total", {"outcome": "granted"}) == 3


def test_turns_go_by_deadline_one_at_a_time_each_seeing_the_queue_the_last_left() -> None:
    clock = Clock()
    r = router(1, clock=clock)
    busy = placed(r, 2000)
    long_prompt = r.turn(Request(cost=40_000))  # SLO 5 x 4 s = 20 s
    clock.now += 1.0
    short = r.turn(Request(cost=100))  # SLO τ0 = 0.8 s: due at 1.8 s, before the long prompt's 20 s
    custom = r.turn(Request(cost=100, slo_s=30.0))  # the caller's own SLO: due at 31 s
    assert short.deadline == pytest.approx(101.8) and long_prompt.deadline == pytest.approx(120.0)  # Clock: 100 s
    busy.first_token()
    assert short.granted and not long_prompt.granted and not custom.granted
    r.request(short.request, turn=short).begin()  # 100 tokens queued: room still, so the next goes
    assert long_prompt.granted and not custom.granted
    r.request(long_prompt.request, turn=long_prompt).begin()  # 40,100 queued: the entry is full again
    assert not custom.granted


def test_a_prompt_cached_but_for_a_few_tokens_takes_no_turn() -> None:
    r = router(2)  # hold_tokens 1,000; hold_cached_tokens 1,024 by default
    blocks = tuple(range(1, 65))  # 64 blocks of 16 tokens: 1,024 tokens
    placed(r, 2000), placed(r, 2000)  # both entries over 1,000 queued tokens: the room is shut
    r.index.stored("n1", blocks[:40])
    uncached_short = r.turn(Request(cost=100))
    cached_rest_1000 = r.turn(Request(cost=1024 + 600, blocks=blocks, block_size=16))  # 40 blocks held: 1,000 to go
    cached_rest_1100 = r.turn(Request(cost=1024 + 700, blocks=blocks, block_size=16))  # 1,100 to go: waits
    assert not uncached_short.granted and not cached_rest_1100.granted
    assert cached_rest_1000.granted and r.turns.counts["passed"] == 1 and r.turns.waiting == 2
    # Its lease is placed on the holder, and frees no one else's turn.
    assert r.request(cached_rest_1000.request, turn=cached_rest_1000).node_id == "n1"
    assert r.turns.waiting == 2
    # Off at 0, and without a holder in the index (a router that knows of none) the request waits.
    off = router(2, hold_cached_tokens=0)
    placed(off, 2000), placed(off, 2000)
    off.index.stored("n1", blocks[:40])
    assert not off.turn(Request(cost=1024 + 600, blocks=blocks, block_size=16)).granted
    elsewhere = router(2)
    placed(elsewhere, 2000), placed(elsewhere, 2000)
    assert not elsewhere.turn(Request(cost=1024 + 600, blocks=blocks, block_size=16)).granted
    with pytest.raises(ValueError, match="hold_cached_tokens"):
        Settings(hold_cached_tokens=-1)


def test_a_request_too_late_for_its_deadline_goes_after_those_still_in_time() -> None:
    clock = Clock()
    r = router(1, clock=clock)
    busy = placed(r, 2000)
    doomed = r.turn(Request(cost=100))  # due 0.8 s from now, its own prefill 10 ms: late 2 x 10 ms before that
    assert doomed.late_at == pytest.approx(doomed.deadline - 0.02)
    clock.now += 0.5
    in_time = r.turn(Request(cost=1000))  # 0.1 s alone, SLO 0.8 s: due at 100.5 + 0.8 s, after the first's
    clock.now += 0.4  # the first is now late (0.9 s waited), the second is not (0.2 s of margin left is 0.4 s)
    busy.first_token()
    assert in_time.granted and not doomed.granted
    r.request(in_time.request, turn=in_time).begin()  # 1,000 queued: room still, so the late one goes next
    assert doomed.granted
    assert r.turns.counts == {"granted": 3, "expired": 0, "left": 0, "passed": 0}


def test_lateness_counts_late_margin_times_the_prefill_on_the_quickest_entry() -> None:
    """The deadline holds a request to the slice's median entry (of two, the slower); lateness asks whether it could
    still start in time where it would start soonest, so one slowed GPU does not make every request late."""
    entries = [
        TableNode(node_id="fast", endpoint="http://fast:8000", weight=1.0, prefill_tokens_per_s=20_000.0),
        TableNode(node_id="slow", endpoint="http://slow:8000", weight=1.0, prefill_tokens_per_s=2_000.0),
    ]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=entries)])
    for margin, before_s in ((2.0, 1.0), (1.0, 0.5), (0.0, 0.0)):
        r = Router.from_table(table, settings=Settings(hold_tokens=1000, late_margin=margin), clock=Clock())
        ticket = r.turn(Request(cost=10_000))  # 5 s alone on the slow entry (SLO 25 s), 0.5 s on the fast one
        assert ticket.deadline == pytest.approx(100.0 + 25.0)
        assert ticket.deadline - ticket.late_at == pytest.approx(before_s)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="late_margin"):
            Settings(late_margin=bad)


def test_under_a_tighter_slo_the_late_margin_keeps_its_share_of_the_budget() -> None:
    """Twice the prefill on the quickest entry at the default SLO (five times the prefill alone on a typical one), in
    proportion under a tighter one, the router's (`slo_scale`) or the request's own (`slo_s`); never more than twice."""
    entries = [
        TableNode(node_id="fast", endpoint="http://fast:8000", weight=1.0, prefill_tokens_per_s=20_000.0),
        TableNode(node_id="slow", endpoint="http://slow:8000", weight=1.0, prefill_tokens_per_s=2_000.0),
    ]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=entries)])
    for scale, slo_s, budget_s, before_s in (
        (5.0, None, 25.0, 1.0),  # 5 s alone on the typical entry, 0.5 s on the quickest: late 2 x 0.5 s before
        (10.0, None, 50.0, 1.0),
        (3.0, None, 15.0, 0.6),  # three fifths of the default's budget: three fifths of its margin
        (5.0, 7.5, 7.5, 0.3),
        (5.0, 100.0, 100.0, 1.0),
    ):
        r = Router.from_table(table, settings=Settings(hold_tokens=1000, slo_scale=scale), clock=Clock())
        ticket = r.turn(Request(cost=10_000, slo_s=slo_s))
        assert ticket.deadline == pytest.approx(100.0 + budget_s)
        assert ticket.deadline - ticket.late_at == pytest.approx(before_s), (scale, slo_s)


def test_deadlines_follow_the_services_slo_scale_and_a_requests_own_slo() -> None:
    """The room orders by the SLO the service keeps (`Settings.slo_scale` times the prefill alone, floored at τ0), so
    the same two requests go in another order under another SLO; `Request.slo_s` overrides it."""
    for scale, due_s in ((5.0, 5.0), (10.0, 10.0), (1.0, 1.0)):
        r = router(1, slo_scale=scale)
        assert r.turn(Request(cost=10_000)).deadline == pytest.approx(100.0 + due_s)  # 1 s alone at RATE
        assert r.turn(Request(cost=100)).deadline == pytest.approx(100.0 + 0.8), "τ0 floors a short prompt's SLO"
        assert r.turn(Request(cost=10_000, slo_s=2.0)).deadline == pytest.approx(102.0)
    for scale, first in ((2.0, "long"), (10.0, "short")):
        clock = Clock()
        r = router(1, clock=clock, slo_scale=scale)
        busy = placed(r, 2000)
        long = r.turn(Request(cost=3000))  # 0.3 s alone: due in 0.8 s at 2 times (τ0), in 3 s at 10 times
        clock.now += 0.2
        short = r.turn(Request(cost=100))  # due in 0.8 s, 0.2 s later: after the long one at 2 times, before at 10
        busy.first_token()
        assert (long.granted, short.granted) == ((True, False) if first == "long" else (False, True))
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="slo_scale"):
            Settings(slo_scale=bad)


def test_one_slowed_entry_does_not_stretch_every_deadline() -> None:
    """Seven entries at 10,000 tokens/s and one throttled to a third: a request's deadline is its SLO at a typical
    entry's speed (5 x 1 s), not at the sick one's (5 x 3 s), so the room's order does not follow the sick node."""
    speeds = [RATE] * 7 + [RATE / 3]
    entries = [
        TableNode(node_id=f"n{i}", endpoint=f"http://n{i}:8000", weight=1.0, prefill_tokens_per_s=speed)
        for i, speed in enumerate(speeds)
    ]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=entries)])
    r = Router.from_table(table, settings=Settings(hold_tokens=1000), clock=Clock())
    assert r.turn(Request(cost=10_000)).deadline == pytest.approx(100.0 + 5.0)


def test_the_callers_own_speeds_alone_do_not_put_the_room_in_seconds() -> None:
    """Before any engine has measured its speed, this router's first tokens order the nodes, but they read the
    queue and the hop too, here 500 and 250 tokens/s where the engines do 10,000 and 5,000: the room counts 800
    queued tokens as 800, not as the 16,000 they would be at 500 tokens/s, and a deadline is the SLO at the
    assumed speed. Once a table gives one engine's measure, every speed is on its scale, in seconds."""
    clock = Clock()
    entries = [TableNode(node_id=f"n{i}", endpoint=f"http://n{i}:8000", weight=1.0) for i in range(2)]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=entries)])
    r = Router.from_table(table, settings=Settings(hold_tokens=1000), clock=clock)
    for node, seconds in (("n0", 1.0), ("n1", 2.0)):  # each node's first answer: 500 prompt tokens
        ticket = r.turn(Request(cost=500))
        lease = r.request(ticket.request, turn=ticket, exclude={"n0", "n1"} - {node})
        lease.begin()
        clock.now += seconds
        lease.first_token()
        lease.end()
    r.apply(msgspec.structs.replace(table, version=2))  # the speeds a table is built with: its next version's
    assert r.status()["n1"].first_token_speed == pytest.approx(250.0)
    queued = [placed(r, 800) for _ in range(2)]
    assert {lease.node_id for lease in queued} == {"n0", "n1"}

    def room_and_deadline_s() -> tuple[bool, float]:
        short, long_prompt = r.turn(Request(cost=10)), r.turn(Request(cost=20_000))
        r.leave(short)
        r.leave(long_prompt)
        return short.granted, long_prompt.deadline - clock.now

    assert room_and_deadline_s() == (True, pytest.approx(10.0)), "800 tokens: room; 5 x 2 s at the assumed speed"
    measured = [msgspec.structs.replace(entries[0], prefill_tokens_per_s=10_000.0), entries[1]]
    r.apply(msgspec.structs.replace(table, version=3, slices=[SliceTable(name="llm", nodes=measured)]))
    assert room_and_deadline_s() == (True, pytest.approx(20.0)), "800 tokens at 10,000/s; 5 x 4 s at n1's 5,000/s"
    for lease in queued:
        lease.end()


def test_a_caller_may_stop_waiting_and_no_request_waits_longer_than_hold_max_s() -> None:
    clock = Clock()
    r = router(1, clock=clock, hold_max_s=5.0)
    placed(r, 2000)
    a, b = r.turn(Request(cost=10)), r.turn(Request(cost=20))
    r.leave(a)  # its caller gave up
    assert r.turns.counts["left"] == 1 and not b.granted
    assert r.turns.waiting == r.turns.rooms["llm"].waiting == 1
    clock.now += 5.0
    c = r.turn(Request(cost=30))  # any change of the room lets go what waited long enough
    assert b.granted and not c.granted
    assert r.turns.counts == {"granted": 1, "expired": 1, "left": 1, "passed": 0}
    assert r.turns.waiting == r.turns.rooms["llm"].waiting == 1
    r.leave(c)
    assert r.turns.waiting == r.turns.rooms["llm"].waiting == 0


def test_a_thread_and_a_coroutine_wait_for_their_turn_without_blocking_others() -> None:
    r = router(1, clock=Clock())
    busy = placed(r, 2000)
    sync = r.turn(Request(cost=10))
    waited: list[bool] = []
    thread = threading.Thread(target=lambda: waited.append(sync.wait(10.0)))
    thread.start()

    async def main() -> bool:
        ticket = r.turn(Request(cost=10, slo_s=60.0))
        waiting = asyncio.ensure_future(ticket.wait_async(10.0))
        await asyncio.sleep(0)
        assert not waiting.done()
        busy.first_token()  # lets the thread's ticket (the earlier deadline) go ...
        thread.join(10.0)
        r.request(sync.request, turn=sync).begin()  # ... whose placement (10 tokens) leaves room for the next
        return await waiting

    assert asyncio.run(main()) is True
    assert waited == [True]


def test_call_waits_for_its_turn_and_a_timed_out_wait_still_sends() -> None:
    r = router(1, hold_max_s=0.05, clock=time.monotonic)  # type: ignore[arg-type]
    busy = r.request(Request(cost=5000))
    busy.begin()
    assert r.call(Request(cost=10), lambda lease: lease.node_id) == "n0"  # reports no first token: goes at once
    assert r.turns.counts == {"granted": 0, "expired": 0, "left": 0, "passed": 0}
    started = time.monotonic()
    assert r.call(Request(cost=10), lambda lease: lease.node_id, first_tokens=True) == "n0"
    assert time.monotonic() - started >= 0.05  # it waited its hold_max_s, then went
    assert r.turns.counts["expired"] == 1


def test_a_replay_holds_requests_and_every_one_completes() -> None:
    """Through the simulator's `admit`/`released` seam: a burst on one node waits at the router and all of it is
    served in order of deadline (the table has no measured speed yet: `assumed_prefill_tokens_per_s`)."""
    requests = tuple(
        SimRequest(id=i, arrival_s=0.001 * i, input_tokens=tokens, output_tokens=2, blocks=(), signature="text")
        for i, tokens in enumerate([2000, 2000, 2500, 100, 2000, 100])
    )
    workload = Workload(name="burst", requests=requests, block_tokens=16, source="test")
    policy = PrismPolicy(block_tokens=16, settings=Settings(hold_tokens=1, prefix_index=False))
    held: list[int] = []
    admit = policy.admit

    def counted(request: SimRequest, now: float) -> bool:
        went = admit(request, now)
        held.append(policy.holding)
        return went

    policy.admit = counted  # type: ignore[method-assign]
    result = Simulation(workload, policy, [NodeSpec("n0", "a100")], utilisation=1.0, seed=0).run()
    assert max(held) == len(requests) - 1  # the first went at once; the rest waited behind its prefill
    assert len(result.ttft_s) == len(requests)
    order = sorted(result.ttft_s, key=lambda i: requests[i].arrival_s + result.ttft_s[i])
    # The first goes at once; the short ones (due τ0 = 0.8 s after arriving) overtake the long ones waiting (due
    # 5 x 0.2 s and 5 x 0.25 s after arriving), which go in order of deadline among themselves: each still in time.
    assert order == [0, 3, 5, 1, 4, 2]
    assert policy.routers[0].turns.counts == {"granted": len(requests), "expired": 0, "left": 0, "passed": 0}


def test_tickets_gone_from_a_lasting_backlog_do_not_pile_up_and_a_closed_loop_is_no_error() -> None:
    clock = Clock()
    r = router(1, clock=clock, hold_max_s=1.0)
    placed(r, 2000)  # the entry stays full: nothing is granted for room
    late = [r.turn(Request(cost=10, slo_s=3600.0)) for _ in range(3000)]  # due after everything that follows
    clock.now += 1.0
    for _ in range(3000):  # each join lets go, by their wait, those that waited 1 s: the late ones first
        r.turn(Request(cost=10))
        clock.now += 0.001
    assert all(t.granted for t in late) and r.turns.counts["expired"] >= 3000
    room = r.turns.rooms["llm"]
    assert len(room.by_deadline) <= max(1024, 2 * r.turns.waiting) + 1

    ticket = r.turn(Request(cost=10))
    loop = asyncio.new_event_loop()
    ticket._future = (loop, loop.create_future())  # a coroutine's wait whose loop has since closed
    loop.close()
    clock.now += 1.0
    r.turn(Request(cost=10))  # it is let go by its wait, here, without raising
    assert ticket.granted
