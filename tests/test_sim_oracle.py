"""The full-information reference: its time to first token is the engine's own, it keeps a prompt on its holder
within the affinity factor, and it sees what no router reads (a throttled GPU, foreign work)."""

from __future__ import annotations

from collections import Counter

import pytest

from prismlb.sim import SimRequest, Workload
from prismlb.sim._cluster import Degrade, NodeSpec, Simulation
from prismlb.sim._model import Job
from prismlb.sim._oracle import FullInformation

from .test_sim_cluster import Spread, workload

NODES = tuple(NodeSpec(f"n{i}", "a100", i % 2) for i in range(4))


class Recording(FullInformation):
    """The oracle, keeping its expected time for each request it sent and the time each one took."""

    def __init__(self, **kwargs: float) -> None:
        super().__init__(block_tokens=512, **kwargs)
        self.expected_s: dict[int, float] = {}
        self.measured_s: dict[int, float] = {}
        self.sent: Counter[str] = Counter()

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        name = super().choose(request, now, exclude)
        assert self._view is not None
        node = self._view.truth(name)
        assert node is not None
        self.expected_s[request.id] = self.expected(request, node, now)[0]
        self.sent[name] += 1
        return name

    def first_token(self, node: str, request: SimRequest, now: float) -> None:
        self.measured_s[request.id] = now - request.arrival_s


def prefill_only(count: int, gap_s: float) -> Workload:
    """Conversations of growing prompts, one output token each: nothing decodes beside a prefill, so the engine's
    time to first token is its queue's and the prompt's uncached prefill alone."""
    base = workload(count, gap_s)
    requests = [SimRequest(r.id, r.arrival_s, r.input_tokens, 1, r.blocks) for r in base.requests]
    return Workload("prefill-only", requests, 512, "test")


def test_its_expected_time_is_the_time_the_engine_takes() -> None:
    oracle = Recording()
    Simulation(prefill_only(400, 0.01), oracle, NODES, utilisation=2.0, seed=0).run()
    assert len(oracle.measured_s) == 400
    queued = [i for i, t in oracle.measured_s.items() if t > 0.2]  # some waited behind others: a queue was counted
    assert queued
    for i, measured in oracle.measured_s.items():
        assert oracle.expected_s[i] == pytest.approx(measured, rel=1e-6, abs=1e-9)


def test_it_keeps_a_prompt_on_its_holder_within_the_affinity_and_copies_it_without() -> None:
    prompt = tuple(range(1, 9))
    request = SimRequest(1, 0.0, 8 * 512, 1, prompt)
    for queued_tokens, affinity, chosen in ((6_000, 3.0, "n0"), (6_000, 1.0, "n1"), (20_000, 3.0, "n1")):
        oracle = FullInformation(block_tokens=512, affinity=affinity)
        replay = Simulation(prefill_only(1, 1.0), oracle, NODES, utilisation=1.0, seed=0)
        oracle.start(replay.view, 0.0)
        holder = replay.nodes["n0"].model
        holder.load_context(Job(prompt, 8 * 512, 1, 0.0, 0.0))
        holder.submit(Job((900,), queued_tokens, 1, 0.0, 0.0), 0.0)  # work ahead of the request on the holder only
        own_s, _ = oracle.expected(request, replay.nodes["n1"], 0.0)
        held_s, held = oracle.expected(request, replay.nodes["n0"], 0.0)
        assert held == 8 and held_s == pytest.approx(queued_tokens / 10_000)
        assert own_s == pytest.approx(8 * 512 / 10_000)
        assert oracle.choose(request, 0.0, frozenset()) == chosen, (queued_tokens, affinity)


def test_it_sends_less_to_a_throttled_gpu_and_to_a_node_busy_with_foreign_work() -> None:
    for fault in (Degrade("n2", at_fraction=0.0, slowdown=4.0), Degrade("n2", at_fraction=0.0, foreign=0.8)):
        oracle = Recording(affinity=1.0)
        Simulation(prefill_only(400, 0.01), oracle, NODES, utilisation=1.0, seed=0, degrade=[fault]).run()
        others = [oracle.sent[n.name] for n in NODES if n.name != "n2"]
        assert oracle.sent["n2"] < 0.6 * min(others), (fault, oracle.sent)


def test_it_avoids_dead_and_excluded_nodes() -> None:
    oracle = Recording()
    Simulation(workload(200, 0.02), oracle, NODES, utilisation=0.5, seed=0).run()
    request = SimRequest(999, 0.0, 100, 1, ())
    assert oracle.choose(request, 100.0, frozenset({"n0", "n1", "n2"})) == "n3"
    assert oracle.choose(request, 100.0, frozenset(n.name for n in NODES)) == "n0"


def test_it_needs_the_replays_own_engines() -> None:
    class Elsewhere:
        nodes = ()

    with pytest.raises(TypeError, match="Simulation"):
        FullInformation(block_tokens=512).start(Elsewhere(), 0.0)  # type: ignore[arg-type]


def test_it_is_a_policy_the_replay_treats_like_any_other() -> None:
    oracle, spread = FullInformation(block_tokens=512), Spread()
    results = [Simulation(workload(), p, NODES, utilisation=0.5, seed=0).run() for p in (oracle, spread)]
    assert all(r.completed == r.requests == 400 for r in results)
    assert results[0].policy == "oracle" and results[0].kv_hit_rate > results[1].kv_hit_rate
