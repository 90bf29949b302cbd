"""What the cluster replay passes around: requests from a trace, engine statistics, and the policy seam."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from prismlb.wire import NodeVector


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a replayed trace.

    `blocks` are the ids of the prompt's prefix blocks of `Workload.block_tokens` tokens each, chained as an
    engine's prefix cache hashes them: two requests share block id `i` exactly when their first `i + 1` blocks
    are identical (Mooncake's `hash_ids`); traces without prefix information get ids no other request uses.
    """

    id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    signature: str = "text"
    """`X-Modality-Signature`: `text`, `image+text`, `audio+text`, `video+text`, ..."""
    media: Mapping[str, int] = field(default_factory=dict)
    """Media parts by modality (`image`, `audio`, `video`): each adds its encoder time to prefill."""
    media_tokens: int = 0
    """Tokens the media parts add to the prompt (counted in `input_tokens` too)."""
    session: str | None = None
    """The conversation the request belongs to, when the trace tells."""
    skeleton: tuple[str, ...] = ()
    """The prompt's structure, piece kinds in order (`kind:log2 length`, then one entry per media part), for
    structure-aware placement experiments (`bench/semantic_affinity.py`); empty when the trace does not tell."""


@dataclass(frozen=True, slots=True)
class Workload:
    """A trace turned into requests, in arrival order (arrival_s from 0)."""

    name: str
    requests: Sequence[SimRequest]
    block_tokens: int
    source: str
    """Where the trace comes from (paper, repository, file) and how it was turned into requests."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What a node's engine reports on `/metrics` at one moment (vLLM's gauges and counters)."""

    running: int
    waiting: int
    kv_usage: float
    """KV-cache blocks in use (referenced or cached), over capacity."""
    prefix_queries_tokens: int
    prefix_hits_tokens: int


class Outcome(Enum):
    """How an attempt ended, as a policy is told in `finished`."""

    OK = "ok"
    """The node answered: the request completed."""
    CONNECT_ERROR = "connect_error"
    """The node was down: nothing was sent; the caller retries elsewhere."""


@dataclass(frozen=True, slots=True)
class SimNode:
    """A node as policies see it: a name, its address and the hardware it stands for."""

    name: str
    address: str
    gpu_class: str
    """Its engine's hardware profile (`_model.PROFILES`: "a100", "h100", "l40s")."""
    numa_node: int
    """The host NUMA node its GPU hangs off; a gateway on the other one crosses the interconnect to reach it."""


@dataclass(frozen=True, slots=True)
class KvEvent:
    """One node's KV-cache changes as a KV-event subscriber receives them (vLLM's `BlockStored` and
    `BlockRemoved` over ZeroMQ): the block ids it evicted, then those it cached, since its previous batch."""

    node: str
    time_s: float
    """When the engine published the batch (its delivery comes `KV_EVENT_DELAY_S` later)."""
    removed: tuple[int, ...]
    stored: tuple[int, ...]


class ClusterView(Protocol):
    """What a policy may read about the cluster, at the simulated time of the call."""

    @property
    def nodes(self) -> Sequence[SimNode]: ...

    def stats(self, name: str) -> EngineStats | None:
        """A scrape of the node's `/metrics`; None when the node does not answer (down)."""

    def vectors(self) -> Sequence[NodeVector]:
        """Node vectors the nodes' agents sent since the last call (Prism's path; dead nodes send none)."""

    def kv_events(self) -> Sequence[KvEvent]:
        """KV-event batches delivered since the last call, oldest first (the path of routers that subscribe to
        the engines' events). Like a ZeroMQ subscriber, a policy sees only what was published after its first
        call, which is best made in `start`."""


class Policy(ABC):
    """A routing policy under replay. The simulator calls, in simulated time `now` (seconds):
    `start` once, `admit` per request (a policy may hold it and hand it back through `released`), `choose` per
    attempt, `dispatched` / `first_token` / `finished` per attempt, `tick` every `tick_s`. `choose` must not return
    a name in `exclude` unless every node is excluded."""

    name: str = "policy"
    tick_s: float = 1.0

    def start(self, view: ClusterView, now: float) -> None:
        """Called once before the first request."""

    @abstractmethod
    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        """The node name for this attempt of `request`."""

    def admit(self, request: SimRequest, now: float) -> bool:
        """Whether the request, arriving, goes at once (`choose` follows); False: the policy holds it until
        `released` hands it back."""
        return True

    def released(self, now: float) -> list[SimRequest]:
        """Held requests to send now, in order; the simulator asks again after sending them, and after every event,
        while `holding` is not 0."""
        return []

    @property
    def holding(self) -> int:
        """Requests the policy holds."""
        return 0

    def dispatched(self, node: str, request: SimRequest, now: float) -> None:
        """The request was sent to `node` (or the connect was tried)."""

    def first_token(self, node: str, request: SimRequest, now: float) -> None:
        """The first token came back."""

    def finished(self, node: str, request: SimRequest, now: float, outcome: Outcome) -> None:
        """The attempt ended (completed, or failed to connect)."""

    def retransmitted(self, node: str, request: SimRequest, segments: int, now: float) -> None:
        """Just before a completed attempt's `finished`: the segments of the request that the caller's kernel sent
        again on the way to `node` (0 for most), as a caller reads them from its connection (`TCP_INFO`)."""

    def tick(self, view: ClusterView, now: float) -> None:
        """Periodic work: scrape metrics, ingest vectors, publish tables."""

    def close(self) -> None:
        """Release what the policy holds."""


@dataclass(frozen=True, slots=True)
class SliceStats:
    """Time to first token of one slice's (or all) completed requests."""

    count: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    slo_attainment: float
    """Share of the slice's requests with a first token whose TTFT was within their SLO: in `prism eval` each
    request's own (`_slo.slo_s`), in a bare `Simulation` the slice's τ0 (`brain.TAU0_MS`)."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """One replay: a policy on a trace at a utilisation level."""

    trace: str
    policy: str
    utilisation: float
    seed: int
    requests: int
    completed: int
    failed_attempts: int
    """Attempts that hit a dead node (each is retried on another node)."""
    slices: Mapping[str, SliceStats]
    """"all", then each slice present ("llm", "vlm", "av", "rag")."""
    kv_hit_rate: float
    """Prompt tokens found in the chosen node's prefix cache, over all prompt tokens."""
    kv_hit_bound: float
    """The same with one infinite cache shared by all nodes: no policy can do better."""
    load_max_over_mean: float
    """Requests in flight, time-averaged per node: the busiest node's over the mean."""
    cross_numa_share: float
    """Share of requests sent from a gateway to a node on the other NUMA node."""
    killed_node: str | None
    killed_at_s: float | None
    """Simulated second of the kill (None: no kill)."""
    recovery_s: float | None
    """Seconds from the kill until the policy stopped sending requests to the dead node: the end of the last
    1-second window with two or more attempts there (lone health probes do not count); None: no kill."""
    timeline: Sequence[tuple[float, float]]
    """(simulated s, TTFT P99 ms of requests that got their first token in that window), for plots."""
    wall_s: float
    ttft_s: Mapping[int, float] = field(default_factory=dict)
    """TTFT in seconds of each request that completed, by request id: per-request SLOs (`_slo`) need each
    request's own value; a request that failed or broke off after its first token is absent."""
    ttft_p99_floor_ms: float = float("nan")
    """P99 of the requests' least possible TTFTs on the cluster (`_slo.ttft_floors_s`): no policy's TTFT p99 is
    below it (NaN: not computed)."""
