"""The cluster replay's results (`prism eval`) as Markdown tables, a README headline and PNG plots.

One table per trace and utilisation level (kill runs get their own): rows are policies, Prism first, then the
baselines in the order they came. "p99 vs best baseline" is a run's overall TTFT P99 over the lowest P99 of
the non-Prism policies in the same table. Milliseconds have no decimals from 100 up and one below; percentages
one decimal. Plots use Matplotlib's Agg canvas with a fixed size, resolution and hash salt and no software
tag, so the same results give the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path

import matplotlib
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

from prismlb.semantics import Slice

from ._slo import GOODPUT_TARGET, SEARCH_HIGH, SEARCH_LOW, Goodput
from ._types import RunResult

PRISM = "prism"
HEADLINE_UTILISATION = 0.8
MISSING = "–"
_SLICE_ORDER = [s.value for s in Slice]
_FIGSIZE = (7.0, 4.0)
_DPI = 100
_RC = {"svg.hashsalt": "prism-report", "savefig.dpi": _DPI}

_GroupKey = tuple[str, float, str | None]
"""Trace, utilisation, killed node (None: no kill)."""


def format_ms(value: float) -> str:
    """Milliseconds: no decimals from 100 up, one below; MISSING when not a number."""
    if not math.isfinite(value):
        return MISSING
    return f"{value:.0f}" if round(value, 1) >= 100 else f"{value:.1f}"


def format_pct(share: float) -> str:
    """A share in [0, 1] as a percentage with one decimal."""
    return f"{100 * share:.1f}" if math.isfinite(share) else MISSING


def _p99(run: RunResult, slice_: str = "all") -> float:
    stats = run.slices.get(slice_)
    return math.nan if stats is None else stats.ttft_p99_ms


def _best_baseline(runs: Iterable[RunResult]) -> RunResult | None:
    """The non-Prism run with the lowest overall TTFT P99 (the first of equals); None when there is none."""
    baselines = [r for r in runs if r.policy != PRISM and math.isfinite(_p99(r))]
    return min(baselines, key=_p99, default=None)


def geometric_mean(ratios: Sequence[float]) -> float | None:
    """The geometric mean of positive ratios (0 when one is 0); None when there are none."""
    if not ratios:
        return None
    if min(ratios) <= 0:
        return 0.0
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def _ratio(value: float, best: RunResult | None) -> str:
    reference = math.nan if best is None else _p99(best)
    if not (math.isfinite(value) and math.isfinite(reference)) or reference <= 0:
        return MISSING
    return f"{value / reference:.2f}×"


def _ordered(items: Iterable[str]) -> list[str]:
    """Distinct items in order of first appearance."""
    return list(dict.fromkeys(items))


def _policies(runs: Sequence[RunResult] | Sequence[Goodput]) -> list[str]:
    """Prism first, then the other policies in the order they came."""
    names = _ordered(r.policy for r in runs)
    return sorted(names, key=lambda name: name != PRISM)


def _groups(runs: Sequence[RunResult]) -> dict[_GroupKey, list[RunResult]]:
    """Runs by table: traces as they came, plain runs by utilisation, then kill runs; rows in policy order."""
    traces = _ordered(r.trace for r in runs)
    rank = {name: i for i, name in enumerate(_policies(runs))}
    groups: dict[_GroupKey, list[RunResult]] = {}
    for run in sorted(runs, key=lambda r: (rank[r.policy], r.seed)):
        groups.setdefault((run.trace, run.utilisation, run.killed_node), []).append(run)
    order = sorted(groups, key=lambda k: (traces.index(k[0]), k[2] is not None, k[1], k[2] or ""))
    return {key: groups[key] for key in order}


def _slices_present(runs: Sequence[RunResult]) -> list[str]:
    """Slices other than "all" that any run reports: the wire's order, then unknown names sorted."""
    names = {name for r in runs for name in r.slices if name != "all"}
    return sorted(names, key=lambda n: (_SLICE_ORDER.index(n) if n in _SLICE_ORDER else len(_SLICE_ORDER), n))


def _md_table(header: Sequence[str], rows: Iterable[Sequence[str]], text_columns: Collection[int] = (0,)) -> str:
    """A Markdown table: `text_columns` left-aligned, the others (numbers) right-aligned."""
    lines = [header, [":---" if i in text_columns else "---:" for i in range(len(header))], *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def _heading(key: _GroupKey) -> str:
    trace, utilisation, killed = key
    kill = f" · {killed} killed" if killed is not None else ""
    return f"## {trace} · {100 * utilisation:.0f}% utilisation{kill}"


def _row(run: RunResult, slices: Sequence[str], best: RunResult | None, kill: bool) -> list[str]:
    overall = run.slices.get("all")
    recovery = [MISSING if run.recovery_s is None else f"{run.recovery_s:.1f}"] if kill else []
    return [
        run.policy,
        format_ms(math.nan if overall is None else overall.ttft_p50_ms),
        format_ms(_p99(run)),
        _ratio(_p99(run), best),
        *(format_ms(_p99(run, s)) for s in slices),
        format_pct(math.nan if overall is None else overall.slo_attainment),
        format_pct(run.kv_hit_rate),
        format_pct(run.kv_hit_bound),
        f"{run.load_max_over_mean:.2f}",
        format_pct(run.cross_numa_share),
        str(run.failed_attempts),
        *recovery,
    ]


def _table(key: _GroupKey, runs: Sequence[RunResult]) -> str:
    """One table's heading, its best baseline and the table."""
    kill = key[2] is not None
    slices = _slices_present(runs)
    best = _best_baseline(runs)
    header = [
        "policy",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "p99 vs best baseline",
        *(f"p99 {s} ms" for s in slices),
        "SLO %",
        "KV hit %",
        "KV bound %",
        "load max/mean",
        "cross-NUMA %",
        "failed attempts",
        *(["recovery s"] if kill else []),
    ]
    note = MISSING if best is None else f"{best.policy} (TTFT p99 {format_ms(_p99(best))} ms)"
    floor = next((r.ttft_p99_floor_ms for r in runs if not math.isnan(r.ttft_p99_floor_ms)), None)
    if floor is not None:
        note += (
            f". TTFT p99 floor: {format_ms(floor)} ms (every request alone on an idle node, every prefix seen before"
            " cached: no policy's p99 is lower)"
        )
    rows = (_row(r, slices, best, kill) for r in runs)
    return f"{_heading(key)}\n\nBest baseline: {note}.\n\n{_md_table(header, rows)}"


def format_table(results: Sequence[RunResult], *, trace: str | None = None) -> str:
    """Markdown tables, one per (trace, utilisation) and per kill run set; only `trace`'s when given."""
    runs = [r for r in results if trace is None or r.trace == trace]
    return "\n\n".join(_table(key, group) for key, group in _groups(runs).items())


def _headline_row(runs: Sequence[RunResult]) -> list[str] | None:
    prism = next((r for r in runs if r.policy == PRISM), None)
    best = _best_baseline(runs)
    if prism is None or best is None:
        return None
    return [
        prism.trace,
        format_ms(_p99(prism)),
        best.policy,
        format_ms(_p99(best)),
        _ratio(_p99(prism), best),
        format_pct(prism.kv_hit_rate),
        format_pct(best.kv_hit_rate),
    ]


def headline(results: Sequence[RunResult]) -> str:
    """A compact Markdown table: per trace at 80% utilisation, Prism's TTFT P99 and KV hits vs the best baseline."""
    header = [
        f"trace ({100 * HEADLINE_UTILISATION:.0f}% util.)",
        "Prism p99 ms",
        "best baseline",
        "baseline p99 ms",
        "Prism / baseline p99",
        "Prism KV hit %",
        "baseline KV hit %",
    ]
    rows = []
    for trace in _ordered(r.trace for r in results):
        runs = [
            r
            for r in results
            if r.trace == trace and r.killed_node is None and math.isclose(r.utilisation, HEADLINE_UTILISATION)
        ]
        row = _headline_row(runs)
        if row is not None:
            rows.append(row)
    return _md_table(header, rows, text_columns=(0, 2))


def _axes(title: str, size: tuple[float, float] = _FIGSIZE) -> tuple[Figure, Axes]:
    """A figure on Agg's canvas, with fixed size and resolution, and its one axes."""
    figure = Figure(figsize=size, dpi=_DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set_title(title)
    return figure, axes


def _log_y(axes: Axes) -> None:
    """A log y axis labelled in plain numbers (100, 200, 1000), without mathtext."""
    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(LogFormatter())
    axes.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _save(figure: Figure, axes: Axes, path: Path, legend_columns: int = 1) -> Path:
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small" if legend_columns == 1 else "x-small", ncols=legend_columns)
    figure.tight_layout()
    return _png(figure, path)


def _png(figure: Figure, path: Path) -> Path:
    """The figure as PNG bytes that depend on its content only (no software tag)."""
    figure.savefig(path, format="png", metadata={"Software": None})
    return path


def _bars(axes: Axes, colours: Mapping[str, str], values: Mapping[str, Sequence[tuple[int, float]]]) -> None:
    """Grouped bars: per policy (in `colours`' order, its colour) a bar at each (group index, height)."""
    width = 0.8 / len(colours)
    for i, policy in enumerate(colours):
        bars = values.get(policy, ())
        axes.bar(
            [x - 0.4 + (i + 0.5) * width for x, _ in bars],
            [h for _, h in bars],
            width,
            color=colours[policy],
            label=policy,
        )


def _p99_plot(trace: str, runs: Sequence[RunResult], colours: Mapping[str, str], path: Path) -> Path:
    """TTFT P99 against utilisation, one line per policy, log y."""
    figure, axes = _axes(f"{trace}: TTFT p99 vs utilisation")
    for policy in colours:
        points = sorted((r.utilisation, _p99(r)) for r in runs if r.policy == policy and math.isfinite(_p99(r)))
        if points:
            axes.plot(*zip(*points), marker="o", color=colours[policy], label=policy)
    levels = sorted({r.utilisation for r in runs})
    axes.set_xticks(levels, [f"{100 * u:.0f}%" for u in levels])
    _log_y(axes)
    axes.set_xlabel("utilisation")
    axes.set_ylabel("TTFT p99 (ms)")
    return _save(figure, axes, path)


def _kv_plot(trace: str, runs: Sequence[RunResult], colours: Mapping[str, str], path: Path) -> Path:
    """KV hit rate per policy at each utilisation level (bars), the infinite-cache bound as a line per level."""
    figure, axes = _axes(f"{trace}: KV-cache hit rate")
    levels = sorted({r.utilisation for r in runs})
    hits = {p: [(levels.index(r.utilisation), 100 * r.kv_hit_rate) for r in runs if r.policy == p] for p in colours}
    _bars(axes, colours, hits)
    bounds = [100 * max(r.kv_hit_bound for r in runs if r.utilisation == u) for u in levels]
    xs = range(len(levels))
    starts, ends = [x - 0.45 for x in xs], [x + 0.45 for x in xs]
    axes.hlines(bounds, starts, ends, colors="black", linestyles="--", label="infinite-cache bound")
    axes.set_xticks(list(xs), [f"{100 * u:.0f}%" for u in levels])
    axes.set_ylim(0, 100)
    axes.set_xlabel("utilisation")
    axes.set_ylabel("KV hit (% of prompt tokens)")
    return _save(figure, axes, path)


def _kill_plot(
    trace: str, runs: Sequence[RunResult], colours: Mapping[str, str], kill_at_s: float | None, path: Path
) -> Path:
    """TTFT P99 per window against simulated time, one line per policy, a vertical line at the kill."""
    killed = _ordered(r.killed_node or "" for r in runs)
    figure, axes = _axes(f"{trace}: TTFT p99 per window, {', '.join(killed)} killed")
    for run in runs:
        if run.timeline:
            axes.plot(*zip(*run.timeline), color=colours[run.policy], label=run.policy)
    if kill_at_s is not None:
        axes.axvline(kill_at_s, color="black", linestyle=":", label="kill")
    _log_y(axes)
    axes.set_xlabel("simulated time (s)")
    axes.set_ylabel("TTFT p99 (ms)")
    return _save(figure, axes, path)


def _plots(trace: str, runs: Sequence[RunResult], out_dir: Path) -> dict[str, Path]:
    """The trace's PNG plots by caption: p99 and KV hits over the plain runs, the timeline over the kill runs."""
    colours = {policy: f"C{i % 10}" for i, policy in enumerate(_policies(runs))}
    plain = [r for r in runs if r.killed_node is None]
    kills = [r for r in runs if r.killed_node is not None]
    plots = {}
    with matplotlib.rc_context(_RC):
        if plain:
            plots["TTFT p99 vs utilisation"] = _p99_plot(trace, plain, colours, out_dir / f"{trace}-p99.png")
            plots["KV-cache hit rate"] = _kv_plot(trace, plain, colours, out_dir / f"{trace}-kv.png")
        if kills:
            path = out_dir / f"{trace}-kill.png"
            plots["TTFT p99 around the kill"] = _kill_plot(trace, kills, colours, kills[0].killed_at_s, path)
    return plots


def _trace_page(
    trace: str, results: Sequence[RunResult], command: str, note: str | None, plots: Mapping[str, Path]
) -> str:
    parts = [f"# Replay: {trace}", f"Command:\n\n```\n{command}\n```", format_table(results, trace=trace)]
    if note:
        parts.append(f"## Notes\n\n{note.strip()}")
    if plots:
        parts.append("## Plots\n\n" + "\n\n".join(f"![{caption}]({p.name})" for caption, p in plots.items()))
    return "\n\n".join(parts) + "\n"


def _goodput_cell(row: Goodput) -> str:
    """A goodput as utilisation: "≥" when the top of the search passed, "<" when its bottom missed."""
    if row.utilisation == 0:
        return f"< {100 * SEARCH_LOW:.0f}%"
    return f"{'≥ ' if row.above is None else ''}{100 * row.utilisation:.0f}%"


def _goodput_ratio(rows: Sequence[Goodput]) -> tuple[str, float | None]:
    """(best baseline's name, Prism's goodput over its) on one workload; None when either is missing or 0."""
    prism = next((r for r in rows if r.policy == PRISM), None)
    baselines = [r for r in rows if r.policy != PRISM]
    best = max(baselines, key=lambda r: r.utilisation, default=None)
    if prism is None or best is None or best.utilisation == 0:
        return (MISSING if best is None else best.policy), None
    return best.policy, prism.utilisation / best.utilisation


def goodput_summary(rows: Sequence[Goodput]) -> str:
    """Goodput per workload (rows) and policy (columns) as utilisation, the best baseline and Prism's ratio to
    it, and a closing line counting Prism's wins, ties and losses with their geometric mean."""
    policies = _policies(rows)
    header = ["workload", *policies, "best baseline", "Prism / best"]
    table, ratios = [], []
    for trace in _ordered(r.trace for r in rows):
        on = [r for r in rows if r.trace == trace]
        cells = {r.policy: _goodput_cell(r) for r in on}
        best, ratio = _goodput_ratio(on)
        if ratio is not None:
            ratios.append(ratio)
        table.append(
            [trace, *(cells.get(p, MISSING) for p in policies), best, MISSING if ratio is None else f"{ratio:.2f}×"]
        )
    text = _md_table(header, table, text_columns=(0, len(header) - 2))
    if ratios:
        wins = sum(1 for r in ratios if r > 1.02)
        losses = sum(1 for r in ratios if r < 1 / 1.02)
        mean = geometric_mean(ratios) or 0.0
        text += (
            f"\n\nPrism's goodput over the best baseline's, on {len(ratios)} workloads: ahead by more than 2% on "
            f"{wins}, behind by more than 2% on {losses}, within 2% on {len(ratios) - wins - losses}; geometric "
            f"mean {mean:.2f}×."
        )
    return text


def _goodput_plot(rows: Sequence[Goodput], colours: Mapping[str, str], path: Path) -> Path:
    """Goodput bars: one group per workload, one bar per policy, log y (none drawn: below the search's floor)."""
    traces = _ordered(r.trace for r in rows)
    title = f"Goodput: highest load with ≥ {GOODPUT_TARGET:.0%} of requests within their TTFT SLO"
    figure, axes = _axes(title, (14.0, 5.0))
    loads = {p: [(traces.index(r.trace), 100 * r.utilisation) for r in rows if r.policy == p] for p in colours}
    _bars(axes, colours, loads)
    axes.set_xticks(range(len(traces)), traces, rotation=45, ha="right")
    _log_y(axes)
    axes.set_ylim(100 * SEARCH_LOW / 2, 100 * SEARCH_HIGH * 1.2)
    axes.set_ylabel("goodput (utilisation %)")
    return _save(figure, axes, path, legend_columns=5)


def _attainment_plot(rows: Sequence[Goodput], colours: Mapping[str, str], path: Path) -> Path:
    """SLO attainment against arrival rate, one panel per workload, one line per policy through the goodput
    search's probes; the target as a dashed line."""
    traces = _ordered(r.trace for r in rows)
    columns = 3
    lines = math.ceil(len(traces) / columns)
    figure = Figure(figsize=(14.0, 3.0 * lines + 0.6), dpi=_DPI)
    FigureCanvasAgg(figure)
    for n, trace in enumerate(traces):
        axes = figure.add_subplot(lines, columns, n + 1)
        axes.set_title(trace, fontsize="medium")
        for row in rows:
            if row.trace == trace and row.curve:
                axes.plot(
                    *zip(*((x, 100 * y) for x, y in row.curve)), marker=".", color=colours[row.policy], label=row.policy
                )
        axes.axhline(100 * GOODPUT_TARGET, color="black", linestyle="--", linewidth=0.8)
        axes.set_xscale("log")
        axes.set_ylim(0, 102)
        axes.set_xlabel("arrival rate (requests/s)", fontsize="small")
        axes.set_ylabel("SLO attainment %", fontsize="small")
    handles, labels = figure.axes[0].get_legend_handles_labels() if figure.axes else ([], [])
    if handles:
        figure.legend(handles, labels, loc="lower center", ncols=min(len(labels), 10), fontsize="small")
    figure.tight_layout(rect=(0, 0.6 / (3.0 * lines + 0.6), 1, 1))
    return _png(figure, path)


def _summary_page(
    results: Sequence[RunResult],
    command: str,
    goodput: Sequence[Goodput],
    gray_goodput: Sequence[Goodput],
    gray: str,
    ablations: str | None,
    plots: Sequence[Path],
) -> str:
    index = "\n".join(f"- [{t}]({t}.md)" for t in _ordered(r.trace for r in results))
    parts = [f"# Replay summary\n\nCommand:\n\n```\n{command}\n```"]
    if goodput:
        parts.append(
            "## Goodput\n\nPer workload and policy, the highest load (offered prefill work without cache hits, "
            f"over the cluster's prefill capacity) at which at least {GOODPUT_TARGET:.0%} of requests met their "
            "TTFT SLO, max(τ0 of the slice, 5 × the request's unloaded TTFT) (sim/_slo.py, docs/eval.md); searched "
            f"from {100 * SEARCH_LOW:.0f}% to {100 * SEARCH_HIGH:.0f}%. Ratio above 1: Prism serves more load "
            f"within the SLO than the best baseline.\n\n{goodput_summary(goodput)}"
        )
        parts.append("\n\n".join(f"![{p.stem}]({p.name})" for p in plots))
    if gray_goodput:
        parts.append(
            f"## Goodput under a gray failure\n\nThe same search with {gray}. Health checks pass on all three; what "
            f"they cost each policy is what it sees of them.\n\n{goodput_summary(gray_goodput)}"
        )
    parts.append(
        f"## TTFT p99 at {100 * HEADLINE_UTILISATION:.0f}% utilisation\n\nPrism against the baseline with the "
        f"lowest p99 (ratio below 1: Prism is faster).\n\n{headline(results)}"
    )
    if ablations:
        parts.append(f"## Ablations\n\n{ablations}")
    parts.append(f"## Workloads\n\n{index}")
    return "\n\n".join(parts) + "\n"


def write_report(
    results: Sequence[RunResult],
    out_dir: Path,
    *,
    command: str,
    notes: Mapping[str, str] | None = None,
    goodput: Sequence[Goodput] = (),
    gray_goodput: Sequence[Goodput] = (),
    gray: str = "a gray failure",
    ablations: str | None = None,
) -> list[Path]:
    """Write `<trace>.md` (with `notes[trace]`) and its PNGs, and `summary.md`, which leads with the goodput
    table and its plots (`goodput.png`, `attainment.png`) when `goodput` is given, the same table under a gray
    failure (`gray_goodput`, the failure described by `gray`), then the 80% headline and the `ablations` table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for trace in _ordered(r.trace for r in results):
        runs = [r for r in results if r.trace == trace]
        plots = _plots(trace, runs, out_dir)
        page = out_dir / f"{trace}.md"
        page.write_text(_trace_page(trace, runs, command, (notes or {}).get(trace), plots), encoding="utf-8")
        written += [page, *plots.values()]
    summary_plots = []
    if goodput:
        colours = {policy: f"C{i % 10}" for i, policy in enumerate(_policies(goodput))}
        with matplotlib.rc_context(_RC):
            summary_plots = [
                _goodput_plot(goodput, colours, out_dir / "goodput.png"),
                _attainment_plot(goodput, colours, out_dir / "attainment.png"),
            ]
    summary = out_dir / "summary.md"
    summary.write_text(
        _summary_page(results, command, goodput, gray_goodput, gray, ablations, summary_plots), encoding="utf-8"
    )
    return [*written, *summary_plots, summary]
