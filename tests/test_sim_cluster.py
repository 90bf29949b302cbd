"""The cluster replay: conservation, determinism, node kills, agent vectors, and Prism's real brain and routers."""

from __future__ import annotations

import dataclasses

import pytest

from prismlb.sim import Outcome, Policy, SimRequest, Workload
from prismlb.sim._cluster import RTO_S, Degrade, Kill, NodeSpec, Simulation, recovery_s
from prismlb.sim._prism import PrismPolicy, affinity_key
from prismlb.sim._types import ClusterView

NODES = tuple(NodeSpec(f"n{i}", "a100", i % 2) for i in range(4))


def workload(count: int = 400, gap_s: float = 0.05) -> Workload:
    """Conversations of growing prompts: request k of conversation c extends c's earlier prompt."""
    requests = []
    for i in range(count):
        conversation, turn = i % 25, i // 25
        blocks = tuple(1_000 * conversation + b for b in range(2 + turn))
        requests.append(SimRequest(i, i * gap_s, len(blocks) * 512 - 100, 20, blocks))
    return Workload("synthetic", requests, 512, "test")


class Spread(Policy):
    """Round robin over live-looking nodes; forgets a node after a failed connect."""

    name = "spread"

    def __init__(self) -> None:
        self.turn = 0
        self.down: set[str] = set()
        self.log: list[tuple[str, str, int]] = []

    def start(self, view: ClusterView, now: float) -> None:
        self.names = [n.name for n in view.nodes]

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        for _ in self.names:
            name = self.names[self.turn % len(self.names)]
            self.turn += 1
            if name not in exclude and name not in self.down:
                return name
        return self.names[0]

    def first_token(self, node: str, request: SimRequest, now: float) -> None:
        self.log.append(("first", node, request.id))

    def finished(self, node: str, request: SimRequest, now: float, outcome: Outcome) -> None:
        self.log.append((outcome.value, node, request.id))
        if outcome is Outcome.CONNECT_ERROR:
            self.down.add(node)


def test_every_request_completes_once_with_its_first_token_first() -> None:
    policy = Spread()
    result = Simulation(workload(), policy, NODES, utilisation=0.5, seed=0).run()
    assert result.requests == result.completed == 400 and result.failed_attempts == 0
    assert result.slices["all"].count == 400
    finished = [entry for entry in policy.log if entry[0] == "ok"]
    assert sorted(r for _, _, r in finished) == list(range(400))
    first_seen = {r: i for i, (kind, _, r) in enumerate(policy.log) if kind == "first"}
    assert all(first_seen[r] < i for i, (kind, _, r) in enumerate(policy.log) if kind == "ok")
    assert 0 < result.kv_hit_rate < 1 and result.load_max_over_mean >= 1
    assert 0.3 < result.cross_numa_share < 0.7  # round robin ignores NUMA


def test_kill_fails_attempts_retries_them_and_measures_recovery() -> None:
    result = Simulation(workload(), Spread(), NODES, utilisation=0.5, seed=0, kill=Kill("n2", 0.5)).run()
    assert result.killed_node == "n2" and result.killed_at_s == pytest.approx(0.5 * 399 * 0.05)
    assert result.failed_attempts >= 1
    assert result.recovery_s is not None and result.recovery_s >= 0
    assert result.completed + (result.requests - result.completed) == 400
    assert result.completed >= 400 - result.failed_attempts


def test_same_inputs_same_result() -> None:
    def once() -> dict[str, object]:
        run = Simulation(workload(), PrismPolicy(block_tokens=512), NODES, utilisation=0.8, seed=3).run()
        return {k: v for k, v in dataclasses.asdict(run).items() if k != "wall_s"}

    assert once() == once()


def test_prism_routes_on_the_brains_tables_with_affinity() -> None:
    policy = PrismPolicy(block_tokens=512)
    result = Simulation(workload(), policy, NODES, utilisation=0.5, seed=0).run()
    router = policy.routers[0]
    assert router.table is not None and router.table.version >= 1
    assert {n.node_id for n in router.table.slices[0].nodes} == {n.name for n in NODES}
    assert len(policy.brain.registry.nodes) == 4
    spread = Simulation(workload(), Spread(), NODES, utilisation=0.5, seed=0).run()
    assert result.kv_hit_rate > spread.kv_hit_rate  # later turns follow their conversation's prefix key


def test_prism_drops_a_killed_node_from_its_tables() -> None:
    policy = PrismPolicy(block_tokens=512)
    result = Simulation(workload(800), policy, NODES, utilisation=0.5, seed=0, kill=Kill("n1", 0.3)).run()
    table = policy.routers[0].table
    assert table is not None and "n1" not in {n.node_id for n in table.slices[0].nodes}
    assert result.recovery_s is not None and result.recovery_s < 5.0  # stale after 3 vector periods of 1 s
    assert result.completed == 800 - (result.requests - result.completed)


def test_affinity_key_covers_the_first_1024_tokens() -> None:
    request = SimRequest(7, 0.0, 2000, 1, (11, 12, 13, 14))
    assert affinity_key(request, 512) == 12
    assert affinity_key(dataclasses.replace(request, blocks=(11,)), 512) == 11
    assert affinity_key(dataclasses.replace(request, blocks=()), 512) == 7


def test_bad_setups_are_refused() -> None:
    with pytest.raises(ValueError, match="no requests"):
        Simulation(Workload("empty", [], 512, "x"), Spread(), NODES, utilisation=0.5, seed=0)
    with pytest.raises(ValueError, match="not a node"):
        Simulation(workload(), Spread(), NODES, utilisation=0.5, seed=0, kill=Kill("ghost"))
    with pytest.raises(ValueError, match="not a node"):
        Simulation(workload(), Spread(), NODES, utilisation=0.5, seed=0, degrade=[Degrade("ghost", slowdown=2)])
    with pytest.raises(ValueError, match="slowdown"):
        Degrade("n0", slowdown=0.5)


class Watch(Spread):
    """Round robin that keeps every TTFT and the agents' vectors."""

    tick_s = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.ttft: dict[int, tuple[str, float]] = {}
        self.vectors: list[tuple[float, str, float | None, float | None]] = []

    def first_token(self, node: str, request: SimRequest, now: float) -> None:
        self.ttft[request.id] = (node, now - request.arrival_s)

    def tick(self, view: ClusterView, now: float) -> None:
        for v in view.vectors():
            self.vectors.append((now, v.node_id, v.metrics.prefill_tokens_per_s, v.metrics.tcp_retransmits_per_conn))


def test_a_degraded_node_keeps_answering_slower_and_its_agent_shows_it() -> None:
    healthy, slowed = Watch(), Watch()
    Simulation(workload(), healthy, NODES, utilisation=0.3, seed=0).run()
    faults = [Degrade("n1", at_fraction=0.0, slowdown=4.0), Degrade("n3", at_fraction=0.0, loss=0.5)]
    result = Simulation(workload(), slowed, NODES, utilisation=0.3, seed=0, degrade=faults).run()
    assert result.completed == 400 and result.failed_attempts == 0, "a gray failure fails nothing"

    def rates(policy: Watch, node: str) -> list[float]:
        return [rate for _, name, rate, _ in policy.vectors if name == node and rate is not None]

    assert max(rates(slowed, "n1")) < 0.3 * min(rates(healthy, "n1")), "the agent measures the slower prefill"
    assert min(rates(slowed, "n0")) > 0.9 * min(rates(healthy, "n0"))
    lossy = [r for _, name, _, r in slowed.vectors if name == "n3" and r]
    assert lossy and min(lossy) > 0.5, "half the segments lost: retransmits per connection in its vectors"
    assert all(r == 0.0 for _, name, _, r in slowed.vectors if name != "n3"), "sound nodes retransmit nothing"
    stalled = [slowed.ttft[i][1] - healthy.ttft[i][1] for i in slowed.ttft if slowed.ttft[i][0] == "n3"]
    assert sum(s >= RTO_S - 1e-9 for s in stalled) > 0.6 * len(stalled), "most lost a segment: an RTO or more"


def test_prism_sends_less_to_a_slowed_node() -> None:
    policy = PrismPolicy(block_tokens=512)
    fault = [Degrade("n2", at_fraction=0.0, slowdown=4.0)]
    Simulation(workload(800), policy, NODES, utilisation=0.5, seed=0, degrade=fault).run()
    rates = {n.node_id: n.prefill_tokens_per_s for n in policy.routers[0].table.slices[0].nodes}  # type: ignore[union-attr]
    assert rates["n2"] is not None and all(rates["n2"] < 0.5 * r for n, r in rates.items() if n != "n2" and r)


class Seen(Watch):
    """Watch that also keeps each vector's requests per second and engine TTFT P99."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, float, float]] = []

    def tick(self, view: ClusterView, now: float) -> None:
        for v in view.vectors():
            engine = v.latency.get("engine")
            self.seen.append((v.node_id, v.metrics.requests_per_s, engine.ttft_p99_ms if engine else 0.0))


def test_foreign_requests_load_a_node_that_only_its_agent_sees() -> None:
    """Callers outside the policy: the node serves them (its agent counts them and their latency), the policy is
    never told of them, every policy request still completes once, and the node's own requests wait longer."""
    alone, shared = Seen(), Seen()
    Simulation(workload(), alone, NODES, utilisation=0.4, seed=0).run()
    fault = [Degrade("n2", at_fraction=0.0, foreign=0.6)]
    simulation = Simulation(workload(), shared, NODES, utilisation=0.4, seed=0, degrade=fault)
    result = simulation.run()
    assert result.completed == 400 and result.failed_attempts == 0
    assert len(shared.ttft) == 400 and {i for _, _, i in shared.log} == set(range(400)), "the policy saw only its own"

    def arrivals(policy: Seen, node: str) -> float:
        return sum(rate for name, rate, _ in policy.seen if name == node)

    expected = simulation.nodes["n2"].foreign_per_s * workload().requests[-1].arrival_s
    assert expected > 10
    foreign = arrivals(shared, "n2") - arrivals(alone, "n2")
    assert foreign == pytest.approx(expected, rel=0.4), "its agent counts the foreign requests"
    assert arrivals(shared, "n1") == pytest.approx(arrivals(alone, "n1"), rel=0.05)
    on_n2 = [shared.ttft[i][1] for i in shared.ttft if shared.ttft[i][0] == "n2"]
    before = [alone.ttft[i][1] for i in alone.ttft if alone.ttft[i][0] == "n2"]
    assert sum(on_n2) > 1.2 * sum(before), "the policy's requests queue behind the foreign ones"
    with pytest.raises(ValueError, match="foreign"):
        Degrade("n0", foreign=1.0)


def test_recovery_ignores_lone_probes() -> None:
    assert recovery_s(100.0, []) == 0.0
    assert recovery_s(100.0, [100.0, 100.2, 101.5, 110.0, 120.0]) == 1.0
    assert recovery_s(100.0, [100.0, 103.1, 103.9]) == 4.0
