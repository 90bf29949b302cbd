"""The topology replay (sim/_topology.py): host agents' GPU vectors, Prism's per-GPU entries with NUMA and PCIe
weights, cross-NUMA routing against round robin, the MoE workload's skew, and bench/topology.py's table."""

from __future__ import annotations

import collections
import re

import msgspec
import pytest

from prismlb.semantics import Slice
from prismlb.sim._prism import affinity_key
from prismlb.sim._topology import (
    EXPERT_GROUPS,
    EXPERT_ZIPF,
    HostSpec,
    TopologyPrism,
    TopologySimulation,
    host_cluster,
    moe,
    replay,
)
from prismlb.sim._types import ClusterView
from prismlb.sim.policies import RoundRobin
from prismlb.wire import NodeVector

from .conftest import load_bench

NUMA = [0, 0, 0, 0, 1, 1, 1, 1]


class Reading(RoundRobin):
    """Round robin that reads the agents' vectors every second, as Prism's brain does."""

    def __init__(self) -> None:
        super().__init__()
        self.vectors: list[NodeVector] = []

    def tick(self, view: ClusterView, now: float) -> None:
        super().tick(view, now)
        self.vectors += view.vectors()


def test_host_agents_send_one_vector_with_eight_gpus_on_two_numa_nodes() -> None:
    cluster = (HostSpec("host0", pcie_busy={5: 0.9}),)
    workload, policy = moe(1, 600), Reading()
    simulation = TopologySimulation(workload, policy, cluster, utilisation=0.8, seed=1)
    simulation.run()
    assert sorted(simulation.nodes) == [f"host0-gpu{i}" for i in range(8)]
    assert [simulation.nodes[f"host0-gpu{i}"].info.numa_node for i in range(8)] == NUMA
    assert {v.node_id for v in policy.vectors} == {"host0"}
    vector = msgspec.json.decode(msgspec.json.encode(policy.vectors[-1]), type=NodeVector)  # within the wire's bounds
    assert vector.labels["gpu"] == "l40s"
    assert [g.index for g in vector.gpus] == list(range(8))
    assert [g.numa_node for g in vector.gpus] == NUMA
    assert [g.pcie_util_ratio for g in vector.gpus] == [0.0] * 5 + [0.9, 0.0, 0.0]
    assert {g.name for g in vector.gpus} == {"NVIDIA L40S"}
    assert vector.metrics.gpu_count == 8 and vector.metrics.pcie_util_ratio == 0.9
    # the load windows hold every engine's requests: the host's request rate is the whole workload's
    span_s = workload.requests[-1].arrival_s
    middle = [v for v in policy.vectors if span_s / 4 < v.sample_time_unix_s < 3 * span_s / 4]
    rate = sum(v.metrics.requests_per_s or 0.0 for v in middle) / len(middle)
    assert rate == pytest.approx(len(workload.requests) / span_s, rel=0.25)
    assert all(v.latency["av"].requests > 0 and v.latency["engine"].requests > 0 for v in middle)
    # the engine collector reads the eight engines as one data-parallel vLLM: a series per `engine` label
    (host,) = simulation.hosts
    running = host.exposition()["vllm:num_requests_running"]
    assert sorted(dict(labels)["engine"] for labels in running) == [str(i) for i in range(8)]
    assert sum(dict(host.exposition()["vllm:prefix_cache_queries_total"]).values()) == sum(
        simulation.gpu_load().values()
    )


def test_engine_agents_send_a_vector_per_gpu_without_topology() -> None:
    simulation = TopologySimulation(
        moe(1, 50), RoundRobin(), host_cluster(), utilisation=0.8, seed=1, host_agents=False
    )
    vectors = simulation.agent_vectors(0.0)
    assert [v.node_id for v in vectors] == [f"host0-gpu{i}" for i in range(8)]
    assert all(not v.gpus for v in vectors)


def test_prism_routes_on_per_gpu_entries_with_numa_nodes_and_pcie_derating() -> None:
    cluster = (HostSpec("host0", pcie_busy={5: 0.9}),)
    workload = moe(1, 300)
    policy = TopologyPrism(block_tokens=workload.block_tokens, hosts=cluster)
    TopologySimulation(workload, policy, cluster, utilisation=0.8, seed=1).run()
    assert [r.settings.numa_node for r in policy.routers] == [0, 1]
    table = policy.routers[0].table
    assert table is not None
    (av,) = [s for s in table.slices if s.name == Slice.AV.value]
    assert [(n.node_id, n.gpu, n.numa_node) for n in av.nodes] == [("host0", i, NUMA[i]) for i in range(8)]
    weights = [n.weight for n in av.nodes]
    assert weights[5] == pytest.approx(weights[4] / 2, abs=0.05)  # PCIe past 85%: half its siblings' weight
    assert len(set(weights[:5] + weights[6:])) == 1


def test_prism_crosses_numa_nodes_far_less_than_round_robin() -> None:
    workload, cluster = moe(2, 600), host_cluster()
    prism = replay(workload, "prism", cluster)
    round_robin = replay(workload, "round-robin", cluster)
    assert prism.result.completed == round_robin.result.completed == 600
    assert round_robin.result.cross_numa_share == pytest.approx(0.5, abs=0.05)
    assert prism.result.cross_numa_share < 0.1
    assert sum(prism.gpu_load.values()) == sum(round_robin.gpu_load.values())  # every prompt token, once
    assert 0 <= round_robin.load_spread < prism.load_spread < 1


def test_the_moe_workload_has_zipf_expert_groups_as_specified() -> None:
    workload = moe(1, 6000)
    assert workload == moe(1, 6000)
    assert {r.signature for r in workload.requests} == {"audio+text"}
    assert all(r.media == {"audio": 1} and r.media_tokens > 0 for r in workload.requests)
    keys = [affinity_key(r, workload.block_tokens) for r in workload.requests]
    counts = sorted(collections.Counter(keys).values(), reverse=True)
    assert len(counts) <= EXPERT_GROUPS
    harmonic = sum(1 / k**EXPERT_ZIPF for k in range(1, EXPERT_GROUPS + 1))
    shares = [c / len(keys) for c in counts]
    assert shares[0] == pytest.approx(1 / harmonic, abs=0.02)  # 21%
    assert sum(shares[:8]) == pytest.approx(sum(1 / k**EXPERT_ZIPF for k in range(1, 9)) / harmonic, abs=0.03)
    assert counts[0] / counts[1] == pytest.approx(2**EXPERT_ZIPF, rel=0.25)
    by_key: dict[int, set[tuple[int, ...]]] = collections.defaultdict(set)
    for key, request in zip(keys, workload.requests, strict=True):
        by_key[key].add(request.blocks[:2])  # a group's requests share its context's blocks, and only theirs
    assert all(len(prefixes) == 1 for prefixes in by_key.values())
    assert len({next(iter(p)) for p in by_key.values()}) == len(by_key)


def test_a_quick_bench_run_prints_both_layouts_tables(capsys: pytest.CaptureFixture[str]) -> None:
    load_bench("topology").main(["--quick"])
    out = capsys.readouterr().out
    assert "### balanced gateways (NUMA nodes 0, 1)" in out and "### skewed gateways (NUMA nodes 0, 0, 0, 1)" in out
    policies = [
        "prism",
        "prism-no-numa",
        "prism-node-ring",
        "round-robin",
        "least-conn",
        "sglang",
        "llm-d",
        "dynamo-kv",
    ]
    for layout in out.split("###")[1:]:
        rows = {
            line.split(" | ")[0].strip("| "): line.split(" | ") for line in layout.splitlines() if line.startswith("| ")
        }
        for name in policies:
            cross, spread, p50, p99 = (float(cell) for cell in rows[name][2:6])
            assert 0 <= cross <= 100 and 0 <= spread and 0 < p50 <= p99
        assert rows["design target, Prism"][2:4] == ["9.1", "0.13"]
        assert rows["design target, topology-unaware"][2:4] == ["37.2", "0.48"]
    assert re.search(r"^16 runs in \d+ s$", out, re.MULTILINE)
