"""Node health from whatever dimensions a node vector carries (the design's weights, renormalised)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from prismlb.wire import NodeMetrics


def _mem_util(m: NodeMetrics) -> float | None:
    if m.mem_used_bytes is None or not m.mem_total_bytes:
        return None
    return m.mem_used_bytes / m.mem_total_bytes


@dataclass(frozen=True)
class Dimension:
    """One health dimension: how to read it, where it alarms (same unit) and its weight."""

    name: str
    read: Callable[[NodeMetrics], float | None]
    alarm: float
    weight: float


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("gpu_mem_frag_ratio", attrgetter("gpu_mem_frag_ratio"), 0.45, 0.32),
    Dimension("kv_cache_miss_ratio", attrgetter("kv_cache_miss_ratio"), 0.18, 0.27),
    Dimension("cpu_preproc_p95_ms", attrgetter("cpu_preproc_p95_ms"), 120.0, 0.21),
    Dimension("nvlink_util_ratio", attrgetter("nvlink_util_ratio"), 0.82, 0.20),
    # Host dimensions (not in the design): weighted below every GPU/engine dimension.
    Dimension("cpu_util_ratio", attrgetter("cpu_util_ratio"), 0.90, 0.10),
    Dimension("mem_util_ratio", _mem_util, 0.90, 0.10),
    # Network dimensions (not in the design either), from the agent's eBPF path over its period. A lost
    # segment stalls its stream until it is resent (a retransmission timeout is 200 ms at least), a lost SYN for
    # a second, so a lossy node is slow for every request it serves: retransmits weigh like NVLink, the rest like
    # the host's dimensions.
    # - retransmits per connection: a sound network retransmits almost never; 0.5 means every other
    #   connection lost a segment in the period (about 0.1% loss on a 500-token stream, one segment a token).
    Dimension("tcp_retransmits_per_conn", attrgetter("tcp_retransmits_per_conn"), 0.5, 0.20),
    # - handshake P95 (this host as a client): a lost SYN or SYN-ACK costs the 1 s initial retransmission
    #   timeout and a full listen queue drops SYNs, so over 200 ms means more than 5% of handshakes hit one;
    #   a sound path, even between zones, completes well under it.
    Dimension("tcp_handshake_p95_ms", attrgetter("tcp_handshake_p95_ms"), 200.0, 0.10),
    # - resets: cancelled requests reset some connections on a sound node; several a second sustained means
    #   connections dying (a crashed engine's port, a peer aborting), so its alarm is at 5/s and its weight low.
    Dimension("tcp_resets_per_s", attrgetter("tcp_resets_per_s"), 5.0, 0.05),
    # - connects that never completed: one a second sustained is a peer or a port down (an agent retrying a dead
    #   brain backs off to one connect in 2 s: 0.5/s, under the alarm, and shared by every node).
    Dimension("tcp_refused_per_s", attrgetter("tcp_refused_per_s"), 1.0, 0.10),
)


@dataclass(frozen=True)
class Health:
    score: float
    alarms: tuple[str, ...]
    dimensions: tuple[str, ...]


_DIMENSION_ROWS = tuple((d.name, d.read, d.alarm, d.weight) for d in DIMENSIONS)


def health(metrics: NodeMetrics) -> Health:
    """Weighted mean of the present dimensions' scores, 1.0 when none is present. A dimension scores 1.0 when
    idle, 0.5 at its alarm threshold and 0.0 from twice the threshold (written inline: the brain scores every
    vector it takes)."""
    total_weight = 0.0
    weighted = 0.0
    alarms: list[str] = []
    present: list[str] = []
    for name, read, alarm, weight in _DIMENSION_ROWS:
        value = read(metrics)
        if value is None:
            continue
        present.append(name)
        total_weight += weight
        score = 1.0 - 0.5 * value / alarm
        if score > 0.0:
            weighted += weight * score
        if value > alarm:
            alarms.append(name)
    score = weighted / total_weight if total_weight else 1.0
    return Health(score=score, alarms=tuple(alarms), dimensions=tuple(present))
