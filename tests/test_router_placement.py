"""Placement by expected time to first token over the prefix index (`Settings.prefix_index`)."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from prismlb.router import Lease, Request, Router, Settings, Ticket, block_hashes, prefix_key, text_block_hashes
from prismlb.wire import RoutingTable, SliceTable, TableNode

from .conftest import Clock

BLOCK = 16
PROMPT = list(range(64 * BLOCK))
BLOCKS = tuple(block_hashes(PROMPT, BLOCK))
COST = len(PROMPT)


def table(*nodes: TableNode) -> RoutingTable:
    return RoutingTable(
        epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=list(nodes))]
    )


def node(
    name: str,
    *,
    weight: float = 1.0,
    rate: float | None = None,
    stall_ms: float | None = None,
    admit_ms: float | None = None,
) -> TableNode:
    return TableNode(
        node_id=name,
        endpoint=f"http://{name}:8000",
        weight=weight,
        prefill_tokens_per_s=rate,
        stall_ms=stall_ms,
        admit_ms=admit_ms,
    )


def router(*nodes: TableNode, **settings: object) -> tuple[Router, Clock]:
    clock = Clock()
    return Router.from_table(table(*nodes), settings=Settings(**settings), clock=clock), clock  # type: ignore[arg-type]


def request(blocks: tuple[int, ...] = BLOCKS, cost: int = COST, key: int | None = None) -> Request:
    return Request(key=key, blocks=blocks, cost=cost, block_size=BLOCK)


def sent(r: Router, req: Request, exclude: frozenset[str] | set[str] = frozenset()) -> Lease:
    lease = r.request(req, exclude=exclude)
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


def test_with_prompt_fills_in_what_placement_reads_from_tokens_or_text() -> None:
    base = Request(session="s-1", modality="image+text", block_size=BLOCK)
    by_ids = base.with_prompt(PROMPT, prefix_tokens=64)
    assert (by_ids.cost, by_ids.blocks) == (COST, BLOCKS)
    assert by_ids.key == prefix_key(PROMPT, block_size=BLOCK, prefix_tokens=64)
    assert (by_ids.session, by_ids.modality, by_ids.block_size) == ("s-1", "image+text", BLOCK)
    assert Request(key="mine", block_size=BLOCK).with_prompt(PROMPT).key == "mine", "a key given is kept"
    text = "système: réponds brièvement.\n" * 20
    by_text = base.with_prompt(text=text)
    assert by_text.cost == -(-len(text.encode()) // 4) and by_text.blocks == tuple(text_block_hashes(text, BLOCK))
    assert base.with_prompt(text="").cost == 1 and base.with_prompt(text="").blocks == ()
    for wrong in ({}, {"tokens": PROMPT, "text": text}):
        with pytest.raises(ValueError, match="either"):
            base.with_prompt(**wrong)  # type: ignore[arg-type]
    image = [None, None, ["img-sha256-1"]]  # the third block holds an image's placeholder tokens
    with_media = base.with_prompt(PROMPT, extra=image)
    assert with_media.blocks == tuple(block_hashes(PROMPT, BLOCK, extra=image))
    assert with_media.blocks[:2] == BLOCKS[:2] and with_media.blocks[2] != BLOCKS[2]
    with pytest.raises(ValueError, match="tokens"):
        base.with_prompt(text=text, extra=image)


def test_a_request_with_its_prompt_goes_where_the_index_finds_it_and_a_bare_key_does_not() -> None:
    r, _ = router(node("a"), node("b"), node("c"))
    bare = Request(block_size=BLOCK).with_prompt(PROMPT)
    owner = owner_of(r, bare.key)  # type: ignore[arg-type]
    holder = next(n for n in "abc" if n != owner)
    r.index.stored(holder, BLOCKS)
    assert r.route(bare).node_id == holder
    assert r.route(Request(key=bare.key, block_size=BLOCK)).node_id == owner


def test_a_request_hashed_in_other_blocks_than_its_nodes_events_is_counted_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    r = Router(registry=registry, clock=Clock())
    r.apply(table(node("a"), node("b")))
    r.apply_kv("a", False, (7,), (), block_size=1)  # an SGLang engine left at page size 1
    r.apply_kv("b", False, (9,), (), block_size=BLOCK)
    with caplog.at_level(logging.WARNING, logger="prism.router"):
        for _ in range(3):
            r.request(request(), exclude=("b",)).begin()
        r.request(request(), exclude=("a",)).begin()
        r.request(Request(key=1), exclude=("b",)).begin()  # no blocks: nothing to match
    assert r.kv_block_size_mismatches == {"a": 3}
    warned = [m for m in caplog.messages if "blocks of 1 tokens" in m]
    assert len(warned) == 1 and "--page-size" in warned[0]
    assert registry.get_sample_value("prism_router_kv_block_size_mismatches_total", {"node": "a"}) == 3


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


@pytest.mark.parametrize("held", [16, 32, 63])
def test_a_busy_holder_keeps_the_request_within_the_affinity_factor_for_its_share(held: int) -> None:
    factor = 1 + (3.0 - 1) * held / len(BLOCKS)  # 1.5, 2 and about 3 for a quarter, half and all but one block
    kept = []
    for filler in range(16):
        r, _ = router(node("a"), node("b"), cache_affinity=3.0, balance=0)
        r.index.stored("a", BLOCKS[:held])  # a computes the blocks it lacks, b all 1024 tokens
        for i in range(filler):  # queued prefill work on a alone
            sent_to = r.request(request(tuple(block_hashes([i + 7] * BLOCK, BLOCK)), cost=256), exclude=["b"])
            sent_to.begin()
        expected_a = filler * 256 + COST - held * BLOCK
        stays = expected_a <= factor * COST
        assert r.route(request()).node_id == ("a" if stays else "b"), filler
        kept.append(stays)
    assert kept[0] and not kept[-1], "the queue grew past the factor"


def test_a_session_stays_on_its_node_within_the_affinity_factor_and_leaves_a_longer_queue() -> None:
    for filler in range(12):
        r, _ = router(node("a"), node("b"), cache_affinity=3.0, balance=0)
        first = Request(blocks=BLOCKS[:32], cost=COST // 2, block_size=BLOCK, session="s")
        home = r.request(first, exclude=["b"])
        home.first_token()
        home.end()
        for i in range(filler):  # queued prefill work on the session's node alone
            r.request(request(tuple(block_hashes([i + 7] * BLOCK, BLOCK)), cost=256), exclude=["b"]).begin()
        turn = Request(blocks=BLOCKS, cost=COST, block_size=BLOCK, session="s")  # the conversation goes on
        expected_a = filler * 256 + COST // 2  # its first half cached on a: the affinity for half the prompt, 2
        stays = expected_a <= 2.0 * COST
        lease = r.request(turn)
        assert lease.node_id == ("a" if stays else "b"), filler
        assert lease.moved_from == (None if stays else "a")  # a move names the node it left
    assert not stays, "the queue grew past the factor"


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


def test_a_network_stall_is_added_to_the_expected_time() -> None:
    r, _ = router(node("lossy", rate=10_000, stall_ms=100.0), node("sound", rate=10_000), balance=0)
    fresh = [tuple(block_hashes([i] * BLOCK * 16, BLOCK)) for i in range(1, 6)]
    chosen = [sent(r, request(b, cost=16 * BLOCK)).node_id for b in fresh]
    # 256 tokens each at 10,000 tokens/s: the sound node's queue passes the lossy node's 100 ms after four of them.
    assert chosen == ["sound"] * 4 + ["lossy"]


def test_a_wait_for_cache_room_stands_for_the_queue_while_longer() -> None:
    r, _ = router(node("full", rate=10_000, admit_ms=100.0), node("roomy", rate=10_000), balance=0)
    fresh = [tuple(block_hashes([i] * BLOCK * 16, BLOCK)) for i in range(1, 7)]
    chosen = [sent(r, request(b, cost=16 * BLOCK)).node_id for b in fresh]
    # 25.6 ms of prefill each: the roomy node's queue passes the full one's 100 ms wait after four of them; the two
    # sent to the full node wait for the same room, within it, so the second costs it no more than the first
    assert chosen == ["roomy"] * 4 + ["full"] * 2


def test_a_stall_is_ignored_while_no_prefill_speed_puts_expected_times_in_seconds() -> None:
    r, _ = router(node("lossy", stall_ms=5_000.0), node("sound"), balance=0)
    fresh = [tuple(block_hashes([i] * BLOCK, BLOCK)) for i in range(1, 41)]
    chosen = [sent(r, request(b, cost=BLOCK)).node_id for b in fresh]
    assert chosen.count("lossy") == chosen.count("sound") == 20  # equal queues, so the two alternate


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


@pytest.mark.parametrize("events", ["none", "evicted", "reset to nothing"])
def test_the_prefix_memory_stands_in_only_for_nodes_whose_cache_the_index_cannot_see(events: str) -> None:
    r, clock = router(node("a"), node("b"), load="prefill")
    first = sent(r, request(key=9))
    first.first_token()
    first.end()
    home, other = first.node_id, "b" if first.node_id == "a" else "a"
    clock.now += r.settings.placed_ttl_s + 1  # the placement's claim has expired: no node is known to hold the prompt
    if events != "none":  # the home engine's events say it evicted the prompt's first block
        r.apply_kv(home, False, (), BLOCKS[:1])
    if events == "reset to nothing":  # then a snapshot knows nothing of it (unknown or gone): unseen again
        r.apply_kv(home, True, (), ())
    busy = r.request(Request(key=1, cost=COST), exclude=[other])  # home has a prompt's worth queued, the other none
    busy.begin()
    assert busy.node_id == home
    # Unseen, home may still cache the prompt (the memory's guess); seen evicted, it is an uncached prompt like any
    # other, and goes where it starts soonest.
    assert r.request(request(key=9)).node_id == (other if events == "evicted" else home)


def test_for_text_blocks_the_prefix_memory_stands_on_nodes_that_report_events() -> None:
    """A caller without the model's tokenizer sends text blocks, which no KV event names: a node's events (of token
    blocks) say nothing of them, so once the placement's claim has expired the conversation's next turn still goes
    where its key last went. The same turn as token blocks the events cleared goes where it starts soonest."""
    r, clock = router(node("a"), node("b"), load="prefill")
    opening = "You are a careful assistant. " * 160  # past the key's 1,024-token window
    text = Request(block_size=BLOCK).with_prompt(text=opening + "First question?")
    tokens = request(key=text.key)
    assert not text.engine_blocks and tokens.engine_blocks
    first = sent(r, text)
    first.first_token()
    first.end()
    home, other = first.node_id, "b" if first.node_id == "a" else "a"
    clock.now += r.settings.placed_ttl_s + 1
    r.apply_kv(home, False, (), BLOCKS[:1])  # home's engine reports events: it evicted some token block
    busy = r.request(Request(key=1, cost=COST), exclude=[other])
    busy.begin()
    assert busy.node_id == home
    follow_up = Request(block_size=BLOCK).with_prompt(text=opening + "First question? An answer. Second question?")
    assert follow_up.key == text.key and r.index.match(follow_up.blocks, clock.now) == {}
    assert r.request(follow_up).node_id == home
    assert r.request(tokens).node_id == other


@pytest.mark.parametrize("text", [True, False])
def test_a_sessions_turn_in_text_blocks_finds_its_last_prompt_held_once_the_claims_expired(text: bool) -> None:
    """No event names text blocks, so once the placement's claims have expired the index knows nothing of a text
    conversation: its session's node is taken to hold the session's last prompt, and the turn stays there behind a
    queue within the affinity factor. A token turn the index knows nothing of (its engine evicted it, or never
    reported it) is an uncached prompt and goes where it starts soonest."""
    r, clock = router(node("a"), node("b"), load="prefill")
    opening = "You are a careful assistant. " * 160
    described = Request(session="s1", block_size=BLOCK)
    if text:
        first_turn = described.with_prompt(text=opening + "First question?")
        turn = described.with_prompt(text=opening + "First question? Yes. Second?")
    else:
        first_turn = described.with_prompt(PROMPT)
        turn = described.with_prompt([*PROMPT, *range(5000, 5000 + 2 * BLOCK)])
    first = sent(r, first_turn)
    first.first_token()
    first.end()
    home, other = first.node_id, "b" if first.node_id == "a" else "a"
    clock.now += r.settings.placed_ttl_s + 1
    busy = r.request(Request(key=1, cost=first_turn.cost * 3 // 2), exclude=[other])  # 1.5 prompts queued at home
    busy.begin()
    assert busy.node_id == home
    assert r.index.match(turn.blocks, clock.now) == {}
    assert r.request(turn).node_id == (home if text else other)


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


def test_the_affinity_grows_with_the_share_of_the_prompt_held() -> None:
    settings = Settings(cache_affinity=3.0)
    assert [settings.affinity(held, 6) for held in (0, 3, 6, 9)] == [1.0, 2.0, 3.0, 3.0]
    assert settings.affinity(0, 0) == 1.0 and Settings(cache_affinity=1.0).affinity(6, 6) == 1.0


# --- overflow entries: capable nodes outside the slice's pool ------------------------------------------------


def av_router(**settings: object) -> tuple[Router, Clock]:
    """An av slice: two pool nodes at 6,000 tokens/s, one overflow node at 20,000 (it is in llm's pool too)."""
    pool = [node("l1", rate=6000.0), node("l2", rate=6000.0)]
    spill = TableNode(node_id="h1", endpoint="http://h1:8000", weight=1.0, prefill_tokens_per_s=20_000.0, overflow=True)
    slices = [
        SliceTable(name="llm", nodes=[node("h1", rate=20_000.0)]),
        SliceTable(name="av", nodes=[*pool, spill]),
    ]
    clock = Clock()
    built = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=slices)
    return Router.from_table(built, settings=Settings(**settings), clock=clock), clock  # type: ignore[arg-type]


def prompt(n: int, cost: int, modality: str | None = None) -> Request:
    """The n-th of prompts that share no block, `cost` tokens long."""
    tokens = [t + 1_000_000 * n for t in range(cost)]
    return Request(blocks=tuple(block_hashes(tokens, BLOCK)), cost=cost, block_size=BLOCK, modality=modality)


def av_request(n: int, cost: int = 6000) -> Request:
    return prompt(n, cost, "audio+text")


def test_overflow_entries_are_off_the_ring_and_taken_only_when_twice_as_fast() -> None:
    r, _ = av_router()
    assert {r.route(key, "av").node_id for key in range(200)} == {"l1", "l2"}, "bare keys stay on the pool's ring"
    # Idle, the overflow node is 3.3 times as fast (0.3 s against 1 s): worth the detour.
    assert r.route(av_request(0)).node_id == "h1"
    # Text queued on it (12,000 tokens: 0.9 s with this request) makes the pool's idle 1 s less than twice that.
    sent(r, Request(blocks=tuple(block_hashes(list(range(12_000)), BLOCK)), cost=12_000, block_size=BLOCK))
    assert {sent(r, av_request(n)).node_id for n in (1, 2)} == {"l1", "l2"}
    # Both pool nodes 1 s deep (2 s with this request): 0.9 s on the overflow node is now under half of it.
    assert r.route(av_request(3)).node_id == "h1"


def test_an_overflow_entry_is_passed_over_while_a_slice_it_serves_waits_in_the_room() -> None:
    def waiting_for_h1(r: Router) -> Ticket:
        """Both pool nodes 1 s deep, h1 2,400 text tokens deep (at twice the assumed speed, over the room's 1,000): a
        text turn waits."""
        text = sent(r, Request(blocks=tuple(block_hashes(list(range(12_000)), BLOCK)), cost=12_000, block_size=BLOCK))
        assert {sent(r, av_request(n)).node_id for n in (1, 2)} == {"l1", "l2"}
        text.end()
        tokens = list(range(50_000, 52_400))
        sent(r, Request(blocks=tuple(block_hashes(tokens, BLOCK)), cost=2_400, block_size=BLOCK))
        ticket = r.turn(Request(cost=500, slice="llm"))
        assert not ticket.granted
        return ticket

    r, _ = av_router(hold_tokens=1000)
    ticket = waiting_for_h1(r)
    # 0.42 s on h1 with this request, twice that still under the pool's 2 s: but text, whose pool h1 is, waits
    assert r.route(av_request(3)).node_id in {"l1", "l2"}
    r.leave(ticket)
    assert r.route(av_request(3)).node_id == "h1"
    unyielding, _ = av_router(hold_tokens=1000, overflow_yields=False)
    waiting_for_h1(unyielding)
    assert unyielding.route(av_request(3)).node_id == "h1"


def test_the_room_counts_an_overflow_entry_only_while_a_detour_may_take_it() -> None:
    def av_turn_while_text_waits(r: Router) -> tuple[Ticket, Ticket, Ticket]:
        """Both pool nodes 1 s deep and the overflow node idle; one text turn granted and not yet placed, so the
        next text turn waits: then an av request asks for its turn."""
        text = sent(r, Request(blocks=tuple(block_hashes(list(range(12_000)), BLOCK)), cost=12_000, block_size=BLOCK))
        assert {sent(r, av_request(n)).node_id for n in (1, 2)} == {"l1", "l2"}
        text.end()
        first, second = (r.turn(Request(cost=500, slice="llm")) for _ in range(2))
        assert first.granted and not second.granted
        return first, second, r.turn(av_request(3))

    r, _ = av_router(hold_tokens=1000)
    first, second, av = av_turn_while_text_waits(r)
    # h1 has room, but a detour may not take it while text waits: granted for it, the request would join a pool
    # queue 1 s deep
    assert not av.granted
    r.request(first.request, turn=first).begin()
    assert second.granted and av.granted, "text no longer waits: h1's room is the av slice's too"
    assert r.request(av.request, turn=av).node_id == "h1"
    unyielding, _ = av_router(hold_tokens=1000, overflow_yields=False)
    assert av_turn_while_text_waits(unyielding)[2].granted
    # Overflow off: placement never detours, so an idle overflow node is no room for the slice's turns
    pinned, _ = av_router(hold_tokens=1000, overflow=0.0)
    assert {sent(pinned, av_request(n)).node_id for n in (1, 2)} == {"l1", "l2"}
    assert not pinned.turn(av_request(3)).granted
    assert av_router(hold_tokens=1000)[0].turn(av_request(3)).granted, "with overflow, h1's room is the slice's"


def test_the_room_is_counted_in_time_at_each_nodes_measured_speed() -> None:
    def turn_with(fast_tokens: int, slow_tokens: int) -> Ticket:
        """A 20,000 tokens/s node and a 5,000 tokens/s one with these prompt tokens queued; then a request's turn."""
        r, _ = router(node("fast", rate=20_000.0), node("slow", rate=5_000.0), hold_tokens=2048)
        for name, tokens in (("fast", fast_tokens), ("slow", slow_tokens)):
            blocks = tuple(block_hashes([t + 10 * tokens for t in range(tokens)], BLOCK))
            other = "slow" if name == "fast" else "fast"
            r.request(Request(blocks=blocks, cost=tokens, block_size=BLOCK), exclude=[other]).begin()
        return r.turn(Request(cost=100))

    # 1,500 tokens on the slow node take as long as 3,000 at the assumed 10,000 tokens/s: more than 2,048; 5,000 on
    # the fast one as long as 2,500: no room on either, though the slow node's tokens are under the limit
    assert not turn_with(5000, 1500).granted
    # 3,000 tokens on the fast node drain in the time of 1,500: room, though neither queue is under 2,048 tokens
    assert turn_with(3000, 2500).granted
    # Before any speed is measured the room counts tokens
    r, _ = router(node("a"), node("b"), hold_tokens=2048)
    r.request(Request(blocks=BLOCKS, cost=3000, block_size=BLOCK), exclude=["b"]).begin()
    r.request(Request(blocks=BLOCKS[:2], cost=1500, block_size=BLOCK), exclude=["a"]).begin()
    assert r.turn(Request(cost=100)).granted


def test_overflow_off_keeps_a_slice_on_its_pool() -> None:
    r, _ = av_router(overflow=0.0)
    assert {r.route(av_request(n)).node_id for n in range(20)} <= {"l1", "l2"}
    with pytest.raises(ValueError, match="overflow"):
        Settings(overflow=0.5)


def test_a_session_placed_on_an_overflow_node_stays_there() -> None:
    r, _ = av_router()
    first = Request(blocks=av_request(0).blocks, cost=6000, block_size=BLOCK, modality="audio", session="s1")
    assert r.request(first).node_id == "h1"
    for n in (1, 2, 3, 4):  # the overflow node gets busy: a new conversation would go to the pool now
        sent(r, Request(blocks=av_request(10 + n).blocks, cost=6000, block_size=BLOCK, slice="llm"))
    assert r.route(av_request(9)).node_id in {"l1", "l2"}
    # The conversation's next turn (its first prompt and more) stays: the overflow node, 1.6 s deep with it, is
    # within the affinity for three quarters of the prompt (2.5) times the pool's 1.3 s.
    follow = Request(blocks=av_request(0, 8000).blocks, cost=8000, block_size=BLOCK, modality="audio", session="s1")
    assert r.route(follow).node_id == "h1"


# --- a speed the table does not carry yet ---------------------------------------------------------------------


def test_a_node_the_table_gives_no_speed_takes_its_callers_first_tokens_on_the_tables_scale() -> None:
    """c's engine has not measured its speed yet (an agent needs 16 prefills); its first tokens here came 4 times as
    slowly as a's. Taken for the other nodes' median (a's 10,000 tokens/s), c would take the next prompt while a and b
    queue; on the table's scale (a: 10,000 over the 2,000 its callers saw) it is 2,500 tokens/s and does not."""
    r, clock = router(node("a", rate=10_000.0), node("b", rate=10_000.0), node("c"))
    queued = [sent(r, prompt(n, 8_000), exclude={"c"}) for n in (1, 2)]  # 0.8 s on each of a and b
    assert {lease.node_id for lease in queued} == {"a", "b"}
    assert sent(r, prompt(3, 4_000)).node_id == "c"  # at the median: 0.4 s against 1.2 s
    r, clock = router(node("a", rate=10_000.0), node("b", rate=10_000.0), node("c"))
    for name, tokens in (("a", 2_000), ("c", 500)):
        with r.request(prompt(10 + tokens, tokens), exclude={"a", "b", "c"} - {name}) as lease:
            clock.now += 1.0
            lease.first_token()
    r.apply(msgspec.structs.replace(r.table, version=2))  # the speeds a table is built with: its next version's
    queued = [sent(r, prompt(n, 8_000), exclude={"c"}) for n in (1, 2)]
    assert {lease.node_id for lease in queued} == {"a", "b"}
    assert sent(r, prompt(3, 4_000)).node_id in {"a", "b"}  # 1.2 s there against 1.6 s on c
    assert sent(r, prompt(4, 1_000)).node_id == "c"  # 0.4 s at 2,500 tokens/s; at its callers' 500, 2 s


def test_a_gpu_classs_nodes_without_a_table_speed_share_their_callers_measure() -> None:
    """Neither A100 has measured its speed yet. a's first answer came 4 times as slowly as b's, because it queued
    behind another prompt, not because a is slower: pooled over their class both run at the median of the two, and
    the next prompt goes where less is queued. Of two classes, each keeps its own: the L40S stays the slower."""

    def classed(name: str, gpu_class: str) -> TableNode:
        return msgspec.structs.replace(node(name), gpu_class=gpu_class)

    def first_answers(r: Router, clock: Clock, seconds: dict[str, float]) -> None:
        for n, (name, s) in enumerate(seconds.items()):
            with r.request(prompt(20 + n, 2_000), exclude=set(seconds) - {name}) as lease:
                clock.now += s
                lease.first_token()
        r.apply(msgspec.structs.replace(r.table, version=2))  # the speeds a table is built with: its next version's

    r, clock = router(classed("a", "a100"), classed("b", "a100"))
    first_answers(r, clock, {"a": 1.0, "b": 0.25})
    assert sent(r, prompt(1, 2_000), exclude={"a"}).node_id == "b"  # b now has 2,000 tokens queued
    assert sent(r, prompt(2, 1_000)).node_id == "a"  # alike in speed (5,000 tokens/s): 0.2 s against 0.6 s
    r, clock = router(classed("a", "a100"), classed("b", "a100"), classed("c", "l40s"), classed("d", "l40s"))
    first_answers(r, clock, {"a": 1.0, "b": 0.25, "c": 2.0, "d": 3.0})
    assert sent(r, prompt(1, 1_000)).node_id in {"a", "b"}  # 5,000 tokens/s against the L40S's 800
    r, clock = router(node("a"), node("b"))  # no class: each keeps its own measure
    first_answers(r, clock, {"a": 1.0, "b": 0.25})
    sent(r, prompt(1, 2_000), exclude={"a"})
    assert sent(r, prompt(2, 1_000)).node_id == "b"  # 0.375 s at b's 8,000 tokens/s against 0.5 s at a's 2,000


def test_a_group_no_entry_of_which_has_a_speed_takes_the_tables_median() -> None:
    """An overflow entry the brain has no measure for (none of its class has prefilled) is neither 1 token/s, which
    would keep it off for good, nor unknown: it takes the median of the table's speeds, and is worth the detour
    while the pool is deep."""
    pool = [node("l1", rate=6000.0), node("l2", rate=6000.0)]
    spill = TableNode(node_id="h1", endpoint="http://h1:8000", weight=1.0, overflow=True)
    built = RoutingTable(
        epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="av", nodes=[*pool, spill])]
    )
    r = Router.from_table(built, clock=Clock())
    assert {sent(r, av_request(n, 12_000)).node_id for n in (1, 2)} == {"l1", "l2"}  # 2 s deep each
    assert r.route(av_request(3)).node_id == "h1"  # 1 s at 6,000 tokens/s against 3 s
