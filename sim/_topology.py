"""Topology in the cluster replay: hosts of GPUs on two NUMA nodes, one engine per GPU, one agent per host.

A host (`HostSpec`) holds `gpus` GPUs, the first half on NUMA node 0 and its PCIe domain, the second half on NUMA
node 1 and its own. Each GPU runs its own engine (`EngineModel`), a node of the replay named `HOST-gpuN`
(`engine_name`). With host agents (`TopologySimulation(host_agents=True)`), each host sends one vector, as
`prism agent` on the host does: its `gpus[]` carry each GPU's index, NUMA node, utilisation and PCIe utilisation
as the agent's NVML collector reports them (and the node's aggregates over them, `_gpu._node_metrics`), and its
engine metrics are the agent's engine collector reading the host's engines as a data-parallel vLLM (one `engine`
label per engine: counts summed, KV usage averaged). From such vectors the brain lays one entry per GPU in its
topology-aware slices (`brain._topology`: the AV slice), each with the GPU's NUMA node and PCIe derating; a
router that knows its own NUMA node (`Settings.numa_node`) weighs entries across NUMA nodes at 0.4.
Without host agents every engine reports as a node of its own, as in the rest of the replay: whole-node
entries, NUMA unseen.

Callers are in-host gateways pinned to NUMA nodes (`gateways_numa`): request `i` comes through gateway
`i mod gateways`, the spread `PrismPolicy` gives its routers, so each Prism router is its gateway's. A request
served by a GPU on another NUMA node than its gateway's is cross-NUMA (`RunResult.cross_numa_share`).

The GPUs are L40S: the brain's per-GPU entries exist only in the AV slice, whose pool is the AV1-codec GPUs
(L40S class; preferred with CUDA Graphs), so that is the hardware on which its topology weights take effect.
The replay models no PCIe traffic of the engines' own (an 8B dense model's weights and activations stay on its
GPU, a prompt is kilobytes): a GPU's PCIe utilisation is what other work on the host puts on its link
(`HostSpec.pcie_busy`: a checkpoint load, KV offload), zero by default.

The MoE workload (`moe`): each request needs one of `EXPERT_GROUPS` expert groups, Zipf-popular (exponent
`EXPERT_ZIPF`); its prompt opens with the group's shared context of `PREFIX_TOKENS` tokens (what a GPU serving the
group keeps warm: the engine model has a prefix cache and no expert cache), so the affinity key every policy
sees (`_prism.affinity_key`, the prefix trees and indexes of the baselines) names the group; then an audio clip
and a user message of its own. Which GPU takes which key sets each GPU's expert load: the prompt tokens it
serves (`TopologyRun.gpu_load`), their spread the standard deviation over the mean (`load_spread`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prismlb.agent._gpu import _node_metrics
from prismlb.agent._network import NetworkWindow, TcpCounts
from prismlb.agent._node import NodeSampler, Reading
from prismlb.agent._windows import SliceWindows
from prismlb.router import PREFIX_TOKENS, Router, Settings
from prismlb.wire import GpuState, NodeVector

from ._cluster import Exposition, NodeSpec, Simulation, _agent_sources, _agent_vector, _ModelScrape, _Node
from ._eval import _scaled, policy_factories
from ._families import DEFAULT_REQUESTS, _lognormal, _poisson, _rank, _request, _start, _zipf
from ._model import GpuClass
from ._prism import PrismPolicy
from ._types import ClusterView, EngineStats, KvEvent, Policy, RunResult, SimNode, SimRequest, Workload
from ._workload import AUDIO_CLIP_MS, BLOCK_TOKENS, _ordered, audio_tokens

GPUS_PER_HOST = 8
NUMA_NODES = 2
GATEWAYS_NUMA = (0, 1)
"""One in-host gateway on each NUMA node."""
HOST_LABELS: Mapping[str, str] = {"cuda_graphs": "yes"}
"""The engines capture CUDA Graphs: with the L40S's AV1 codec, the AV slice's preferred hardware."""
GPU_NAMES: Mapping[str, str] = {"a100": "NVIDIA A100-SXM4-80GB", "h100": "NVIDIA H100 80GB HBM3", "l40s": "NVIDIA L40S"}
"""NVML's device names of the replay's GPU classes."""
GPU_MEMORY_BYTES: Mapping[str, int] = {"a100": 80 * 2**30, "h100": 80 * 2**30, "l40s": 48 * 2**30}
GPU_MEMORY_UTILISATION = 0.9
"""vLLM's default `gpu_memory_utilization`: the engine takes this share of its GPU's memory at start."""

EXPERT_GROUPS = 64
EXPERT_ZIPF = 1.0
"""Zipf exponent of the expert groups' popularity: the busiest of 64 takes 21% of the requests, the top 8 57%."""
MOE_RATE = 10.0
"""Requests per second before scaling to a utilisation."""
UTILISATION = 0.8
BASELINES = ("round-robin", "least-conn", "sglang", "llm-d", "dynamo-kv")
"""The baselines replayed beside Prism (`_eval.policy_factories`): NUMA-blind, each GPU's engine a node of theirs."""


def engine_name(host: str, gpu: int) -> str:
    """The replay's node name of the engine on GPU `gpu` of `host`."""
    return f"{host}-gpu{gpu}"


@dataclass(frozen=True, slots=True)
class HostSpec:
    """A host of `gpus` GPUs of one class, split evenly over `numa_nodes` NUMA nodes (and their PCIe domains) in
    index order. `pcie_busy` gives a GPU's PCIe utilisation from work outside its engine, by GPU index."""

    name: str
    gpu_class: GpuClass = "l40s"
    gpus: int = GPUS_PER_HOST
    numa_nodes: int = NUMA_NODES
    labels: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(HOST_LABELS))
    pcie_busy: Mapping[int, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.numa_nodes <= self.gpus:
            raise ValueError(f"host {self.name!r}: needs 1 <= numa_nodes <= gpus, got {self.numa_nodes}, {self.gpus}")
        if any(not 0 <= g < self.gpus or not 0.0 <= r <= 1.0 for g, r in self.pcie_busy.items()):
            raise ValueError(f"host {self.name!r}: pcie_busy needs GPU indices below {self.gpus} and ratios in [0, 1]")

    def numa_of(self, gpu: int) -> int:
        """The NUMA node of GPU `gpu`: the first `gpus / numa_nodes` on node 0, and so on."""
        return gpu * self.numa_nodes // self.gpus

    def engines(self) -> tuple[NodeSpec, ...]:
        """The replay's nodes: one engine per GPU, on its GPU's NUMA node."""
        return tuple(
            NodeSpec(engine_name(self.name, gpu), self.gpu_class, self.numa_of(gpu), self.labels)
            for gpu in range(self.gpus)
        )


def host_cluster(count: int = 1) -> tuple[HostSpec, ...]:
    """`count` hosts of eight L40S on two NUMA nodes, named host0, host1, ..."""
    return tuple(HostSpec(f"host{i}") for i in range(count))


class _HostAgent:
    """`prism agent` on one host, over the engines of its GPUs: the agent's own sampler and sources (the replay's,
    `_cluster._agent_sources`) reading every engine of the host. The engines' request windows are the host's (the
    agent receives every request span on its host); its TCP counters are the engines' summed; its GPU source
    reports each GPU (`GpuState`); its engine collector reads the engines as one data-parallel vLLM."""

    def __init__(self, spec: HostSpec, engines: Sequence[_Node], period_s: float) -> None:
        self.spec = spec
        self.engines = tuple(engines)
        self.endpoint = f"http://{spec.name}:8000"
        self.labels = {"gpu": spec.gpu_class, **spec.labels}
        self.now = 0.0
        self.seq = 0
        self.requests = SliceWindows()
        for engine in self.engines:
            engine.requests = self.requests
        network = NetworkWindow(
            lambda: TcpCounts(
                sum(e.opened for e in self.engines),
                sum(e.ended for e in self.engines),
                sum(e.retransmits for e in self.engines),
                0,
                0,
            ),
            clock=lambda: self.now,
        )
        scrape = _ModelScrape(self.endpoint, self.exposition)
        self.sampler = NodeSampler(
            _agent_sources(period_s, lambda: self.now, self.requests, network, self._gpus, scrape)
        )

    def _gpus(self) -> Reading:
        """Each GPU as the agent's NVML collector reports it, and the node's aggregates over them."""
        memory = GPU_MEMORY_BYTES[self.spec.gpu_class]
        devices = [
            GpuState(
                index=gpu,
                uuid=f"GPU-{self.spec.name}-{gpu}",
                name=GPU_NAMES[self.spec.gpu_class],
                mem_used_bytes=round(memory * GPU_MEMORY_UTILISATION),
                mem_total_bytes=memory,
                util_ratio=1.0 if engine.model.running else 0.0,
                pcie_util_ratio=self.spec.pcie_busy.get(gpu, 0.0),
                numa_node=self.spec.numa_of(gpu),
            )
            for gpu, engine in enumerate(self.engines)
        ]
        return Reading(metrics=dataclasses.asdict(_node_metrics(devices)), gpus=devices)

    def exposition(self) -> Exposition:
        """The host's engines' `/metrics` as one data-parallel vLLM publishes them: each engine's series labelled
        with its `engine` index."""
        merged: Exposition = {}
        for gpu, engine in enumerate(self.engines):
            tag = ("engine", str(gpu))
            for name, series in engine.exposition().items():
                into = merged.setdefault(name, {})
                for labels, value in series.items():
                    into[labels | {tag}] = value
        return merged

    def vector(self, now: float, period_s: float) -> NodeVector:
        """What the host's agent sends now."""
        self.now = now
        self.seq += 1
        return _agent_vector(self.sampler, self.spec.name, self.endpoint, self.labels, self.seq, now, period_s)


class TopologySimulation(Simulation):
    """A replay on `hosts`, one engine per GPU; with `host_agents`, one agent per host (`_HostAgent`), else one per
    engine. Requests come through the gateways `gateways_numa` in turn (request id modulo their count)."""

    def __init__(
        self,
        workload: Workload,
        policy: Policy,
        hosts: Sequence[HostSpec],
        *,
        utilisation: float,
        seed: int,
        host_agents: bool = True,
        gateways_numa: Sequence[int] = GATEWAYS_NUMA,
        vector_period_s: float = 1.0,
    ) -> None:
        engines = [engine for host in hosts for engine in host.engines()]
        super().__init__(
            workload,
            policy,
            engines,
            utilisation=utilisation,
            seed=seed,
            vector_period_s=vector_period_s,
            gateways_numa=gateways_numa,
        )
        self.hosts = (
            [_HostAgent(h, [self.nodes[e.name] for e in h.engines()], vector_period_s) for h in hosts]
            if host_agents
            else []
        )

    def gateway_numa(self, request: SimRequest) -> int:
        """The NUMA node of the request's gateway: gateway `id mod gateways`, as `PrismPolicy` picks its router."""
        return self.gateways_numa[request.id % len(self.gateways_numa)]

    def agent_vectors(self, now: float) -> list[NodeVector]:
        if not self.hosts:
            return super().agent_vectors(now)
        return [host.vector(now, self.vector_period_s) for host in self.hosts]

    def run(self) -> RunResult:
        result = super().run()
        failed = [f"{h.spec.name}/{s}" for h in self.hosts for s, c in h.sampler.failures_total.items() if c]
        if failed:  # as `Simulation.run` checks the engines' agents
            raise RuntimeError(f"host agent sources failed: {', '.join(failed)} (a replay bug)")
        return result

    def gpu_load(self) -> dict[str, int]:
        """Prompt tokens each GPU's engine served, by engine name: the expert load the placement gave it."""
        return {name: node.model.prefix_queries_tokens for name, node in self.nodes.items()}


class _HostEvents:
    """The cluster view with each engine's KV events under its host's node id, as the host's agent relays them."""

    def __init__(self, view: ClusterView, host_of: Mapping[str, str]) -> None:
        self._view = view
        self._host_of = host_of

    @property
    def nodes(self) -> Sequence[SimNode]:
        return self._view.nodes

    def stats(self, name: str) -> EngineStats | None:
        return self._view.stats(name)

    def vectors(self) -> Sequence[NodeVector]:
        return self._view.vectors()

    def kv_events(self) -> list[KvEvent]:
        return [dataclasses.replace(e, node=self._host_of[e.node]) for e in self._view.kv_events()]


class TopologyPrism(PrismPolicy):
    """The replay's Prism on host agents' vectors: router `k` is gateway `k`'s (`PrismPolicy` takes router `id mod
    routers` as `TopologySimulation` takes gateway `id mod gateways`), told that gateway's NUMA node
    (`Settings.numa_node`; with `numa=False` none, so every GPU entry weighs the same); a lease on a per-GPU entry
    goes to that GPU's engine; the engines' KV events reach the routers under their host's id (`_HostEvents`)."""

    def __init__(
        self,
        *,
        block_tokens: int,
        hosts: Sequence[HostSpec],
        gateways_numa: Sequence[int] = GATEWAYS_NUMA,
        numa: bool = True,
    ) -> None:
        super().__init__(block_tokens=block_tokens, gateways=0)
        self.routers = [
            Router(settings=Settings(numa_node=k if numa else None), clock=self._clock) for k in gateways_numa
        ]
        self._engines = {(h.name, gpu): engine_name(h.name, gpu) for h in hosts for gpu in range(h.gpus)}
        self._host_of = {engine: host for (host, _), engine in self._engines.items()}
        self._labels: dict[str, str] = {}  # engine name -> its entry's label, learnt from the leases

    def tick(self, view: ClusterView, now: float) -> None:
        super().tick(_HostEvents(view, self._host_of), now)

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        super().choose(request, now, frozenset(self._labels[e] for e in exclude if e in self._labels))
        lease = self._leases[request.id]
        if lease.endpoint.gpu is None:
            raise RuntimeError(f"{lease.node_id}: a whole-node entry in a per-GPU cluster (a replay bug)")
        engine = self._engines[(lease.node_id, lease.endpoint.gpu)]
        self._labels[engine] = lease.label
        return engine


@dataclass(frozen=True, slots=True)
class Variant:
    """A policy of the topology replay: its factory and whether its cluster's agents are per host."""

    make: Callable[[], Policy]
    host_agents: bool
    summary: str


def variants(
    block_tokens: int, cluster: Sequence[HostSpec], gateways_numa: Sequence[int] = GATEWAYS_NUMA
) -> dict[str, Variant]:
    """Prism's three ways of seeing the cluster, then the baselines (each GPU's engine a node of theirs)."""

    def prism(numa: bool) -> Callable[[], Policy]:
        return lambda: TopologyPrism(block_tokens=block_tokens, hosts=cluster, gateways_numa=gateways_numa, numa=numa)

    def node_ring() -> Policy:
        policy = PrismPolicy(block_tokens=block_tokens, gateways=len(gateways_numa))
        policy.name = "prism-node-ring"
        return policy

    def no_numa() -> Policy:
        policy = prism(False)()
        policy.name = "prism-no-numa"
        return policy

    factories = policy_factories(block_tokens)
    return {
        "prism": Variant(prism(True), True, "per-GPU entries, routers weigh NUMA"),
        "prism-no-numa": Variant(no_numa, True, "per-GPU entries, routers not told their NUMA node"),
        "prism-node-ring": Variant(node_ring, False, "each GPU's engine a node of its own: NUMA unseen"),
        **{name: Variant(factories[name], False, "each GPU's engine a node") for name in BASELINES},
    }


@dataclass(frozen=True, slots=True)
class TopologyRun:
    """One topology replay: the cluster's `RunResult` and each GPU's expert load."""

    result: RunResult
    gpu_load: Mapping[str, int]

    @property
    def load_spread(self) -> float:
        """The GPUs' expert loads' standard deviation over their mean (0: even)."""
        loads = list(self.gpu_load.values())
        mean = statistics.fmean(loads)
        return statistics.pstdev(loads) / mean if mean else float("nan")


def replay(
    workload: Workload,
    policy: str,
    cluster: Sequence[HostSpec],
    *,
    utilisation: float = UTILISATION,
    seed: int = 1,
    gateways_numa: Sequence[int] = GATEWAYS_NUMA,
) -> TopologyRun:
    """The workload scaled to `utilisation` of the cluster's prefill capacity, replayed through the named
    `variants` policy on its cluster."""
    variant = variants(workload.block_tokens, cluster, gateways_numa)[policy]
    engines = [engine for host in cluster for engine in host.engines()]
    simulation = TopologySimulation(
        _scaled(workload, engines, utilisation),
        variant.make(),
        cluster,
        utilisation=utilisation,
        seed=seed,
        host_agents=variant.host_agents,
        gateways_numa=gateways_numa,
    )
    result = simulation.run()
    return TopologyRun(result, simulation.gpu_load())


def moe(seed: int, requests: int = DEFAULT_REQUESTS) -> Workload:
    """Audio requests of Zipf-popular expert groups (see the module's docstring); Poisson arrivals."""
    rng, chain = _start(seed, requests)
    popularity = _zipf(EXPERT_GROUPS, EXPERT_ZIPF)
    out: list[SimRequest] = []
    for i, t in enumerate(_poisson(rng, requests, MOE_RATE)):
        group = _rank(rng, popularity)
        clip_ms = _lognormal(rng, 8000, 0.6, AUDIO_CLIP_MS)
        pieces = ((("expert", group), PREFIX_TOKENS), (("user", i), _lognormal(rng, 200, 1.0, 8192)))
        output = _lognormal(rng, 120, 0.8, 2048)
        out.append(
            _request(
                chain,
                t,
                pieces,
                output,
                signature="audio+text",
                media={"audio": 1},
                media_tokens=audio_tokens(clip_ms),
            )
        )
    source = f"sim/_topology.py moe, seed {seed}: {EXPERT_GROUPS} expert groups, Zipf {EXPERT_ZIPF}, Poisson arrivals"
    return Workload(f"moe-{seed}", _ordered(out), BLOCK_TOKENS, source)
