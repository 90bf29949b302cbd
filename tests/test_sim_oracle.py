"""The full-information reference: its time to first token is the engine's own, it keeps a prompt on its holder
within the affinity factor, and it sees what no router reads (a throttled GPU, foreign work)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from prismlb.sim import SimRequest, Workload
from prismlb.sim._cluster import Degrade, NodeSpec, Simulation
from prismlb.sim._model import PROFILES, EngineModel, Job
from prismlb.sim._oracle import FullInformation, Lookahead
from prismlb.sim._slo import slo_s

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


def test_a_copied_engine_runs_on_its_own() -> None:
    original = EngineModel(PROFILES["a100"], block_tokens=512)
    for i in range(6):
        original.submit(Job(tuple(range(10 * i, 10 * i + 4)), 4 * 512, 30, 0.0, 0.0), 0.0)
    original.advance(0.5)  # some decoding, one in prefill, some waiting
    assert original.decoding and original.prefilling is not None and original.waiting
    waiting = len(original.waiting)
    twin = original.copy()
    twin.submit(Job((999,), 512, 1, 0.0, 0.5), 0.5)
    ahead = [job for _, job in ((0, twin.prefilling), *((0, j) for j in twin.waiting))]
    while (due := twin.next_event_s()) < math.inf:
        twin.advance(due)
    assert all(job.first_token_s is not None for job in ahead)
    assert original.prefilling is not None and original.prefilling.first_token_s is None
    assert len(original.waiting) == waiting and not original.cached(999) and twin.cached(999)
    done = [job for job in (original.prefilling, *original.waiting)]
    while (due := original.next_event_s()) < math.inf:
        original.advance(due)
    assert [job.first_token_s for job in done] == [job.first_token_s for job in ahead[:-1]]


def test_a_rollout_foretells_the_replay_the_oracle_then_makes() -> None:
    requests = workload(120, 0.002).requests
    oracle = Recording(affinity=3.0)
    Simulation(Workload("w", requests, 512, "test"), oracle, NODES, utilisation=2.0, seed=0).run()
    ahead = Lookahead(block_tokens=512, affinity=3.0, horizon=len(requests))
    replay = Simulation(Workload("w", requests, 512, "test"), ahead, NODES, utilisation=2.0, seed=0)
    ahead.start(replay.view, 0.0)
    first = requests[0]
    chosen = FullInformation.choose(ahead, first, 0.0, frozenset())
    misses, total = ahead.play(first, chosen, requests[1:], 0.0, [n.name for n in NODES])
    measured = [oracle.measured_s[r.id] for r in requests]
    assert total == pytest.approx(sum(measured), rel=1e-9)
    assert misses == sum(t > slo_s(r, ahead.classes) for r, t in zip(requests, measured, strict=True)) > 0
    late = Lookahead(block_tokens=512, affinity=3.0, lateness=True)
    late.start(replay.view, 0.0)
    over_s, _ = late.play(first, chosen, requests[1:], 0.0, [n.name for n in NODES])
    expected_s = sum(max(0.0, t - slo_s(r, ahead.classes)) for r, t in zip(requests, measured, strict=True))
    assert over_s == pytest.approx(expected_s, rel=1e-9) and over_s > 0
    assert all(not n.model.waiting and n.model.prefilling is None for n in replay.nodes.values())


def test_looking_ahead_it_leaves_the_holder_free_for_the_prompt_to_come() -> None:
    prompt = tuple(range(1, 9))
    long = SimRequest(1, 0.0, 20 * 512, 1, tuple(range(100, 120)))  # fresh everywhere: 1 s on either node
    follow = SimRequest(2, 0.001, 9 * 512, 1, (*prompt, 50))  # the held prompt and one block more
    nodes = NODES[:2]
    picks = {}
    for policy in (FullInformation(block_tokens=512), Lookahead(block_tokens=512, horizon=1, candidates=2)):
        replay = Simulation(Workload("two", [long, follow], 512, "test"), policy, nodes, utilisation=1.0, seed=0)
        policy.start(replay.view, 0.0)
        replay.nodes["n0"].model.load_context(Job(prompt, 8 * 512, 1, 0.0, 0.0))
        picks[policy.name] = policy.choose(long, 0.0, frozenset())
        assert not replay.nodes["n0"].model.waiting and not replay.nodes["n0"].model.cached(100)
    assert picks == {"oracle": "n0", "oracle-lookahead": "n1"}


def test_with_one_option_looking_ahead_is_the_oracle() -> None:
    runs = [
        Simulation(workload(200, 0.01), policy, NODES, utilisation=2.0, seed=0).run()
        for policy in (FullInformation(block_tokens=512), Lookahead(block_tokens=512, candidates=1))
    ]
    assert runs[0].slices["all"] == runs[1].slices["all"]
