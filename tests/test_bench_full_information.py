"""bench/full_information.py's references as the evaluation runs them, its other rules, and its tables: the best
baseline per workload or cell, the ratios, and the counts against the targets. The full searches are not run."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from prismlb.sim import SimRequest, Workload
from prismlb.sim._cluster import NodeSpec, Simulation
from prismlb.sim._eval import Case, run_case
from prismlb.sim._model import Job
from prismlb.sim._slo import Goodput

from .conftest import bench_with_variants


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_with_variants("full_information") as module:
        yield module


def test_the_references_replay_as_named_policies(bench: ModuleType) -> None:
    for name in bench.REFERENCES:
        result = run_case(Case("tenants:1", name, 1.0, 1, 200))
        assert result.policy == name and result.completed == result.requests == 200


def test_the_table_names_the_best_baseline_and_divides_by_it(bench: ModuleType) -> None:
    policies = ["prism", "round-robin", "llm-d", "oracle", "oracle-greedy"]
    loads = {
        "tenants:1": {"prism": 3.0, "round-robin": 1.2, "llm-d": 2.5, "oracle": 3.3, "oracle-greedy": 2.0},
        "azure-code": {"prism": 0.0, "round-robin": 0.1, "llm-d": 0.0, "oracle": 0.1, "oracle-greedy": 0.1},
    }
    names = {"tenants:1": "tenants-1", "azure-code": "azure-code"}
    found = [Goodput(names[w], p, loads[w][p], 1.0, 0.9, None, None) for w in loads for p in policies]
    text, ratios = bench.table(found, list(loads), policies)
    rows = text.splitlines()
    assert rows[2] == "| tenants-1 | 300% | 330% | 200% | llm-d 250% | 1.20× | 1.32× | 0.91× |"
    assert rows[3] == "| azure-code | < 10% | 10% | 10% | round-robin 10% | – | 1.00× | – |"
    assert ratios == {
        "prism / best": [pytest.approx(1.2)],
        "oracle / best": [pytest.approx(1.32), 1.0],
        "prism / oracle": [pytest.approx(3 / 3.3)],
    }
    summary = bench.summary(ratios)
    assert "prism / best: geometric mean 1.200 (1.20–1.20), ≥ 1.2× on 1 of 1" in summary
    assert "oracle / best: geometric mean 1.149 (1.00–1.32), ≥ 1.2× on 1 of 2" in summary
    assert "prism / oracle: geometric mean 0.909" in summary and "of 1" not in summary.splitlines()[-1]


def test_the_p99_table_sets_prism_the_oracle_and_the_floor_against_the_best_baseline(bench: ModuleType) -> None:
    policies = ["prism", "round-robin", "least-conn", "oracle", "oracle-greedy"]
    results = [run_case(Case("tenants:1", p, load, 1, 200)) for load in (0.5, 0.95) for p in policies]
    text, ratios = bench.p99_table(results, policies)
    rows = text.splitlines()[2:]
    assert len(rows) == 2 and rows[0].startswith("| tenants-1 | 50% |") and rows[1].startswith("| tenants-1 | 95% |")
    for row, cell in zip(rows, (results[:5], results[5:]), strict=True):
        p99 = {r.policy: r.slices["all"].ttft_p99_ms for r in cell}
        best = min(("round-robin", "least-conn"), key=lambda p: p99[p])
        assert (
            f"| {best} {p99[best]:,.0f} ms | {p99['prism'] / p99[best]:.2f}× | {p99['oracle'] / p99[best]:.2f}× |"
            in row
        )
    assert all(0 < floor <= prism for floor, prism in zip(ratios["floor / best"], ratios["prism / best"], strict=True))
    assert "≤ 0.8× in" in bench.summary(ratios, p99=True)


def test_the_slo_rules_spend_the_requests_slo(bench: ModuleType) -> None:
    prompt = tuple(range(1, 9))
    request = SimRequest(1, 0.0, 8 * 512, 1, prompt)  # 4,096 tokens: an SLO of 5 x 0.41 s on an A100
    nodes = tuple(NodeSpec(f"n{i}", "a100") for i in range(3))
    picks = {}
    for name, arguments in (("oracle", {}), ("budget", {"budget": 0.8}), ("cheapest", {"cheapest": 0.8})):
        oracle = bench.SloRule(block_tokens=512, **arguments)
        replay = Simulation(Workload("one", [request], 512, "test"), oracle, nodes, utilisation=1.0, seed=0)
        oracle.start(replay.view, 0.0)
        holder = replay.nodes["n0"].model
        holder.load_context(Job(prompt, 8 * 512, 1, 0.0, 0.0))
        holder.submit(Job((900,), 15_000, 1, 0.0, 0.0), 0.0)  # 1.5 s ahead on the holder: 3.7x the least time
        picks[name] = oracle.choose(request, 0.0, frozenset())
    assert picks == {"oracle": "n1", "budget": "n0", "cheapest": "n0"}


def test_the_rules_table_divides_each_rule_by_the_best_baseline(bench: ModuleType) -> None:
    rules = [f"oracle, {name}" for name in bench.RULES]
    policies = ["prism", "llm-d", "oracle", *rules]
    found = [Goodput("tenants-1", p, 2.0 if p == "llm-d" else 2.5, 1.0, 0.9, None, None) for p in policies]
    text = bench.rules_table(found, ["tenants:1"], policies, ["oracle", *rules])
    rows = text.splitlines()
    assert rows[2] == "| tenants-1 | llm-d 200% | " + " | ".join(["1.25×"] * (1 + len(rules))) + " |"
    assert rows[3].startswith("| geometric mean | | 1.250 |") and rows[4].startswith("| ≥ 1.2× | | 1 |")
