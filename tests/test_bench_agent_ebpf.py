"""bench/agent_ebpf.py: its tables and goals on made-up windows, and one quick run for real (the C load generator,
the agent's eBPF path and bcc's tools attached in turn); the real run is skipped only without eBPF."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import pytest

from .conftest import load_bench, require_ebpf


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("agent_ebpf")


def _phase(bench: ModuleType, tracer: str, rate: float, completed: int, seen: int, lost: int, cpu_s: float) -> Any:
    """A tracer's window of 2 s under a load of `completed` connections."""
    load = bench.Load(rate, 100, 4000, completed, 0, 2.0)
    return bench.Phase(tracer, bench.label(rate), 2.0, load, seen, lost, cpu_s)


def _made_up(bench: ModuleType, agent_lost_at_max: int) -> Sequence[Any]:
    """The agent at 2,000/s (0.06 s of CPU: 3% of a core) and at max (21,000/s); tcplife at both, using twice
    the agent's CPU; tcpconnlat unable to attach."""
    return [
        _phase(bench, bench.AGENT, 2000.0, 4000, 4000, 0, 0.06),
        _phase(bench, bench.AGENT, 0.0, 42000, 42000 - agent_lost_at_max, agent_lost_at_max, 1.0),
        _phase(bench, "tcplife-bpfcc", 2000.0, 4000, 4000, 0, 0.12),
        _phase(bench, "tcplife-bpfcc", 0.0, 42000, 21000, 500, 2.0),
        bench.Phase("tcpconnlat-bpfcc", "-", problem="did not attach: no kprobes"),
    ]


def test_the_table_has_a_row_per_window_with_units_and_a_problem_row(bench: ModuleType) -> None:
    rows = bench.table(_made_up(bench, 0))
    assert rows[0] == (
        "| tracer | rate asked (conn/s) | offered (conn/s) | connections | seen by tracer | seen % | lost events "
        "| tracer CPU (% of a core) | CPU per 1k conn/s (% of a core) |"
    )
    assert rows[2] == "| prism agent | 2,000 | 2,000 | 4,000 | 4,000 | 100.0 | 0 | 3.0 | 1.50 |"
    assert rows[5] == "| tcplife-bpfcc | max | 21,000 | 42,000 | 21,000 | 50.0 | 500 | 100.0 | 4.76 |"
    assert rows[6] == "| tcpconnlat-bpfcc | did not attach: no kprobes | | | | | | | |"


def test_the_ratios_compare_the_agent_with_each_baseline_at_each_rate(bench: ModuleType) -> None:
    rows = bench.ratios(_made_up(bench, 0))
    assert rows[2:] == [
        "| 2,000 | tcplife-bpfcc | 0.50 | 0.50 | 1.00 |",
        "| max | tcplife-bpfcc | 0.50 | 0.50 | 2.00 |",
        "| all | tcpconnlat-bpfcc | n/a: did not attach | n/a | n/a |",
    ]


def test_the_goals_are_met_only_with_nothing_lost_at_20000_and_5_percent_at_2000(bench: ModuleType) -> None:
    assert bench.goals(_made_up(bench, 0)) == [
        "goal >= 20,000 conn/s with 0 lost: met (highest offered rate with every connection seen and 0 lost: "
        "21,000 conn/s)",
        "goal <= 5% of a core at 2,000 conn/s: met (3.0%)",
    ]
    assert bench.goals(_made_up(bench, 3))[0].startswith("goal >= 20,000 conn/s with 0 lost: not met (")
    assert bench.goals(_made_up(bench, 3))[0].endswith(": 2,000 conn/s)")
    assert bench.goals(_made_up(bench, 0)[1:])[1] == "goal <= 5% of a core at 2,000 conn/s: not measured in this run"


@pytest.fixture(scope="module")
def quick_run(bench: ModuleType) -> Sequence[Any]:
    require_ebpf()
    why = bench.missing()
    assert why is None, why
    phases: Sequence[Any] = bench.run(bench.QUICK_RATES, bench.QUICK_DURATION_S, bench.THREADS)
    print("\n".join(bench.table(phases)))
    return phases


@pytest.mark.ebpf
def test_a_quick_run_sees_every_low_rate_connection_through_the_agent(bench: ModuleType, quick_run: Any) -> None:
    alone = quick_run[0]
    assert alone.tracer == "none (load alone)"
    assert alone.load.completed > 0 and alone.load.failed == 0
    agent = [p for p in quick_run if p.tracer == bench.AGENT]
    assert [p.problem for p in agent] == [None, None], agent
    idle, low = agent
    assert idle.label == "idle" and idle.load is None and idle.cpu_s is not None
    rate = bench.QUICK_RATES[0]
    assert low.label == bench.label(rate)
    assert low.load.failed == 0
    assert low.load.completed >= 0.9 * rate * bench.QUICK_DURATION_S
    assert low.seen >= 0.9 * low.load.completed, low
    assert low.seen <= low.load.completed
    assert low.cpu_s > 0 and low.lost >= 0


@pytest.mark.ebpf
def test_a_quick_run_has_the_bcc_baselines_measured_or_saying_why_not(bench: ModuleType, quick_run: Any) -> None:
    rows = bench.table(quick_run)
    for name, _field in bench.BCC_TOOLS:
        tool = [p for p in quick_run if p.tracer == name]
        assert tool, f"no row for {name}"
        assert any(row.startswith(f"| {name} |") for row in rows)
        if tool[0].problem is not None:
            assert len(tool) == 1 and tool[0].problem
            if shutil.which(name) is None:
                assert "apt-get install bpfcc-tools" in tool[0].problem
            continue
        low = tool[-1]
        assert low.seen >= 0.9 * low.load.completed, low
        assert low.seen <= low.load.completed
    if shutil.which("tcplife-bpfcc") is not None:  # tracepoints only: it attaches wherever the agent does
        assert [p.problem for p in quick_run if p.tracer == "tcplife-bpfcc"] == [None, None]
    assert any("| tcplife-bpfcc |" in row for row in bench.ratios(quick_run))
