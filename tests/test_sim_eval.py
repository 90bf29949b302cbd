"""`prism eval` end to end on a reduced replay: every policy, report files, and the same seed giving the same tables."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from prismlb.cli import main
from prismlb.sim import _eval, resolve_workload
from prismlb.sim._eval import (
    MM_CLUSTER,
    TEXT_CLUSTER,
    Case,
    _traces,
    _workload,
    capacity,
    cases,
    cluster_for,
    parse_cluster,
    replay,
    replay_pool,
    run_all,
    run_case,
)
from prismlb.sim._families import PRESETS
from prismlb.sim._workload import WORKLOADS


def test_reduced_eval_writes_the_report_and_is_deterministic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "--traces", "mooncake,mm", "--levels", "80%", "--limit", "60", "--jobs", "1", "--no-ablations"]
    assert main([*argv, "--no-gray", "--out", str(tmp_path / "one")]) == 0
    printed = capsys.readouterr().out
    for policy in ("prism", "round-robin", "least-conn", "nginx-hash", "sglang", "llm-d", "llm-d-chart"):
        assert f"| {policy} |" in printed
    assert "## mooncake · 80% utilisation · a100-3 killed" in printed
    one = tmp_path / "one"
    assert {p.name for p in one.glob("*.md")} == {"mooncake.md", "mm.md", "summary.md"}
    for png in ("mooncake-p99.png", "mooncake-kv.png", "mooncake-kill.png", "mm-p99.png", "goodput.png"):
        assert (one / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (one / "summary.md").read_text()
    assert "prism eval --traces mooncake,mm --levels 80% --limit 60" in summary and "| mooncake |" in summary
    assert summary.index("## Goodput") < summary.index("## TTFT p99") and "## Ablations" not in summary
    # the same seed, the same files: again on one trace without the search (its own tests and
    # `test_eval_ablations_end_to_end` run the searches), which takes most of the time
    small = ["eval", "--traces", "mm", "--levels", "80%", "--limit", "60", "--jobs", "1", "--no-goodput"]
    small += ["--no-ablations"]
    for out in ("three", "four"):
        assert main([*small, "--out", str(tmp_path / out)]) == 0
    for name in ("mm.md", "summary.md", "mm-p99.png", "mm-kv.png"):
        assert (tmp_path / "three" / name).read_bytes() == (tmp_path / "four" / name).read_bytes()


def test_cases_cover_every_policy_level_and_kill() -> None:
    todo = cases(["mooncake"], ["prism", "least-conn"], [0.5, 0.8], seed=3, limit=10, kill=True)
    assert len(todo) == 2 * 2 + 2 and sum(c.kill for c in todo) == 2 and {c.seed for c in todo} == {3}


def test_capacity_and_a_kill_run() -> None:
    tokens, media = capacity(TEXT_CLUSTER)
    assert tokens == 8 * 10_000.0 and media["image"] == pytest.approx(0.030 / 8)
    assert capacity(MM_CLUSTER)[0] == 3 * 20_000.0 + 5 * 6_000.0
    log = logging.getLogger("prism")
    log.setLevel(logging.INFO)
    try:
        result = run_case(Case("mooncake", "least-conn", 0.8, 1, 300, kill=True))
        assert log.level == logging.INFO  # quiet while it replays, the caller's level after
    finally:
        log.setLevel(logging.NOTSET)
    assert result.killed_node == "a100-3" and result.killed_at_s is not None
    assert result.kv_hit_bound > 0 and result.requests == 300
    assert result.completed + (result.requests - result.completed) == 300


def test_a_replay_called_directly_is_quiet_below_error_and_restores_the_level(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("prism")
    log.setLevel(logging.INFO)
    try:
        with caplog.at_level(logging.INFO, logger="prism"):
            workload = resolve_workload("tenants:1", seed=1, limit=100)
            result = replay(workload, "prism", TEXT_CLUSTER[:2], 0.5, seed=1)
            logging.getLogger("prism.brain").warning("after the replay")
        assert result.requests == 100
        assert [r.getMessage() for r in caplog.records] == ["after the replay"], "the brain's start-up notes are off"
        assert log.level == logging.INFO
    finally:
        log.setLevel(logging.NOTSET)


def test_quick_runs_the_shared_traces_and_the_quick_families_at_the_kill_level_without_a_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "--quick", "--limit", "30", "--policies", "least-conn", "--jobs", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for workload in ("mooncake", "azure-code", "azure-conv", "mm", "tenants-1", "sessions-1", "agentic-1"):
        assert f"## {workload} · 80% utilisation\n" in printed, workload
        assert f"## {workload} · 80% utilisation · " in printed, f"{workload}: no kill run"
    assert "50% utilisation" not in printed and "95% utilisation" not in printed
    assert not list(tmp_path.iterdir()), "a quick run writes no report"


def test_a_plain_eval_replays_the_shared_traces_and_every_family_preset_at_two_seeds() -> None:
    args = argparse.Namespace(traces=None, workload=None, trace=None, seed=1, limit=20)
    traces = _traces(args)
    assert traces[: len(WORKLOADS) + 2] == [*WORKLOADS, "mooncake:2", "mm:2"]
    assert traces[len(WORKLOADS) + 2 :] == [f"{name}:{seed}" for name in PRESETS for seed in (1, 2)]
    args.workload = ["rag:3"]
    assert _traces(args) == ["rag:3"], "a named family replaces the default set"
    args.traces = "mm"
    assert _traces(args) == ["mm", "rag:3"]


def test_a_shared_trace_at_a_seed_of_its_own_is_a_workload_of_its_own() -> None:
    first, _ = _workload("mooncake", 1, 200)
    second, _ = _workload("mooncake:2", 1, 200)
    assert (first.name, second.name) == ("mooncake", "mooncake-2")
    assert [r.blocks for r in first.requests] == [r.blocks for r in second.requests]
    assert [r.arrival_s for r in first.requests] != [r.arrival_s for r in second.requests]
    assert _workload("mooncake:1", 2, 200)[0].requests == first.requests  # its own seed over --seed
    args = argparse.Namespace(traces="mooncake:x", workload=None, trace=None, seed=1, limit=20)
    with pytest.raises(argparse.ArgumentError, match="the seed after ':' must be a whole number"):
        _traces(args)
    args.traces = "mooncake:2,nope:2"
    with pytest.raises(argparse.ArgumentError, match=r"unknown traces \['nope:2'\]"):
        _traces(args)


def test_a_cut_that_leaves_one_instant_is_refused_before_any_run() -> None:
    # Mooncake's first ten requests share one timestamp: no span to scale to a load.
    with pytest.raises(SystemExit, match=r"spans no time .*--limit 10 keeps only its first requests"):
        main(["eval", "--limit", "10", "--traces", "mooncake", "--levels", "80%", "--no-kill", "--no-report"])


def test_a_cluster_spec_names_its_nodes_by_class_with_their_labels() -> None:
    nodes = parse_cluster("h100:2:nvlink=yes,a100:1,l40s:1:cuda_graphs=yes+av1=yes,a100:1")
    assert [(n.name, n.gpu_class, n.numa_node) for n in nodes] == [
        ("h100-0", "h100", 0),
        ("h100-1", "h100", 1),
        ("a100-0", "a100", 0),
        ("l40s-0", "l40s", 0),
        ("a100-1", "a100", 1),
    ]
    assert nodes[0].labels == {"nvlink": "yes"} and nodes[2].labels is None
    assert nodes[3].labels == {"cuda_graphs": "yes", "av1": "yes"}
    assert cluster_for("mm", None, "a100:3") == parse_cluster("a100:3") and cluster_for("mm") == MM_CLUSTER
    for bad, why in [
        ("b200:2", "CLASS one of a100, h100, l40s"),
        ("a100", "CLASS:COUNT"),
        ("a100:0", "from 1 to 256"),
        ("a100:257", "from 1 to 256"),
        ("a100:two", "whole number"),
        ("a100:2:nvlink", "'nvlink' is not LABEL=VALUE"),
        ("a100:2:x:y", "CLASS:COUNT"),
        ("a100:1,l40s:1", "has 2 node\\(s\\); a replay needs at least 3"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_cluster(bad)


def test_a_replay_on_a_cluster_spec_runs_on_its_nodes_and_a_bad_spec_stops_eval(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the kill takes the node before the middle of the cluster it runs on: of three, the first
    result = run_case(Case("mooncake", "least-conn", 0.8, 1, 100, kill=True, cluster="l40s:3"))
    assert result.killed_node == "l40s-0" and result.requests == 100
    with pytest.raises(SystemExit):
        main(["eval", "--traces", "mooncake", "--cluster", "a100:2,tpu:1", "--no-report"])
    assert "--cluster: cluster part 'tpu:1'" in capsys.readouterr().err


def test_eval_searches_every_policy_under_the_gray_failure_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "--traces", "mooncake", "--policies", "prism,least-conn", "--levels", "80%", "--limit", "60"]
    argv += ["--jobs", "1", "--no-kill", "--no-ablations", "--cluster", "a100:4", "--out", str(tmp_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Goodput under a gray failure" in printed
    summary = (tmp_path / "summary.md").read_text()
    assert "--cluster a100:4" in summary
    gray = summary[summary.index("## Goodput under a gray failure") : summary.index("## TTFT p99")]
    assert "| mooncake |" in gray and "prism" in gray and "least-conn" in gray and "Prism / best" in gray


def _pool_with_a_lost_worker(jobs: int) -> ProcessPoolExecutor:
    """A `replay_pool` whose one worker the kernel has killed (as the OOM killer does) once it started."""
    pool = replay_pool(1)
    os.kill(pool.submit(os.getpid).result(), signal.SIGKILL)
    return pool


def test_a_lost_replay_worker_ends_the_run_with_an_error_instead_of_a_wait(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with _pool_with_a_lost_worker(1) as pool, pytest.raises(BrokenProcessPool):
        run_all([Case("mm", "round-robin", 0.8, 1, 60)], pool=pool)
    monkeypatch.setattr(_eval, "replay_pool", _pool_with_a_lost_worker)
    argv = ["eval", "--traces", "mm", "--levels", "80%", "--limit", "60", "--jobs", "2", "--no-goodput"]
    assert main([*argv, "--no-ablations", "--no-kill", "--no-report"]) == 1
    err = capsys.readouterr().err
    assert "a replay process ended abruptly" in err and "fewer --jobs than 2" in err
