"""bench/semantic_affinity.py: the structure encoder, the skeletons the workload families fill, and the structure
router's choice."""

from __future__ import annotations

import time
from types import ModuleType

import numpy as np
import pytest

from prismlb.router import Request, Settings, block_hashes
from prismlb.sim._families import family_workload
from prismlb.wire import RoutingTable, SliceTable, TableNode

from .conftest import Clock, load_bench

BLOCK = 16
BLOCKS = tuple(block_hashes(list(range(64 * BLOCK)), BLOCK))
CHAT = ("system:9", "user:7")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("semantic_affinity")


def test_the_encoder_is_deterministic_normalised_and_stable_across_processes(bench: ModuleType) -> None:
    fresh = bench.encode.__wrapped__(CHAT)
    assert np.array_equal(fresh, bench.encode(CHAT))
    assert fresh.shape == (bench.DIMS,)
    assert np.linalg.norm(fresh) == pytest.approx(1.0)
    # blake2b, not the per-process salted `hash`: the same features land in the same dimensions in every run
    assert np.flatnonzero(bench.encode(("user:7",))).tolist() == [1, 31, 73, 82, 100, 126]


def test_identical_skeletons_match_and_other_role_orders_do_not(bench: ModuleType) -> None:
    assert bench.cosine(bench.encode(CHAT), bench.encode(tuple(CHAT))) == pytest.approx(1.0)
    assert bench.cosine(bench.encode(CHAT), bench.encode(CHAT[::-1])) < 0.9
    agent = ("agent:11", "task:10", "call:8", "tool:7")
    assert bench.cosine(bench.encode(CHAT), bench.encode(agent)) < 0.5
    assert bench.cosine(bench.encode(CHAT), np.zeros(bench.DIMS)) == 0.0


def test_family_requests_carry_their_skeleton() -> None:
    for request in family_workload("multimodal:1", 200).requests:
        kinds = [piece.partition(":")[0] for piece in request.skeleton]
        assert kinds[:2] == ["mm-system", "user"]
        assert sorted(kinds[2:]) == sorted(m for m, parts in request.media.items() for _ in range(parts))
    rag = family_workload("rag:1", 20).requests[0].skeleton
    assert rag[0] == "rag-instruction:7" and rag[-1].startswith("question:")
    assert all(piece == "chunk:9" for piece in rag[1:-1])  # 512-token chunks: log2 bucket 9


def structure_router(bench: ModuleType, mode: str) -> object:
    nodes = [TableNode(node_id=n, endpoint=f"http://{n}:8000", weight=1.0) for n in "abc"]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=nodes)])
    router = bench.StructureRouter.from_table(table, settings=Settings(balance=0), clock=Clock())
    router.mode = mode
    return router


@pytest.mark.parametrize("mode", ["blend", "tie-break", "cold"])
def test_with_equal_expected_ttfts_the_structurally_closest_node_wins(bench: ModuleType, mode: str) -> None:
    agent = bench.encode(("agent:11", "task:10", "call:8"))
    for closest in "abc":
        router = structure_router(bench, mode)
        for node in "abc":
            router.summarise(node, agent if node == closest else bench.encode(CHAT))
        router.vector = agent
        assert router.route(Request(blocks=BLOCKS, cost=64 * BLOCK, block_size=BLOCK)).node_id == closest


@pytest.mark.parametrize("mode", ["tie-break", "cold"])
def test_the_conservative_modes_keep_the_prefix_holder(bench: ModuleType, mode: str) -> None:
    router = structure_router(bench, mode)
    router.index.stored("a", BLOCKS[:40])
    router.summarise("a", bench.encode(CHAT))
    router.summarise("b", bench.encode(("agent:11",)))
    router.vector = bench.encode(("agent:11",))
    assert router.route(Request(blocks=BLOCKS, cost=64 * BLOCK, block_size=BLOCK)).node_id == "a"
    assert router.changed == 0 and router.decisions == 1
