"""Modality slices: signature grammar to table slice, pool eligibility from labels, tiered pools, fallbacks."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from prismlb.brain import Registry, TableBuilder, Tier, capabilities, compute_weights, pools
from prismlb.brain._slices import fallback, tier
from prismlb.semantics import Slice, parse_signature
from prismlb.wire import GpuState, NodeVector, RoutingTable

from ._helpers_vectors import node_vector

ALL = tuple(Slice)


def node(node_id: str, labels: dict[str, str] | None = None, gpus: Sequence[GpuState] = ()) -> NodeVector:
    return node_vector(node_id, 1, labels=labels, gpus=gpus)


def gpu(index: int, name: str, peers: Sequence[int] = ()) -> GpuState:
    return GpuState(
        index=index, uuid=f"GPU-{index}", name=name, mem_used_bytes=0, mem_total_bytes=1, nvlink_peers=list(peers)
    )


def tiers(vector: NodeVector) -> dict[Slice, Tier]:
    caps = capabilities(vector)
    return {s: tier(caps, s) for s in Slice}


P, A, N = Tier.PREFERRED, Tier.ACCEPTABLE, Tier.NONE


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({}, (A, N, N, N)),
        ({"gpu": "A100"}, (P, N, N, N)),
        ({"gpu": "a800"}, (P, N, N, N)),
        ({"gpu": "h100"}, (A, A, N, N)),  # HBM3 by class, NVLink unknown
        ({"gpu": "h100", "nvlink": "yes"}, (A, P, N, N)),
        ({"gpu": "h100", "nvlink": "yes", "hbm3": "no"}, (A, A, N, N)),  # H100 PCIe (HBM2e)
        ({"gpu": "a100", "nvlink": "true"}, (P, A, N, N)),
        ({"gpu": "l40s"}, (A, N, A, N)),  # AV1 by class, CUDA Graphs unknown
        ({"gpu": "L40S", "cuda_graphs": "on"}, (A, N, P, N)),
        ({"gpu": "l40s", "av1": "no", "cuda_graphs": "yes"}, (A, N, N, N)),
        ({"gpu": "a10", "av1": "yes", "cuda_graphs": "1"}, (A, N, P, N)),
        ({"vectordb": "yes"}, (A, N, N, P)),
        ({"gpu": "a100", "vectordb": "YES"}, (P, N, N, P)),
        ({"vectordb": "maybe"}, (A, N, N, N)),  # unrecognised value: unset
        ({"gpu": "h200", "nvlink": "yes", "slices": "vlm"}, (N, P, N, N)),
        ({"gpu": "l40s", "cuda_graphs": "yes", "slices": "llm, AV"}, (A, N, P, N)),
    ],
)
def test_eligibility_per_label_combination(labels: dict[str, str], expected: tuple[Tier, ...]) -> None:
    assert tiers(node("n", labels)) == dict(zip(ALL, expected, strict=True))


def test_unlabelled_nodes_are_described_from_nvml() -> None:
    hopper = node("h", gpus=[gpu(0, "NVIDIA H100 80GB HBM3", peers=[1]), gpu(1, "NVIDIA H100 80GB HBM3", peers=[0])])
    assert capabilities(hopper).gpu_class == "h100"
    assert tiers(hopper)[Slice.VLM] == P
    ampere = node("a", gpus=[gpu(0, "NVIDIA A100-SXM4-80GB")])
    assert tiers(ampere)[Slice.LLM] == P and tiers(ampere)[Slice.VLM] == N
    ada = node("l", gpus=[gpu(0, "NVIDIA L40S")])
    assert capabilities(ada).gpu_class == "l40s" and tiers(ada)[Slice.AV] == A
    assert capabilities(node("t", gpus=[gpu(0, "Tesla T4")])).gpu_class is None
    # a label beats what NVML shows
    assert tiers(node("x", {"nvlink": "no"}, gpus=[gpu(0, "NVIDIA H100 80GB HBM3", peers=[1])]))[Slice.VLM] == A


def test_pools_take_the_preferred_tier_with_the_generalists_else_the_acceptable_one() -> None:
    a100 = node("a100", {"gpu": "a100"})
    h100 = node("h100", {"gpu": "h100", "nvlink": "yes"})
    h100_pcie = node("h100-pcie", {"gpu": "h100", "hbm3": "no"})
    l40s = node("l40s", {"gpu": "l40s", "cuda_graphs": "yes"})
    assert pools([a100, h100, h100_pcie, l40s]) == {
        Slice.LLM: ["a100", "h100-pcie"],  # the PCIe H100 is preferred by no slice: a generalist
        Slice.VLM: ["h100"],
        Slice.AV: ["l40s"],
        Slice.RAG: [],
    }
    assert pools([h100_pcie, l40s]) == {
        Slice.LLM: ["h100-pcie", "l40s"],  # no A100: every node that accepts text
        Slice.VLM: [],  # the PCIe H100 has neither NVLink nor HBM3
        Slice.AV: ["l40s"],
        Slice.RAG: [],
    }
    # the demo's mix labelled by GPU class alone: no slice prefers the H100 (no NVLink) or the L40S (no CUDA
    # Graphs), so text runs on all four; each is still the whole pool of the slice that accepts it
    mixed = [node(f"{g}-{i}", {"gpu": g}) for i, g in enumerate(("h100", "a100", "a100", "l40s"))]
    assert pools(mixed) == {
        Slice.LLM: ["h100-0", "a100-1", "a100-2", "l40s-3"],
        Slice.VLM: ["h100-0"],
        Slice.AV: ["l40s-3"],
        Slice.RAG: [],
    }


def test_fallback_follows_the_neighbour_chain_to_a_non_empty_slice() -> None:
    assert fallback(Slice.VLM, {Slice.LLM}) is Slice.LLM
    assert fallback(Slice.RAG, {Slice.LLM}) is Slice.LLM
    assert fallback(Slice.AV, {Slice.LLM, Slice.VLM}) is Slice.VLM
    assert fallback(Slice.AV, {Slice.LLM}) is Slice.LLM
    assert fallback(Slice.AV, set()) is None
    assert fallback(Slice.LLM, set()) is None


def table_for(*vectors: NodeVector) -> RoutingTable:
    reg = Registry()
    for vector in vectors:
        reg.update(vector, now=0.0)
    table = TableBuilder(epoch=1).build(compute_weights(reg.nodes, {}))
    assert table is not None
    return table


def test_empty_pools_fall_back_in_the_table() -> None:
    table = table_for(node("a", {"gpu": "a100"}))
    by_name = {s.name: s for s in table.slices}
    assert [s.name for s in table.slices] == ["llm", "vlm", "av", "rag"]
    assert [n.node_id for n in by_name["llm"].nodes] == ["a"] and by_name["llm"].fallback is None
    for name in ("vlm", "av", "rag"):
        assert by_name[name].nodes == [] and by_name[name].fallback == "llm"
    with_vlm = {s.name: s for s in table_for(node("a", {"gpu": "a100"}), node("h", {"gpu": "h200"})).slices}
    assert with_vlm["av"].fallback == "vlm" and with_vlm["vlm"].fallback is None
    empty = TableBuilder(epoch=1).build({})
    assert empty is not None and all(s.nodes == [] and s.fallback is None for s in empty.slices)


@pytest.mark.parametrize(
    ("signature", "owner"),
    [
        ("text", "a100"),
        ("TXT", "a100"),
        ("image+text", "h100"),
        ("Text + Vision", "h100"),
        ("audio+video", "l40s"),
        ("video,text", "l40s"),
        ("speech", "l40s"),
        ("rag+text", "vdb"),
        ("text+retrieval+image", "vdb"),
        ("", "a100"),
        ("hologram", "a100"),
    ],
)
def test_signature_grammar_picks_the_table_slice(signature: str, owner: str) -> None:
    table = table_for(
        node("a100", {"gpu": "a100"}),
        node("h100", {"gpu": "h100", "nvlink": "yes"}),
        node("l40s", {"gpu": "l40s", "cuda_graphs": "yes"}),
        node("vdb", {"vectordb": "yes"}),
    )
    slice_, _ = parse_signature(signature)
    (found,) = [s for s in table.slices if s.name == slice_.value]
    assert [n.node_id for n in found.nodes if not n.overflow] == [owner]


def test_a_pool_lists_the_other_nodes_its_model_runs_on_as_overflow() -> None:
    table = table_for(
        node("h100", {"gpu": "h100", "nvlink": "yes"}),
        node("l40s", {"gpu": "l40s", "cuda_graphs": "yes"}),
        node("texter", {"gpu": "l40s", "slices": "llm"}),
    )
    by_name = {s.name: s for s in table.slices}

    def split(name: str) -> tuple[list[str], list[str]]:
        nodes = by_name[name].nodes
        return [n.node_id for n in nodes if not n.overflow], [n.node_id for n in nodes if n.overflow]

    assert split("av") == (["l40s"], ["h100"]), "the H100 decodes audio too, kept for images until the L40S queue"
    assert split("vlm") == (["h100"], ["l40s"]), "a text-only model never takes images"
    assert split("llm") == (["h100", "l40s", "texter"], []), "text runs everywhere already"
    assert by_name["rag"].nodes == [] and by_name["rag"].fallback == "llm", "an empty pool falls back, no overflow"
    assert all(n.weight == 1.0 for s in table.slices for n in s.nodes), "weighed as the pool's members are"
