"""The replay report: tables, best baseline and ratios, headline, and deterministic Markdown and PNG files."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from prismlb.sim._report import format_ms, format_pct, format_table, goodput_summary, headline, write_report
from prismlb.sim._slo import SEARCH_HIGH, Goodput
from prismlb.sim._types import RunResult, SliceStats

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# p99 ms overall at (trace, utilisation, policy); KV hit rate alongside.
P99 = {
    ("mooncake", 0.5, "prism"): 150.0,
    ("mooncake", 0.5, "round-robin"): 300.0,
    ("mooncake", 0.5, "least-conn"): 250.0,
    ("mooncake", 0.8, "prism"): 200.0,
    ("mooncake", 0.8, "round-robin"): 800.0,
    ("mooncake", 0.8, "least-conn"): 500.0,
    ("azure-code", 0.8, "prism"): 90.0,
    ("azure-code", 0.8, "round-robin"): 120.0,
    ("azure-code", 0.8, "least-conn"): 180.0,
}
KV = {"prism": 0.612, "round-robin": 0.201, "least-conn": 0.254}


def run(
    trace: str,
    policy: str,
    utilisation: float,
    p99: float,
    *,
    slices: Sequence[str] = ("llm",),
    killed: str | None = None,
    recovery_s: float | None = None,
) -> RunResult:
    stats = {"all": SliceStats(1000, p99 / 4, p99, 0.9)}
    stats |= {s: SliceStats(500, p99 / 5, p99 * (1.5 if s == "vlm" else 0.5), 0.95) for s in slices}
    return RunResult(
        trace=trace,
        policy=policy,
        utilisation=utilisation,
        seed=1,
        requests=1000,
        completed=1000,
        failed_attempts=3 if killed else 0,
        slices=stats,
        kv_hit_rate=KV[policy],
        kv_hit_bound=0.7,
        load_max_over_mean=1.234,
        cross_numa_share=0.05,
        killed_node=killed,
        killed_at_s=10.0 if killed else None,
        recovery_s=recovery_s,
        timeline=[(float(t), p99 * (3 if t == 10 else 1)) for t in range(0, 30, 5)],
        wall_s=2.0,
    )


def results() -> list[RunResult]:
    runs = [run(t, p, u, v, slices=("llm", "vlm") if t == "mooncake" else ("llm",)) for (t, u, p), v in P99.items()]
    runs += [
        run("mooncake", "prism", 0.8, 400.0, killed="node-3", recovery_s=1.5),
        run("mooncake", "round-robin", 0.8, 2000.0, killed="node-3", recovery_s=12.25),
    ]
    return runs


def table_rows(text: str, heading: str) -> dict[str, list[str]]:
    """The rows of the table under `heading`, by policy: cells without the policy."""
    section = text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}


def test_numbers_are_formatted_consistently() -> None:
    assert [format_ms(v) for v in (1234.4, 100.0, 99.96, 99.94, 7.25, float("nan"))] == [
        "1234",
        "100",
        "100",
        "99.9",
        "7.2",
        "–",
    ]
    assert format_pct(0.4567) == "45.7" and format_pct(1.0) == "100.0"


def test_the_tables_name_the_p99_floor_when_the_runs_carry_it() -> None:
    floored = [dataclasses.replace(r, ttft_p99_floor_ms=123.4) if r.trace == "mooncake" else r for r in results()]
    text = format_table(floored)
    assert "Best baseline: least-conn (TTFT p99 500 ms). TTFT p99 floor: 123 ms (" in text
    assert "floor" not in text.split("## azure-code", 1)[1], "runs without a floor say nothing of it"


def test_table_values_ratios_and_best_baseline() -> None:
    text = format_table(results(), trace="mooncake")
    assert "azure-code" not in text
    heading = "## mooncake · 80% utilisation"
    assert heading + "\n\nBest baseline: least-conn (TTFT p99 500 ms)." in text
    header = next(line for line in text.split(heading, 1)[1].splitlines() if line.startswith("| policy"))
    assert "p99 llm ms | p99 vlm ms" in header and "recovery s" not in header
    rows = table_rows(text, heading)
    assert list(rows) == ["prism", "round-robin", "least-conn"]
    # p50, p99, ratio, p99 llm, p99 vlm, SLO, KV hit, KV bound, load, cross-NUMA, failed
    assert rows["prism"] == ["50.0", "200", "0.40×", "100", "300", "90.0", "61.2", "70.0", "1.23", "5.0", "0"]
    assert rows["round-robin"][2] == "1.60×" and rows["least-conn"][2] == "1.00×"


def test_kill_runs_get_their_own_table_with_recovery() -> None:
    text = format_table(results())
    kill = "## mooncake · 80% utilisation · node-3 killed"
    assert text.index("## mooncake · 80% utilisation\n") < text.index(kill)
    rows = table_rows(text, kill)
    assert list(rows) == ["prism", "round-robin"]
    assert rows["prism"][2] == "0.20×" and rows["prism"][-2:] == ["3", "1.5"]
    assert rows["round-robin"][-1] == "12.2"


def test_headline_picks_the_best_baseline_at_80_percent() -> None:
    lines = headline(results()).splitlines()
    assert lines[0].startswith("| trace (80% util.)")
    assert lines[2] == "| mooncake | 200 | least-conn | 500 | 0.40× | 61.2 | 25.4 |"
    assert lines[3] == "| azure-code | 90.0 | round-robin | 120 | 0.75× | 61.2 | 20.1 |"
    assert len(lines) == 4


def test_write_report_writes_markdown_and_valid_pngs(tmp_path: Path) -> None:
    def report(out_dir: Path) -> list[Path]:
        notes = {"mooncake": "Prefix-heavy trace."}
        return write_report(results(), out_dir, command="prism eval --all", notes=notes)

    first = report(tmp_path / "a")
    names = [p.name for p in first]
    assert names == [
        "mooncake.md", "mooncake-p99.png", "mooncake-kv.png", "mooncake-kill.png",
        "azure-code.md", "azure-code-p99.png", "azure-code-kv.png", "summary.md",
    ]  # fmt: skip
    assert all(p.is_file() for p in first)
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in first if p.suffix == ".png")
    page = (tmp_path / "a" / "mooncake.md").read_text()
    assert page.startswith("# Replay: mooncake\n\nCommand:\n\n```\nprism eval --all\n```")
    assert "Prefix-heavy trace." in page and "![TTFT p99 around the kill](mooncake-kill.png)" in page
    summary = (tmp_path / "a" / "summary.md").read_text()
    assert headline(results()) in summary and "- [azure-code](azure-code.md)" in summary

    second = report(tmp_path / "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]


def goodput_rows() -> list[Goodput]:
    def row(trace: str, policy: str, load: float, above: float | None = 1.0) -> Goodput:
        curve = ((load * 10, 0.95), (load * 20, 0.5)) if load else ((1.0, 0.2),)
        return Goodput(trace, policy, load, load * 10, 0.95, above, 0.5, curve)

    return [
        row("mooncake", "prism", 0.6),
        row("mooncake", "least-conn", 0.4),
        row("mooncake", "round-robin", 0.0),
        row("azure-code", "prism", 0.3),
        row("azure-code", "least-conn", 0.5),
        row("azure-code", "round-robin", SEARCH_HIGH, None),
    ]


def test_goodput_summary_ranks_prism_against_the_best_baseline() -> None:
    text = goodput_summary(goodput_rows())
    lines = text.splitlines()
    assert lines[0] == "| workload | prism | least-conn | round-robin | best baseline | Prism / best |"
    assert lines[2] == "| mooncake | 60% | 40% | < 10% | least-conn | 1.50× |"
    assert lines[3] == f"| azure-code | 30% | 50% | ≥ {100 * SEARCH_HIGH:.0f}% | round-robin | 0.02× |"
    assert "ahead by more than 2% on 1, behind by more than 2% on 1, within 2% on 0" in text
    assert f"geometric mean {(1.5 * 0.3 / SEARCH_HIGH) ** 0.5:.2f}×" in text


def test_write_report_leads_the_summary_with_goodput_and_its_plots(tmp_path: Path) -> None:
    paths = write_report(results(), tmp_path, command="prism eval", goodput=goodput_rows(), ablations="| a |")
    assert (tmp_path / "goodput.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "attainment.png").read_bytes()[:8] == PNG_MAGIC
    assert tmp_path / "goodput.png" in paths and tmp_path / "attainment.png" in paths
    summary = (tmp_path / "summary.md").read_text()
    assert summary.index("## Goodput") < summary.index("## TTFT p99") < summary.index("## Ablations")
    assert "![goodput](goodput.png)" in summary and "| a |" in summary
    again = tmp_path / "again"
    write_report(results(), again, command="prism eval", goodput=goodput_rows(), ablations="| a |")
    for name in ("goodput.png", "attainment.png", "summary.md"):
        assert (tmp_path / name).read_bytes() == (again / name).read_bytes()
