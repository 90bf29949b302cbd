"""What the demo shows: the live view while it runs (a table redrawn in place on a terminal, one status line
per second otherwise) and the closing summary."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING

from prismlb.semantics import quantile

from ._processes import AGENT_PERIOD_S
from ._results import UNFINISHED, describe_moves, llm_nodes
from ._window import describe_transitions, total_transitions, window_cell
from ._workload import TOKEN_SCALE, prefix_cache_bound

if TYPE_CHECKING:
    from ._load import Demo

HIDE_CURSOR = "\x1b[?25l"
SHOW_CURSOR = "\x1b[?25h"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The project's `quantile` (q in 0..1) for the view, which shows None as "-"; None for no values."""
    return quantile(values, q) if values else None


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _ratio(part: int, whole: int) -> str:
    return "-" if not whole else f"{part / whole:.1%}"


class LiveView:
    """A running demo on `out`: when `live` (a terminal) a table redrawn in place with the last events under it;
    otherwise each event as it happens and one status line per draw, for logs and pipes."""

    def __init__(self, out: IO[str], live: bool) -> None:
        self.out = out
        self.live = live
        self._drawn = 0

    def event(self, line: str) -> None:
        """An event line: printed now unless the live table shows it."""
        if not self.live:
            print(line, file=self.out, flush=True)

    def rows(self, demo: Demo) -> list[str]:
        table = demo.table
        weights = {n.node_id: n.weight for n in llm_nodes(table)}
        done = len(demo.results)
        errors = sum(1 for r in demo.results if r.error)
        version = f"{table.epoch}.{table.version}" if table is not None else "none"
        lines = [
            f"prism demo {demo.now():5.1f}s  trace {min(demo.now() * demo.speedup, demo.requests[-1].at_s):4.0f} s"
            f"  sent {demo.sent}/{len(demo.requests)}  done {done}  errors {errors}"
            f"  in flight {demo.sent - done}  table {version}",
            f"{'node':<8} {'gpu':<5} {'weight':>6} {'in flight':>9} {'KV use':>7} {'cache hit':>9} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'done':>5} {'err':>4} {'batch window':>16}",
        ]
        for node in demo.cluster.nodes:
            s = demo.stats[node.node_id]
            weight = weights.get(node.node_id)
            p50, p99 = percentile(s.ttft_ms, 0.5), percentile(s.ttft_ms, 0.99)
            state = "killed" if node.killed_at is not None else ""
            lines.append(
                f"{node.node_id:<8} {node.gpu:<5} {_num(weight, '{:.2f}'):>6} {s.inflight:>9} "
                f"{_num(s.kv_usage, '{:.1%}'):>7} {_ratio(s.cached_tokens, s.prompt_tokens):>9} "
                f"{_num(p50, '{:.0f} ms'):>9} {_num(p99, '{:.0f} ms'):>9} {s.ok:>5} {s.errors:>4} "
                f"{window_cell(s.window):>16} {state}"
            )
        return lines

    def draw(self, demo: Demo, final: bool = False) -> None:
        if self.live:
            width = shutil.get_terminal_size((120, 40)).columns
            lines = [*self.rows(demo), "", *demo.events[-6:]]
            frame = ("\x1b[%dF\x1b[J" % self._drawn if self._drawn else "") + "\n".join(line[:width] for line in lines)
            self.out.write(frame + "\n")
            self.out.flush()
            self._drawn = len(lines)
            if final:
                self._drawn = 0
            return
        weights = {n.node_id: n.weight for n in llm_nodes(demo.table)}
        nodes = " | ".join(
            f"{n.node_id} w {_num(weights.get(n.node_id), '{:.2f}')} if {demo.stats[n.node_id].inflight}"
            f" p99 {_num(percentile(demo.stats[n.node_id].ttft_ms, 0.99), '{:.0f}ms')}"
            f" bw {window_cell(demo.stats[n.node_id].window)}"
            for n in demo.cluster.nodes
        )
        print(f"{self.rows(demo)[0]} || {nodes}", file=self.out, flush=True)


def summary(demo: Demo, wall_s: float, time_scale: float, load: float) -> list[str]:
    """The closing report: requests, errors, TTFT and cache hits per node, the batch window, the kill, the brain,
    the agents."""
    finished = [r for r in demo.results if r.error != UNFINISHED]
    ok = [r for r in finished if r.error is None]
    errors = [r for r in finished if r.error is not None]
    kill = demo.kill
    around = (kill.at_s, (kill.removed_at_s or kill.at_s) + 2 * AGENT_PERIOD_S) if kill is not None else None
    at_kill = [
        r
        for r in errors
        if kill is not None
        and around is not None
        and r.end_s >= around[0]
        and (r.node == kill.victim or r.end_s <= around[1])
    ]
    other = [r for r in errors if r not in at_kill]
    span = demo.requests[-1].at_s
    lines = [
        "",
        f"== summary: {len(demo.requests)} Mooncake conversation requests, trace 0–{span:.0f} s replayed "
        f"×{demo.speedup:.1f} in {demo.replay_end:.0f} s, each 1/{TOKEN_SCALE} of its size; engines at time_scale "
        f"{time_scale:.2f} for {load:.0%} offered prefill load; demo wall time {wall_s:.1f} s",
        f"   requests: {len(ok)} answered, {len(errors)} errors ({len(at_kill)} around the kill, other errors: "
        f"{len(other)}), {demo.not_sent} not sent and {demo.unfinished} unfinished at the time bound",
    ]
    if other:
        kinds: dict[str, int] = {}
        for r in other:
            kinds[r.error or "?"] = kinds.get(r.error or "?", 0) + 1
        lines.append("   other errors by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    header = f"{'node':<8} {'gpu':<5} {'answered':>8} {'errors':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'cache hit':>9}"
    lines.append("   " + header)

    def row(name: str, gpu: str, answered: int, failed: int, ttft: list[float], cached: int, prompt: int) -> str:
        p50 = _num(percentile(ttft, 0.5), "{:.0f} ms")
        p99 = _num(percentile(ttft, 0.99), "{:.0f} ms")
        return f"   {name:<8} {gpu:<5} {answered:>8} {failed:>6} {p50:>9} {p99:>9} {_ratio(cached, prompt):>9}"

    for node in demo.cluster.nodes:
        s = demo.stats[node.node_id]
        killed = "  (killed)" if node.killed_at is not None else ""
        lines.append(row(node.node_id, node.gpu, s.ok, s.errors, s.ttft_ms, s.cached_tokens, s.prompt_tokens) + killed)
    prompt = sum(s.prompt_tokens for s in demo.stats.values())
    cached = sum(s.cached_tokens for s in demo.stats.values())
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    lines.append(row("total", "", len(ok), len(errors), ttft, cached, prompt))
    lines.append(
        f"   prefix-cache hit rate: {_ratio(cached, prompt)} of {prompt} prompt tokens (engines' "
        f"usage.cached_tokens); one infinite prefix cache would reach {prefix_cache_bound(demo.requests):.1%}"
    )
    lines.append("   TTFT: measured by the load generator, wall clock, to the first streamed chunk")
    lines.extend(_window_lines(demo, ttft))
    if kill is not None:
        if kill.removed_at_s is not None and kill.table_before:
            lines.append(
                f"   kill: {kill.victim} at {kill.at_s:.1f} s, out of the table at {kill.removed_at_s:.1f} s "
                f"(table {kill.table_before} → {kill.table_after}); keys moved at the kill: {describe_moves(kill)}"
            )
        else:
            lines.append(f"   kill: {kill.victim} at {kill.at_s:.1f} s; the brain had not dropped it by the end")
    first, last = demo.first_table, demo.table
    if first is not None and last is not None:
        lines.append(
            f"   brain: routing tables {first.epoch}.{first.version} to {last.epoch}.{last.version} "
            f"({len(demo.tables)} distinct seen by the router)"
        )
    trips = demo.router.round_trips if demo.router is not None else None
    asked = sum(trips.buckets) if trips is not None else 0
    if trips is not None and asked:
        lines.append(
            f"   router: {asked} round trips to the engines' /tokenize for a request's token ids, mean "
            f"{trips.seconds / asked * 1e3:.1f} ms, {trips.failed} failed (those requests kept their text blocks)"
        )
    for node_id, counts in sorted(demo.agent_counts.items()):
        server, joined = counts.get("server_spans"), counts.get("joined")
        join = ""
        if counts.get("ebpf") and server and joined is not None:
            join = f", {int(joined)}/{int(server)} server spans joined to kernel connections"
        lines.append(
            f"   agent {node_id}: {int(counts.get('spans') or 0)} spans received over OTLP, "
            f"{int(counts.get('kv_events') or 0)} KV events ({'eBPF on' if counts.get('ebpf') else 'eBPF off'}{join})"
        )
    return lines


def _window_lines(demo: Demo, ttft: list[float]) -> list[str]:
    """The batch window's part of the summary: the TTFT P99 of every answered request beside the engines' breaker
    transitions on one line, to set against a run with another `--batch-window`; then what each engine's window
    did, as its own `/metrics` last showed it."""
    choice = demo.cluster.batch_window
    reports = {n.node_id: demo.stats[n.node_id].window for n in demo.cluster.nodes}
    p99 = _num(percentile(ttft, 0.99), "{:.0f} ms")
    breaker = ""
    if any(r is not None and r.state is not None for r in reports.values()):
        breaker = f"; breaker transitions, all engines: {describe_transitions(total_transitions(reports.values()))}"
    lines = [f"   batch window {choice}: TTFT p99 {p99} over {len(ttft)} answered requests{breaker}"]
    if all(r is None and not demo.stats[n].unreadable_metrics for n, r in reports.items()):
        return lines  # no window on any engine (`none`): nothing more to show
    lines.append(
        f"   {'engine':<8} {'window now':>10} {'breaker':>9} {'batches':>7} {'overran':>7}  breaker transitions"
        " (engine's /metrics; window in model seconds)"
    )
    for node in demo.cluster.nodes:
        stats, report = demo.stats[node.node_id], reports[node.node_id]
        notes = ["killed: as last read before the kill"] if node.killed_at is not None else []
        if stats.unreadable_metrics:
            notes.append(f"{stats.unreadable_metrics} /metrics reads unreadable")
        note = f"  ({'; '.join(notes)})" if notes else ""
        if report is None:
            lines.append(f"   {node.node_id:<8} {'-':>10}  no /metrics read{note}")
            continue
        breaker_state = report.state or "-"
        overran = "-" if report.overruns is None else str(report.overruns)
        transitions = describe_transitions(report.transitions) if report.state is not None else "no breaker"
        lines.append(
            f"   {node.node_id:<8} {report.window_s * 1e3:>7.0f} ms {breaker_state:>9} {report.batches:>7} "
            f"{overran:>7}  {transitions}{note}"
        )
    return lines
