"""PrefixIndex: each behaviour on both tables behind it (C `_fastroute.BlockIndex`, pure-Python `_PyTables`), and
random sequences of events and placements on which the two must agree."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from prismlb.router import _index
from prismlb.router._index import PrefixIndex

try:
    from prismlb.router import _fastroute as fastroute
except ImportError:  # test_router_fast.py::test_the_extension_is_built_here tells whether that is expected
    fastroute = None  # type: ignore[assignment]

NOT_BUILT = "the C extension prismlb.router._fastroute is not built: only the pure-Python tables are tested"
needs_c = pytest.mark.skipif(fastroute is None, reason=NOT_BUILT)
Make = Callable[..., PrefixIndex]
_rng = random.Random(7)
P = [0, 2**64 - 1] + [_rng.getrandbits(64) for _ in range(62)]  # a 64-block prompt, both ends of the hash range
OTHER = [_rng.getrandbits(64) for _ in range(64)]


@contextmanager
def python_tables() -> Iterator[None]:
    """PrefixIndex objects created inside use the pure-Python tables, as in a build without a compiler."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_index, "fastroute", None)
        yield


@pytest.fixture(params=["c", "python"])
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    """PrefixIndex's constructor, on the C tables or the pure-Python ones."""
    if request.param == "c":
        if fastroute is None:
            pytest.skip(NOT_BUILT)
        expected: type = fastroute.BlockIndex
    else:
        expected = _index._PyTables

    def build(placed_ttl_s: float = 30.0, max_placed: int = 1_000_000) -> PrefixIndex:
        index = PrefixIndex(placed_ttl_s, max_placed)
        assert type(index._tables) is expected
        return index

    if request.param == "c":
        yield build
    else:
        with python_tables():
            yield build


@needs_c
def test_the_c_tables_back_prefix_index_where_built() -> None:
    assert isinstance(PrefixIndex()._tables, fastroute.BlockIndex)


def test_settings_are_kept_and_negative_ones_refused(make: Make) -> None:
    index = make(12.5, 99)
    assert (index.placed_ttl_s, index.max_placed) == (12.5, 99)
    with pytest.raises(ValueError):
        make(-1.0)
    with pytest.raises(ValueError):
        make(30.0, -1)


def test_match_is_each_first_block_holders_leading_run(make: Make) -> None:
    index = make()
    index.stored("a", P[:40])
    index.stored("b", P[:3])
    index.stored("c", P[1:10])  # not the first block: no match at all
    assert index.match(P, 0.0) == {"a": 40, "b": 3}
    assert index.match(P[:2], 0.0) == {"a": 2, "b": 2}
    assert index.match(tuple(P[:1]), 0.0) == {"a": 1, "b": 1}
    assert (len(index), index.size("a"), index.size("b"), index.size("c"), index.size("nobody")) == (40, 40, 3, 9, 0)


def test_an_empty_prompt_or_an_unheld_first_block_matches_nothing(make: Make) -> None:
    index = make()
    index.stored("a", P)
    assert index.match([], 0.0) == {}
    assert index.match([OTHER[0], *P], 0.0) == {}


def test_binary_search_finds_every_run_length(make: Make) -> None:
    index = make()
    for k in range(1, 65):
        index.stored(f"n{k}", P[:k])
    assert index.match(P, 0.0) == {f"n{k}": k for k in range(1, 65)}
    for length in (1, 2, 7, 33, 63):
        assert index.match(P[:length], 0.0) == {f"n{k}": min(k, length) for k in range(1, 65)}
    assert len(index) == 64 and index.size("n64") == 64


def test_binary_search_takes_a_held_block_to_imply_the_ones_before(make: Make) -> None:
    index = make()
    index.stored("gap", P[:20] + P[21:])  # probes 33, 49, 57, 61, 63, 64 all land on held blocks
    index.stored("ends", [P[0], P[63]])
    index.stored("early", P[:32] + P[33:])  # the first probe misses block 32: then 17, 25, 29, 31, 32 hit
    assert index.match(P, 0.0) == {"gap": 64, "ends": 1, "early": 32}


def test_stored_twice_counts_once(make: Make) -> None:
    index = make()
    index.stored("a", P[:5] + P[:5])
    index.stored("a", iter(P[:5]))
    index.stored("b", P[:5])
    assert (len(index), index.size("a"), index.size("b")) == (5, 5, 5)


def test_removed_cuts_the_run_and_the_counts(make: Make) -> None:
    index = make()
    index.stored("a", P[:40])
    index.stored("b", P[:20])
    index.removed("a", P[10:40])
    assert index.match(P, 0.0) == {"a": 10, "b": 20}
    assert (index.size("a"), len(index)) == (10, 20)  # b still holds blocks 10 to 19
    index.removed("a", [OTHER[0], P[45]])  # never held: nothing changes
    index.removed("nobody", P)
    assert (index.size("a"), len(index)) == (10, 20)
    index.removed("b", P[:20])
    assert index.match(P, 0.0) == {"a": 10}
    assert (index.size("b"), len(index)) == (0, 10)
    index.removed("a", P[:1])
    assert index.match(P, 0.0) == {}


def test_reset_replaces_the_nodes_blocks_only(make: Make) -> None:
    index = make()
    index.stored("a", P[:40])
    index.stored("b", P[:10])
    index.reset("a", P[:5])
    assert index.match(P, 0.0) == {"a": 5, "b": 10}
    assert (index.size("a"), len(index)) == (5, 10)
    index.reset("a", [])
    assert index.match(P, 0.0) == {"b": 10}
    assert index.size("a") == 0
    index.reset("c", OTHER[:3])
    assert index.match(OTHER, 0.0) == {"c": 3}


def test_reset_clears_the_claims_on_blocks_the_node_held_but_not_the_others(make: Make) -> None:
    index = make()
    index.stored("a", P[:4])
    index.placed("a", P[:8], 0.0)
    assert index.match(P, 1.0) == {"a": 8}
    index.reset("a", [])
    assert index.match(P, 1.0) == {}
    assert index.match(P[4:], 1.0) == {"a": 4}


def test_drop_forgets_the_nodes_blocks_and_claims(make: Make) -> None:
    index = make()
    index.stored("a", P[:10])
    index.placed("a", P[:20], 0.0)
    index.placed("a", OTHER[:5], 0.0)
    index.stored("b", P[:5])
    index.drop("a")
    index.drop("nobody")
    assert index.match(P, 1.0) == {"b": 5}
    assert index.match(OTHER, 1.0) == {}
    assert (index.size("a"), len(index)) == (0, 5)
    index.stored("a", P[:3])  # back: a new start
    assert index.match(P, 1.0) == {"a": 3, "b": 5}


def test_a_dropped_nodes_old_placements_leave_the_others_alone(make: Make) -> None:
    index = make(placed_ttl_s=10.0)
    index.placed("a", P[:8], 0.0)
    index.drop("a")
    for name in ("c", "d", "e"):
        index.stored(name, P[:2])
    index.placed("d", P[:6], 5.0)
    index.placed("e", OTHER[:1], 11.0)  # a's placement expires here
    assert index.match(P, 12.0) == {"c": 2, "d": 6, "e": 2}
    index.placed("a", P[:3], 12.0)
    assert index.match(P, 13.0) == {"a": 3, "c": 2, "d": 6, "e": 2}


def test_a_placement_claims_its_blocks_until_the_ttl_passes(make: Make) -> None:
    index = make(placed_ttl_s=30.0)
    index.stored("b", P[:3])
    index.placed("a", P[:8], 100.0)
    assert index.match(P, 100.0) == {"a": 8, "b": 3}
    assert index.match(P, 129.9) == {"a": 8, "b": 3}
    assert index.match(P, 130.0) == {"b": 3}
    assert (len(index), index.size("a")) == (3, 0)  # claims are not the events' blocks


def test_a_later_placement_renews_the_claim_past_the_first_ones_end(make: Make) -> None:
    index = make(placed_ttl_s=30.0)
    index.placed("a", P[:8], 0.0)
    index.placed("a", P[:4], 20.0)
    assert index.match(P, 40.0) == {"a": 4}
    index.placed("b", OTHER[:1], 45.0)  # drops the first placement, whose end passed; not the renewed claims
    assert index.match(P, 46.0) == {"a": 4}
    assert index.match(P, 50.0) == {}


def test_claims_past_max_placed_drop_the_oldest_placements(make: Make) -> None:
    index = make(max_placed=10)
    for t, name in enumerate("abc"):
        index.placed(name, P[:4], float(t))  # 12 blocks claimed: a's placement goes
    assert index.match(P, 3.0) == {"b": 4, "c": 4}
    index.placed("d", P[:11], 3.0)  # more than max_placed alone: everything goes, d's too
    assert index.match(P, 3.0) == {}


def test_zero_ttl_or_zero_max_placed_claims_nothing(make: Make) -> None:
    for index in (make(placed_ttl_s=0.0), make(max_placed=0)):
        index.placed("a", P, 0.0)
        assert index.match(P, 0.0) == {}


def test_a_removed_event_clears_the_claim_too(make: Make) -> None:
    index = make()
    index.placed("a", P[:8], 0.0)
    index.stored("b", P[:8])
    index.placed("b", P[:8], 0.0)
    index.removed("a", P[3:8])
    index.removed("b", P[3:8])
    assert index.match(P, 1.0) == {"a": 3, "b": 3}
    assert len(index) == 3


def test_a_block_held_by_many_nodes(make: Make) -> None:
    index = make()
    for i in range(300):
        index.stored(f"n{i}", P[: 1 + i % 64])
    assert index.match(P, 0.0) == {f"n{i}": 1 + i % 64 for i in range(300)}
    for i in range(299):
        index.removed(f"n{i}", P[:1])
    index.placed("late", P[:2], 0.0)
    assert index.match(P, 1.0) == {"n299": 1 + 299 % 64, "late": 2}
    index.removed("n299", P)
    assert index.match(P, 1.0) == {"late": 2}
    assert len(index) == 63


def test_str_subclass_node_ids_are_their_str(make: Make) -> None:
    class NodeId(str):
        pass

    index = make()
    index.stored(NodeId("a"), P[:4])
    index.placed(NodeId("b"), P[:2], 0.0)
    assert index.match(P, 1.0) == {"a": 4, "b": 2}
    assert index.size("a") == 4


@needs_c
@pytest.mark.parametrize("bad", [-1, 2**64, 2**200, "7", 1.0, None])
def test_the_c_tables_refuse_a_block_hash_outside_uint64_and_change_nothing(bad: object) -> None:
    index = PrefixIndex()
    error = OverflowError if isinstance(bad, int) else TypeError
    index.stored("a", P[:2])
    for call in (
        lambda: index.stored("a", [P[2], bad]),
        lambda: index.removed("a", [P[0], bad]),
        lambda: index.reset("a", [bad]),
        lambda: index.placed("a", [P[2], bad], 0.0),
        lambda: index.match([P[0], P[1], bad], 0.0),
    ):
        with pytest.raises(error):
            call()
    assert index.match(P, 0.0) == {"a": 2} and index.size("a") == 2


@needs_c
def test_the_c_tables_refuse_a_node_id_that_is_not_a_str() -> None:
    index = PrefixIndex()
    for call in (
        lambda: index.stored(1, P),  # type: ignore[arg-type]
        lambda: index.placed(b"a", P, 0.0),  # type: ignore[arg-type]
        lambda: index.drop(None),  # type: ignore[arg-type]
        lambda: index.size(1.5),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError):
            call()
    assert len(index) == 0


def random_run(seed: int, documents: int, nodes: int, steps: int) -> Iterator[tuple[str, object, object]]:
    """Apply one seeded random sequence of events and placements to a C and a Python PrefixIndex, yielding what
    each answers after every step."""
    rng = random.Random(seed)
    ttl, max_placed = rng.choice([(5.0, 60), (30.0, 400), (2.0, 1_000_000)])
    # chained-looking prompts: shared heads, random 64-bit or small sequential hashes (clustered table probes)
    heads = [[rng.getrandbits(64) for _ in range(8)] for _ in range(3)]
    docs = []
    for d in range(documents):
        body = [rng.getrandbits(64) for _ in range(56)] if d % 2 else list(range(1000 * d, 1000 * d + 56))
        docs.append(rng.choice(heads) + body)
    names = [f"n{i}" for i in range(nodes)]
    c = PrefixIndex(ttl, max_placed)
    with python_tables():
        py = PrefixIndex(ttl, max_placed)
    now = 0.0

    def blocks() -> list[int]:
        doc = rng.choice(docs)
        start = 0 if rng.random() < 0.7 else rng.randrange(len(doc))
        return doc[start : rng.randrange(start, len(doc) + 1)]

    for step in range(steps):
        now += rng.choice([0.0, 0.0, 0.25, 1.0, 3.0])
        node = rng.choice(names) if rng.random() < 0.9 else f"new{step}"
        op = rng.choices(["stored", "removed", "reset", "drop", "placed"], [30, 15, 3, 2, 30])[0]
        args: tuple[object, ...]
        if op == "drop":
            args = (node,)
        elif op == "placed":
            args = (node, blocks(), now)
        elif op == "removed":
            doc = rng.choice(docs)
            args = (node, rng.sample(doc, rng.randrange(1, 12)))
        else:
            args = (node, blocks())
        for index in (c, py):
            getattr(index, op)(*args)
        yield f"{op}{args!r} len", len(c), len(py)
        for name in rng.sample(names, 3):
            yield f"size({name})", c.size(name), py.size(name)
        for _ in range(3):
            prompt = rng.choice(docs)[: rng.randrange(0, 65)]
            if rng.random() < 0.2:
                prompt = prompt[:-1] + [rng.getrandbits(64)]
            at = now + rng.choice([0.0, 0.5, ttl])
            yield f"match at {at} of {prompt!r}", c.match(prompt, at), py.match(prompt, at)


@needs_c
@pytest.mark.parametrize(
    ("seed", "documents", "nodes", "steps"),
    [(seed, 6, 8, 400) for seed in range(6)] + [(100, 40, 30, 1500), (101, 12, 120, 1500)],
)
def test_c_and_python_tables_agree_on_random_sequences(seed: int, documents: int, nodes: int, steps: int) -> None:
    for what, c, py in random_run(seed, documents, nodes, steps):
        assert c == py, what
