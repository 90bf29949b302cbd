"""What the replay records: each request's result, each node's running totals, and the accounting of which
prefix keys moved when a node was killed. The load generator fills them; the view and the summary read them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prismlb.router import Ring
from prismlb.semantics import Slice
from prismlb.wire import RoutingTable, TableNode

from ._window import WindowReport

UNFINISHED = "unfinished at the time bound"


@dataclass
class Result:
    index: int
    key: str
    node: str | None
    sent_s: float
    end_s: float
    ttft_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class NodeStats:
    """One node's running totals over the requests sent to it."""

    ok: int = 0
    errors: int = 0
    """Requests that failed; those cut off by the time bound are neither these nor `ok`."""
    inflight: int = 0
    """Requests sent and not ended yet."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Of the completed requests' prompt tokens, those the engine found in its prefix cache (its `usage`)."""
    ttft_ms: list[float] = field(default_factory=list)
    kv_usage: float | None = None
    """The engine's KV-cache usage at its last `/metrics` read; None before the first and once it is killed."""
    window: WindowReport | None = None
    """The engine's batch window at its last `/metrics` read (a killed node's: the last read before the kill)."""
    unreadable_metrics: int = 0
    """Reads of the engine's `/metrics` that were not a Prometheus exposition (counted, the last report kept)."""


@dataclass
class KillReport:
    victim: str
    at_s: float
    removed_at_s: float | None = None
    table_before: str = ""
    table_after: str = ""
    keys: int = 0
    moved: int = 0
    from_victim: int = 0
    by_weight: int = 0
    unexplained: int = 0
    reweighted: tuple[str, ...] = ()


def llm_nodes(table: RoutingTable | None) -> list[TableNode]:
    """The text slice's nodes (the demo's agents report no GPU labels, so every node serves text)."""
    if table is None:
        return []
    return next((s.nodes for s in table.slices if s.name == Slice.LLM), [])


def moved_keys(before: RoutingTable, after: RoutingTable, keys: Sequence[str], victim: str) -> KillReport:
    """Which ring node owns each of `keys` on each table's text slice (ownership only: the router's bounded
    load may still send a key elsewhere): what moved, and why."""
    ring_before, ring_after = Ring.build(llm_nodes(before)), Ring.build(llm_nodes(after))
    placed = {k: ring_before.lookup(k).node_id for k in keys}
    now = {k: ring_after.lookup(k).node_id for k in keys}
    weight = {n.node_id: n.weight for n in llm_nodes(before)}
    reweighted = tuple(sorted(n.node_id for n in llm_nodes(after) if n.weight != weight.get(n.node_id)))
    moved = [k for k in keys if placed[k] != now[k]]
    from_victim = [k for k in moved if placed[k] == victim]
    by_weight = [k for k in moved if placed[k] != victim and {placed[k], now[k]} & set(reweighted)]
    return KillReport(
        victim,
        0.0,
        table_before=f"{before.epoch}.{before.version}",
        table_after=f"{after.epoch}.{after.version}",
        keys=len(keys),
        moved=len(moved),
        from_victim=len(from_victim),
        by_weight=len(by_weight),
        unexplained=len(moved) - len(from_victim) - len(by_weight),
        reweighted=reweighted,
    )


def describe_moves(report: KillReport) -> str:
    weight = ""
    if report.by_weight:
        weight = f", {report.by_weight} with the weight change of {', '.join(report.reweighted)}"
    return (
        f"{report.moved} of {report.keys} prefix keys seen moved: {report.from_victim} from {report.victim}{weight}; "
        f"between surviving nodes without a weight change: {report.unexplained}"
    )
