"""The cluster replay: conservation, determinism, node kills, agent vectors, and Prism's real brain and routers."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from prismlb.agent._engine import _parse
from prismlb.agent._sources import KV_MISS_PERIOD_S, NVLINK_PERIOD_S
from prismlb.agent._windows import LOAD_WINDOW_S
from prismlb.semantics import quantile
from prismlb.sim import EmulatedEngine, Outcome, Policy, SimRequest, Workload
from prismlb.sim._cluster import HOST_CPU_UTIL_RATIO, RTO_S, Degrade, Kill, NodeSpec, Simulation, _Node, recovery_s
from prismlb.sim._prism import PrismPolicy, affinity_key, caller_blocks
from prismlb.sim._types import ClusterView
from prismlb.wire import NodeVector

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


def test_a_media_prompt_reaches_the_router_as_the_helpers_hash_it() -> None:
    text_only = SimRequest(7, 0.0, 1300, 1, (11, 12, 13))
    assert caller_blocks(text_only, 512) == (11, 12, 13)
    # 1,100 text tokens then 900 of media: two whole text blocks keep their ids; from the third text block on, the
    # blocks are the media's, new to every cache, and cover the rest of the prompt
    image = SimRequest(7, 0.0, 2000, 1, (11, 12, 13), "image+text", {"image": 1}, 900)
    blocks = caller_blocks(image, 512)
    assert blocks[:2] == (11, 12) and len(blocks) == 4 and not set(blocks[2:]) & {11, 12, 13}
    other = caller_blocks(dataclasses.replace(image, id=8), 512)
    assert caller_blocks(image, 512) == blocks and not set(blocks[2:]) & set(other)
    short = SimRequest(9, 0.0, 300, 1, (5,), "image+text", {"image": 1}, 250)  # its one text block is partial
    assert len(caller_blocks(short, 512)) == 1 and caller_blocks(short, 512)[0] != 5
    assert affinity_key(short, 512) == caller_blocks(short, 512)[0]


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
        self.retransmits: dict[int, tuple[str, int]] = {}
        self.ended: set[int] = set()

    def first_token(self, node: str, request: SimRequest, now: float) -> None:
        self.ttft[request.id] = (node, now - request.arrival_s)

    def retransmitted(self, node: str, request: SimRequest, segments: int, now: float) -> None:
        assert request.id not in self.ended, "told before the attempt's end"
        self.retransmits[request.id] = (node, segments)

    def finished(self, node: str, request: SimRequest, now: float, outcome: Outcome) -> None:
        super().finished(node, request, now, outcome)
        self.ended.add(request.id)

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
    # the node sends its first tokens' lost segments again (half of them): its vectors count them per connection
    # open in their windows, which long replies keep open over several
    lossy = [r for _, name, _, r in slowed.vectors if name == "n3" and r is not None]
    assert len([r for r in lossy if r > 0]) > 0.8 * len(lossy), "retransmits in nearly every window of the node's"
    sound = {r for _, name, _, r in slowed.vectors if name != "n3"}
    assert sound == {None, 0.0}, "sound nodes retransmit nothing; without a connection nothing is measured"
    # the callers send the requests' lost segments again: told as each attempt ends, before it ends, 0 for most
    assert sorted(slowed.retransmits) == sorted(slowed.ended) == list(range(400))
    sent_again = [segments for node, segments in slowed.retransmits.values() if node == "n3"]
    assert sum(s > 0 for s in sent_again) > 0.4 * len(sent_again)
    assert {s for node, s in slowed.retransmits.values() if node != "n3"} == {0}
    stalled = [slowed.ttft[i][1] - healthy.ttft[i][1] for i in slowed.ttft if slowed.ttft[i][0] == "n3"]
    assert sum(s >= RTO_S - 1e-9 for s in stalled) > 0.6 * len(stalled), "most lost a segment: an RTO or more"


def test_prism_sends_less_to_a_slowed_node() -> None:
    policy = PrismPolicy(block_tokens=512)
    fault = [Degrade("n2", at_fraction=0.0, slowdown=4.0)]
    Simulation(workload(800), policy, NODES, utilisation=0.5, seed=0, degrade=fault).run()
    rates = {n.node_id: n.prefill_tokens_per_s for n in policy.routers[0].table.slices[0].nodes}  # type: ignore[union-attr]
    assert rates["n2"] is not None and all(rates["n2"] < 0.5 * r for n, r in rates.items() if n != "n2" and r)


class Seen(Watch):
    """Watch that also keeps each vector's time, requests per second and engine TTFT P99."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, str, float | None, float]] = []

    def tick(self, view: ClusterView, now: float) -> None:
        for v in view.vectors():
            engine = v.latency.get("engine")
            p99 = engine.ttft_p99_ms if engine is not None and engine.ttft_p99_ms is not None else 0.0
            self.seen.append((v.sample_time_unix_s, v.node_id, v.metrics.requests_per_s, p99))


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

    def served(policy: Seen, node: str) -> float:
        """The node's requests its agent counted: a request is 1/window of the rate of each vector (one a second)
        in the window after its end (less those ending within a window of the replay's end)."""
        return sum(rate or 0.0 for _, name, rate, _ in policy.seen if name == node)

    expected = simulation.nodes["n2"].foreign_per_s * workload().requests[-1].arrival_s
    assert expected > 10
    foreign = served(shared, "n2") - served(alone, "n2")
    assert foreign == pytest.approx(expected, rel=0.4), "its agent counts the foreign requests"
    end = max(t for t, _, _, _ in alone.seen)
    n1 = [(t, rate, p99) for t, name, rate, p99 in shared.seen if name == "n1" and t <= end]
    assert n1 == [(t, rate, p99) for t, name, rate, p99 in alone.seen if name == "n1"], "n1 sees none of it"
    on_n2 = [shared.ttft[i][1] for i in shared.ttft if shared.ttft[i][0] == "n2"]
    before = [alone.ttft[i][1] for i in alone.ttft if alone.ttft[i][0] == "n2"]
    assert sum(on_n2) > 1.2 * sum(before), "the policy's requests queue behind the foreign ones"
    with pytest.raises(ValueError, match="foreign"):
        Degrade("n0", foreign=1.0)


def test_recovery_ignores_lone_probes() -> None:
    assert recovery_s(100.0, []) == 0.0
    assert recovery_s(100.0, [100.0, 100.2, 101.5, 110.0, 120.0]) == 1.0
    assert recovery_s(100.0, [100.0, 103.1, 103.9]) == 4.0


class Agents(Spread):
    """Round robin that keeps the agents' vectors, each request's end and TTFT, and each engine's prefix-cache
    counters at every tick (which comes right after the vectors of its instant)."""

    tick_s = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.vectors: list[NodeVector] = []
        self.first: dict[int, float] = {}
        self.ends: list[tuple[str, float, float]] = []  # (node, end, TTFT s)
        self.counters: dict[tuple[str, float], tuple[int, int]] = {}  # (node, time) -> (queried, hit) tokens

    def first_token(self, node: str, request: SimRequest, now: float) -> None:
        self.first[request.id] = now

    def finished(self, node: str, request: SimRequest, now: float, outcome: Outcome) -> None:
        super().finished(node, request, now, outcome)
        self.ends.append((node, now, self.first[request.id] - request.arrival_s))

    def tick(self, view: ClusterView, now: float) -> None:
        self.vectors += view.vectors()
        for node in view.nodes:
            stats = view.stats(node.name)
            assert stats is not None
            self.counters[(node.name, now)] = (stats.prefix_queries_tokens, stats.prefix_hits_tokens)


def test_each_vector_is_what_the_nodes_agent_makes_of_its_engine() -> None:
    """The agent's sources at their periods: requests and TTFT per slice over the window of their ends, the
    engine's finished requests and prefix-cache misses between two scrapes (held until the next), GPU busy every
    GPU period, the simulated host, and the health score over what is present."""
    policy = Agents()
    Simulation(workload(), policy, NODES, utilisation=0.5, seed=0).run()
    assert {v.node_id for v in policy.vectors} == {n.name for n in NODES}
    checked_miss = 0
    for node in NODES:
        vectors = [v for v in policy.vectors if v.node_id == node.name]
        assert [v.seq for v in vectors] == list(range(1, len(vectors) + 1))
        for before, v in zip(vectors, vectors[1:], strict=False):
            t, m = v.sample_time_unix_s, v.metrics
            ends = [
                (end, ttft) for name, end, ttft in policy.ends if name == node.name and t - LOAD_WINDOW_S < end <= t
            ]
            assert m.requests_per_s == pytest.approx(len(ends) / LOAD_WINDOW_S)
            if ends:
                assert v.latency["llm"].requests == len(ends)
                ttft_ms = [ttft * 1000 for _, ttft in ends]
                assert v.latency["llm"].ttft_p99_ms == pytest.approx(quantile(ttft_ms, 0.99))
            assert m.cpu_util_ratio == HOST_CPU_UTIL_RATIO and m.mem_used_bytes is None
            if m.gpu_util_ratio != before.metrics.gpu_util_ratio:
                assert t % NVLINK_PERIOD_S == 0, "GPU busy is read every GPU period"
            if t % KV_MISS_PERIOD_S:
                assert m.kv_cache_miss_ratio == before.metrics.kv_cache_miss_ratio, "held between engine scrapes"
                assert v.latency.get("engine") == before.latency.get("engine")
                continue
            scraped = [end for name, end, _ in policy.ends if name == node.name and t - KV_MISS_PERIOD_S < end <= t]
            engine = v.latency.get("engine")
            assert (engine.requests if engine is not None else 0) == len(scraped)
            queried, hit = (a - b for a, b in zip(policy.counters[(node.name, t)], policy.counters[(node.name, t - 5)]))
            if queried:
                assert m.kv_cache_miss_ratio == pytest.approx(1 - hit / queried)
                checked_miss += 1
    assert checked_miss >= 4 * len(NODES)


def test_the_replays_engine_page_is_the_emulated_engines() -> None:
    """What the replay's agent reads of its engine is what `prism agent` parses from the emulated engine's
    `/metrics` (the same model behind a real HTTP server): the same series, the same buckets, and on the same
    model the same gauges and counters."""
    with EmulatedEngine("a100", time_scale=0.01) as engine:
        for text in ("a first prompt " * 40, "a second one " * 60):
            answer = httpx.post(
                engine.url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 3},
                timeout=10,
            )
            assert answer.status_code == 200
        page = _parse(httpx.get(engine.url + "/metrics", timeout=10).text)
        node = _Node(NodeSpec("n0", "a100"), engine.model.block_tokens, 0, 1.0)
        node.model = engine.model
        exposition = node.exposition()
    assert engine.model.prefix_queries_tokens > 0 and engine.model.running == 0
    for name, series in exposition.items():
        published = {
            frozenset(item for item in labels if item[0] not in ("model_name", "engine")): value
            for labels, value in page[name].items()
        }
        if name.endswith(("_bucket", "_count")):  # the histograms the node observes, not the model: their series
            assert set(published) == set(series), name
        else:
            assert published == pytest.approx(series), name


def test_a_failing_agent_source_fails_the_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent reports without a source that fails; a replay whose simulated source fails has a bug to show (its
    agents run for a policy that reads their vectors)."""

    def broken(self: _Node) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
        raise KeyError("vllm:num_requests_running")

    monkeypatch.setattr(_Node, "exposition", broken)
    with pytest.raises(RuntimeError, match=r"agent sources failed: n0/engine, n1/engine, n2/engine, n3/engine"):
        Simulation(workload(), Watch(), NODES, utilisation=0.5, seed=0).run()


def test_agents_report_from_the_policys_first_read_of_their_vectors() -> None:
    """Only Prism's path reads vectors: a policy that never does costs the replay no agent; one that does gets a
    vector from each node at 0 (the agents are up before the first request), then one every period."""
    quiet = Simulation(workload(), Spread(), NODES, utilisation=0.5, seed=0)
    quiet.run()
    assert all(node.seq == 0 for node in quiet.nodes.values())
    policy = Watch()
    Simulation(workload(), policy, NODES, utilisation=0.5, seed=0).run()
    assert [t for t, name, _, _ in policy.vectors if name == "n0"][:3] == [0.0, 1.0, 2.0]
