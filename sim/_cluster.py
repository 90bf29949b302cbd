"""Cluster replay: a discrete-event simulation of engines (`EngineModel`) under a routing policy, in simulated time.

Per request of a workload, at its arrival: the policy chooses a node; a dead node refuses the connection (the
attempt fails at once and the caller tries again with that node excluded, up to `MAX_ATTEMPTS`); a live one
queues it. Each node's engine model runs in simulated time; its first tokens and ends go back to the policy.
Each live node's agent sends a node vector every `vector_period_s`: `prism agent`'s own sampler, with sources
that read the simulated engine where the agent reads the hardware (`_Node`); the policy's `tick` runs every
`tick_s`. A node killed mid-run loses its requests in flight (each tried again elsewhere) and stops
answering and reporting. A degraded node (`Degrade`, a gray failure) keeps answering, slower: its GPU at a
fraction of its speed, or its network losing segments both ways, which stall requests on retransmission timeouts
and show where they are sent again: a request's lost segments in its caller's kernel (the policy's `retransmitted`,
which Prism's routers read from `TCP_INFO`), a first token's in the node's (its agent's `tcp_retransmits_per_conn`),
or shared with callers that do not go through the policy (foreign requests its engine serves beside the policy's,
which only its agent's figures show).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import cast

from prismlb.agent._engine import _VLLM, EngineCollector, EngineSample, _read
from prismlb.agent._network import NetworkWindow, TcpCounts
from prismlb.agent._node import NodeSampler, Reading, Source, to_vector
from prismlb.agent._sources import KV_MISS_PERIOD_S, NVLINK_PERIOD_S
from prismlb.agent._sources import _engine as engine_reading
from prismlb.agent._windows import SliceWindows
from prismlb.brain import TAU0_MS
from prismlb.semantics import Slice, parse_signature, quantile
from prismlb.wire import NodeVector

from ._engine import _E2E_BUCKETS, _TTFT_BUCKETS
from ._model import PROFILES, EngineModel, Event, GpuClass, Job
from ._types import EngineStats, KvEvent, Outcome, Policy, RunResult, SimNode, SimRequest, SliceStats, Workload

MAX_ATTEMPTS = 4
_IN_TRANSIT = frozenset({"arrive", "deliver", "seen"})
"""Events that carry a request still to be answered: a request to send, to reach its engine or to reach its caller."""
TIMELINE_WINDOW_S = 10.0
RECOVERY_WINDOW_S = 1.0
CONNECT_REFUSED_S = 0.001
"""A refused connect costs the caller a loopback round trip before it tries the next node."""
KV_EVENT_DELAY_S = 0.05
"""From a cache change to its KV event at a subscriber: vLLM takes the events at the end of the engine step
that made them (tens of milliseconds with a busy batch) and publishes them on ZeroMQ, which a router reads
directly or through a relay (Dynamo's NATS). The replay has no engine steps, so one busy step's worth."""
RTO_S = 0.2
"""Linux's minimum retransmission timeout: what a lost segment of a request costs when nothing follows it in
flight to trigger a fast retransmit (a request is one burst, so its last segments have nothing behind them)."""
SEGMENT_BYTES = 1448
"""TCP payload per segment on a 1,500-byte MTU."""
BYTES_PER_TOKEN = 4
"""Prompt bytes per token on the wire (JSON text of English prose, roughly)."""
HOST_CPU_UTIL_RATIO = 0.05
"""Each node's host CPU utilisation, a constant: the replay models no host CPU (tokenising and HTTP are outside
its engine model), and an inference server's host idles at a few percent while its GPU does the work."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A node to replay: its engine's hardware and where it sits; `Simulation` gives it an address."""

    name: str
    gpu_class: GpuClass
    numa_node: int = 0
    """See `SimNode.numa_node`."""
    labels: Mapping[str, str] | None = None
    """Its agent's labels; "gpu" is the GPU class unless these set it."""


@dataclass(frozen=True, slots=True)
class Kill:
    node: str
    at_fraction: float = 0.5
    """When, as a share of the workload's arrival span."""


@dataclass(frozen=True, slots=True)
class Degrade:
    """A gray failure from `at_fraction` of the arrival span on: the node keeps answering and reporting, but
    its GPU runs `slowdown` times slower (thermal throttling, a noisy neighbour, a failing memory stack) and each
    segment between it and its callers is lost with probability `loss` (a flaky NIC, a congested switch port): a
    request's, stalling it `RTO_S` per lost segment before the engine sees it (its caller sends them again), and its
    first token's, stalling the response `RTO_S` (the node sends it again; what follows waits behind it); and
    callers that do not go through the policy (another team's gateway, a batch job, clients with the node's
    address) send it `foreign` times its prefill capacity in prompts like the workload's: work no router placed,
    so no router counts it, while the node's agent sees its requests and latency as the engine's metrics do."""

    node: str
    at_fraction: float = 0.25
    slowdown: float = 1.0
    loss: float = 0.0
    foreign: float = 0.0

    def __post_init__(self) -> None:
        if not (self.slowdown >= 1 and 0 <= self.loss < 1 and 0 <= self.foreign < 1 and 0 <= self.at_fraction <= 1):
            raise ValueError(
                f"a degradation needs slowdown >= 1, 0 <= loss < 1, 0 <= foreign < 1 and 0 <= at_fraction <= 1: {self}"
            )


def segments(request: SimRequest) -> int:
    """TCP segments the request's prompt takes on the wire (its text tokens: the replay does not model the media
    parts' bytes), and one for the headers: each may be lost on the way to a degraded node."""
    return math.ceil((request.input_tokens - request.media_tokens) * BYTES_PER_TOKEN / SEGMENT_BYTES) + 1


def engine_job(request: SimRequest, model: EngineModel, now: float) -> Job:
    """The job `request` becomes on `model`'s engine, arriving at `now`: at least one output token, and only that one
    when its output cannot fit the cache (an engine truncates it; the prompt itself always fits in a replay)."""
    job = Job(
        request.blocks,
        request.input_tokens,
        max(1, request.output_tokens),
        model.profile.media_s(request.media),
        now,
        media_tokens=request.media_tokens,
    )
    if not model.fits(job):
        job.output_tokens = 1
    return job


def recovery_s(killed_at: float, refused: Sequence[float]) -> float:
    """Seconds from a kill to the end of the last 1-second window after it in which two or more attempts were
    sent to the dead node: until then the policy still routes traffic there. A lone attempt in a window (a
    health probe, such as nginx's retry after `fail_timeout`) does not count; 0 when no window had two."""
    windows: dict[int, int] = {}
    for t in refused:
        k = int((t - killed_at) // RECOVERY_WINDOW_S)
        windows[k] = windows.get(k, 0) + 1
    busy = [k for k, n in windows.items() if n >= 2]
    return (max(busy) + 1) * RECOVERY_WINDOW_S if busy else 0.0


Exposition = dict[str, dict[frozenset[tuple[str, str]], float]]
"""An engine's `/metrics` as the agent's collector parses a page: sample name → value by label set."""


class _ModelScrape(EngineCollector):
    """The agent's collector of an engine, its scrape of `/metrics` at `address` replaced by `exposition`: the
    engine model's counters and histograms under vLLM's names, as the collector parses them: the agent's own deltas
    between scrapes (prefix-cache miss ratio, prefill speed, the engine's latency quantiles) without the HTTP round
    trip and the text format in between."""

    def __init__(self, address: str, exposition: Callable[[], Exposition]) -> None:
        super().__init__(f"{address}/metrics")
        self._exposition = exposition

    def sample(self) -> EngineSample:
        samples = self._exposition()
        previous, self._previous = self._previous, samples
        return _read(_VLLM, samples, previous, self.invalid, self._speed)


def _agent_sources(
    period_s: float,
    clock: Callable[[], float],
    requests: SliceWindows,
    network: NetworkWindow,
    gpu: Callable[[], Reading],
    engine: EngineCollector,
) -> list[Source]:
    """The sources of a simulated agent at their periods, each reading the simulation where the agent reads the
    hardware: a constant host (`HOST_CPU_UTIL_RATIO`), the requests its node served (`requests`, at `clock`'s
    time), its TCP window (`network`), its GPUs (`gpu`) and its engine (`engine`)."""
    return [
        Source("host", period_s, lambda: Reading(metrics={"cpu_util_ratio": HOST_CPU_UTIL_RATIO})),
        Source(
            "load",
            period_s,
            lambda: Reading(
                metrics={"requests_per_s": requests.requests_per_s(clock())}, latency=requests.latency(clock())
            ),
        ),
        Source("ebpf", period_s, lambda: Reading(metrics={**network.read()})),
        Source("gpu", NVLINK_PERIOD_S, gpu),
        Source("engine", KV_MISS_PERIOD_S, lambda: engine_reading(engine)),
    ]


def _agent_vector(
    sampler: NodeSampler,
    name: str,
    endpoint: str,
    labels: Mapping[str, str],
    seq: int,
    now: float,
    period_s: float,
) -> NodeVector:
    """Vector `seq` of the simulated agent on host `name` (a node's or a whole host's): its sources read at `now`,
    simulated time being the agent's clock since its start at 0."""
    return to_vector(
        sampler.tick(now),
        node_id=name,
        host=name,
        endpoint=endpoint,
        labels=labels,
        seq=seq,
        sample_time_unix_s=now,
        period_s=period_s,
        started_unix_s=0.0,
    )


def _le(bounds: Sequence[float]) -> tuple[frozenset[tuple[str, str]], ...]:
    """Each bucket's label set, +Inf last, as a histogram's `_bucket` samples carry them."""
    return (*(frozenset({("le", str(float(b)))}) for b in bounds), frozenset({("le", "+Inf")}))


_NO_LABELS: frozenset[tuple[str, str]] = frozenset()
_TTFT_LE = _le(_TTFT_BUCKETS)
_E2E_LE = _le(_E2E_BUCKETS)


class _Node:
    """One engine, its agent and what the replay measures on it.

    The agent is `prism agent`'s own sampler (`NodeSampler`, `to_vector`) with its sources at their periods,
    each reading the simulated node where the agent reads the real one:
    - engine (`KV_MISS_PERIOD_S`): the agent's engine collector over the model's counters (`_ModelScrape`);
    - load (every vector period): the requests the node served, every caller's, in the agent's per-slice
      windows (`SliceWindows`), each reported at its end with its TTFT and latency from its arrival at the node,
      as its request span is;
    - ebpf (every vector period): the agent's TCP window (`NetworkWindow`) over the node's connections, one a
      request, and the segments lost on the way to it (`Degrade.loss`); the replay has no resets, no refused
      connects to a live node and no handshake times;
    - gpu (`NVLINK_PERIOD_S`): utilisation 1 while the engine runs a request, else 0 (simulated: NVML's is the
      share of its last sample period, under a second, a kernel ran, and a running engine launches them back to
      back);
    - host: `HOST_CPU_UTIL_RATIO` (simulated).
    What the replay has no counterpart for is absent, as on a node whose agent cannot read it: host and GPU
    memory, NVLink and PCIe, fragmentation, CPU preprocessing, connect() calls, the KV-event summary."""

    def __init__(self, spec: NodeSpec, block_tokens: int, index: int, period_s: float) -> None:
        self.spec = spec
        self.info = SimNode(
            spec.name, f"http://10.0.{index // 250}.{index % 250 + 1}:8000", spec.gpu_class, spec.numa_node
        )
        self.model = EngineModel(PROFILES[spec.gpu_class], block_tokens)
        self.alive = True
        self.wake_at = math.inf
        self.labels = {"gpu": spec.gpu_class, **(spec.labels or {})}
        self.seq = 0
        self.now = 0.0  # the agent's clock: the simulated time of its current vector
        self.busy_area = 0.0  # ∫ requests in flight dt, for load max/mean
        self.inflight = 0
        self.last_change = 0.0
        self.jobs: set[Job] = set()
        self.loss = 0.0  # share of segments lost on the way to it (`Degrade`)
        self.foreign_per_s = 0.0  # arrival rate of requests from outside the policy (`Degrade.foreign`)
        # what the engine's /metrics and the kernel's TCP counters hold, cumulative
        self.ttft_buckets = [0] * len(_TTFT_LE)
        self.e2e_buckets = [0] * len(_E2E_LE)
        self.opened = self.ended = self.retransmits = 0
        self.requests = SliceWindows()
        self.network = NetworkWindow(
            lambda: TcpCounts(self.opened, self.ended, self.retransmits, 0, 0), clock=lambda: self.now
        )
        self.sampler = NodeSampler(
            _agent_sources(
                period_s,
                lambda: self.now,
                self.requests,
                self.network,
                lambda: Reading(metrics={"gpu_util_ratio": 1.0 if self.model.running else 0.0}),
                _ModelScrape(self.info.address, self.exposition),
            )
        )

    def account(self, now: float, delta: int) -> None:
        self.busy_area += self.inflight * (now - self.last_change)
        self.last_change = now
        self.inflight += delta

    def stats(self) -> EngineStats:
        m = self.model
        return EngineStats(m.running, len(m.waiting), m.kv_usage, m.prefix_queries_tokens, m.prefix_hits_tokens)

    def first_token(self, job: Job, t: float) -> None:
        """The engine's first token of `job` (any caller's), in its TTFT histogram."""
        self.ttft_buckets[bisect.bisect_left(_TTFT_BUCKETS, t - job.arrival_s)] += 1

    def finished(self, job: Job, slice_name: str, t: float) -> None:
        """The end of `job` (any caller's): its connection closes, the engine observes its latency and its
        request span reaches the agent."""
        assert job.first_token_s is not None
        e2e_s = t - job.arrival_s
        self.e2e_buckets[bisect.bisect_left(_E2E_BUCKETS, e2e_s)] += 1
        self.ended += 1
        self.requests.add(slice_name, t, ttft_ms=(job.first_token_s - job.arrival_s) * 1000, e2e_ms=e2e_s * 1000)

    def exposition(self) -> Exposition:
        """The engine's `/metrics` now, as the agent's collector parses a vLLM page: sample name → value by label
        set (one engine, no labels but the buckets' `le`). The prefill seconds and the prefix-cache counters are both
        counted at admission, so they pair the same requests without the computed-tokens histogram a vLLM engine
        (and `EmulatedEngine`) observes at a request's end with its prefill time: the replay's agent measures its
        speed from the counters, a reply's length sooner than a live one."""
        m = self.model
        queries, hits = _VLLM.cache_counters[0]
        return {
            _VLLM.running: {_NO_LABELS: m.running},
            _VLLM.waiting: {_NO_LABELS: len(m.waiting)},
            _VLLM.kv_usage[0]: {_NO_LABELS: min(1.0, m.kv_usage)},  # vLLM's usage is of its pool: never over 1
            queries: {_NO_LABELS: m.prefix_queries_tokens},
            hits: {_NO_LABELS: m.prefix_hits_tokens},
            f"{_VLLM.prefill_time}_sum": {_NO_LABELS: m.prefill_seconds},
            f"{_VLLM.ttft}_bucket": dict(zip(_TTFT_LE, itertools.accumulate(self.ttft_buckets), strict=True)),
            f"{_VLLM.ttft}_count": {_NO_LABELS: sum(self.ttft_buckets)},
            f"{_VLLM.e2e}_bucket": dict(zip(_E2E_LE, itertools.accumulate(self.e2e_buckets), strict=True)),
        }

    def vector(self, now: float, period_s: float) -> NodeVector:
        """What this node's agent sends now."""
        self.now = now
        self.seq += 1
        return _agent_vector(self.sampler, self.spec.name, self.info.address, self.labels, self.seq, now, period_s)


class _View:
    """The `ClusterView` policies read."""

    def __init__(
        self,
        nodes: Mapping[str, _Node],
        vector_period_s: float,
        agents: Callable[[float], list[NodeVector]],
        requests: Sequence[SimRequest] = (),
    ) -> None:
        self._nodes = nodes
        self._agents = agents
        self.nodes = [n.info for n in nodes.values()]
        self.vector_period_s = vector_period_s
        self.reporting = False
        """Whether the nodes' agents send vectors: from the policy's first `vectors` call."""
        self.pending: list[NodeVector] = []
        self.now = 0.0
        """The simulated time of the policy's current `start` or `tick`."""
        self.kv_subscribed = False
        self.kv_pending: deque[KvEvent] = deque()
        self.requests = requests
        """The replay's requests in arrival order, those still to come included: what no router can know. Only the
        reference that measures what looking ahead would be worth (`_oracle.Lookahead`) reads it."""

    def stats(self, name: str) -> EngineStats | None:
        node = self._nodes.get(name)
        return node.stats() if node is not None and node.alive else None

    def truth(self, name: str) -> _Node | None:
        """The live node `name` itself, its engine and its network: what no router can read. Only a reference
        policy that measures what perfect information would be worth (`_oracle`) reads it; None for a dead node."""
        node = self._nodes.get(name)
        return node if node is not None and node.alive else None

    def vectors(self) -> list[NodeVector]:
        """Vectors sent since the last call. The first call starts the agents, each with a vector now (in `start`,
        or a tick at 0: the agents are up before the first request), so that policies that never read vectors (all
        but Prism's) spare the replay its costliest bookkeeping."""
        if not self.reporting:
            self.reporting = True
            self.pending = self._agents(self.now)
        out, self.pending = self.pending, []
        return out

    def kv_events(self) -> list[KvEvent]:
        """Batches published at least `KV_EVENT_DELAY_S` ago; the first call subscribes (nothing is kept before,
        so policies that never subscribe cost nothing)."""
        self.kv_subscribed = True
        out: list[KvEvent] = []
        while self.kv_pending and self.kv_pending[0].time_s <= self.now - KV_EVENT_DELAY_S:
            out.append(self.kv_pending.popleft())
        return out


@dataclass(slots=True)
class _Attempt:
    request: SimRequest
    node: str
    slice_name: str
    first_token_s: float | None = None
    retransmits: int = 0
    """The request's segments its caller sent again on the way (reported to the policy as the attempt ends)."""
    held_until: float = 0.0
    """Until when the response waits on the wire for its lost first segment, sent again by the node."""
    broken: bool = False
    """The node died under it: what the wire still held of its response never arrives."""


@dataclass(frozen=True, slots=True)
class _Foreign:
    """A job's tag for a request from outside the policy: only the node's agent sees it."""

    slice_name: str


class Simulation:
    """One replay of `workload` on `nodes` under `policy`; `run()` returns its RunResult."""

    def __init__(
        self,
        workload: Workload,
        policy: Policy,
        nodes: Sequence[NodeSpec],
        *,
        utilisation: float,
        seed: int,
        kill: Kill | None = None,
        degrade: Sequence[Degrade] = (),
        vector_period_s: float = 1.0,
        gateways_numa: Sequence[int] = (0, 1),
        slo_s: Callable[[SimRequest], float] | None = None,
    ) -> None:
        """`slo_s` gives each request's TTFT SLO in seconds for the slices' `slo_attainment` (default: its
        slice's τ0, `brain.TAU0_MS`)."""
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        if not workload.requests:
            raise ValueError(f"workload {workload.name!r} has no requests")
        self.workload = workload
        self.policy = policy
        self.utilisation = utilisation
        self.seed = seed
        self.kill = kill
        self.vector_period_s = vector_period_s
        self.gateways_numa = tuple(gateways_numa)
        self.nodes = {spec.name: _Node(spec, workload.block_tokens, i, vector_period_s) for i, spec in enumerate(nodes)}
        if kill is not None and kill.node not in self.nodes:
            raise ValueError(f"cannot kill {kill.node!r}: not a node of the cluster")
        for fault in degrade:
            if fault.node not in self.nodes:
                raise ValueError(f"cannot degrade {fault.node!r}: not a node of the cluster")
        self.degrade = tuple(degrade)
        self._rng = random.Random(seed)  # lost segments
        self._foreign_rng = random.Random(seed + 1)  # foreign arrivals, their sizes and block ids
        self.view = _View(self.nodes, vector_period_s, self.agent_vectors, workload.requests)
        self._heap: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self.ttft: list[tuple[str, float, float, bool]] = []  # (slice, first token time, ttft s, within its SLO)
        self.slo_s = slo_s
        self.completed_ttft: dict[int, float] = {}  # request id -> ttft s, of the requests that completed
        self.failed_attempts = 0
        self.lost = 0
        self.cross_numa = 0
        self.dispatched = 0
        self.killed_at: float | None = None
        self.refused: list[float] = []  # when an attempt was sent to a dead node

    def _push(self, t: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self._heap, (t, next(self._order), kind, payload))

    def run(self) -> RunResult:
        started = time.perf_counter()
        requests = self.workload.requests
        span = requests[-1].arrival_s
        self._vectors(0.0, None)  # the vector schedule; the agents report from the policy's first `vectors` call
        self.policy.start(self.view, 0.0)
        for request in requests:
            self._push(request.arrival_s, "arrive", (request, frozenset(), 0))
        self._push(0.0, "tick")
        if self.kill is not None:
            self._push(self.kill.at_fraction * span, "kill", self.kill.node)
        for fault in self.degrade:
            self._push(fault.at_fraction * span, "degrade", fault)
        remaining = len(requests)
        handlers = {
            "arrive": self._arrive,
            "wake": self._wake,
            "tick": self._tick,
            "vectors": self._vectors,
            "kill": self._kill,
            "degrade": self._degrade,
            "deliver": self._deliver,
            "seen": self._seen,
            "foreign": self._foreign,
        }
        now = 0.0
        while remaining:
            now, _, kind, payload = heapq.heappop(self._heap)
            remaining -= handlers[kind](now, payload)
            while self.policy.holding and (released := self.policy.released(now)):
                for request in released:
                    remaining -= self._send(now, (request, frozenset(), 0))
            if kind == "vectors" and now > span and self._idle():
                raise RuntimeError(f"{remaining} requests unaccounted for with every node idle (a replay bug)")
        for node in self.nodes.values():
            node.account(now, 0)
        failed = [
            f"{n.spec.name}/{source}"
            for n in self.nodes.values()
            for source, c in n.sampler.failures_total.items()
            if c
        ]
        if failed:  # an agent keeps going without a failing source; a replay must not
            raise RuntimeError(f"agent sources failed: {', '.join(failed)} (a replay bug)")
        self.policy.close()
        return self._result(now, time.perf_counter() - started)

    def _idle(self) -> bool:
        """No request queued or running anywhere, held by the policy, or about to arrive or be retried."""
        return (
            all(not n.model.running and not n.model.waiting for n in self.nodes.values())
            and not self.policy.holding
            and not any(kind in _IN_TRANSIT for _, _, kind, _ in self._heap)
        )

    # --- events -------------------------------------------------------------------------------------------

    def _arrive(self, now: float, payload: object) -> int:
        request, _, attempts = cast(tuple[SimRequest, frozenset[str], int], payload)
        if not attempts and not self.policy.admit(request, now):
            return 0
        return self._send(now, payload)

    def _send(self, now: float, payload: object) -> int:
        """An attempt of a request the policy let go: its choice, the connect, the engine's queue."""
        request, exclude, attempts = cast(tuple[SimRequest, frozenset[str], int], payload)
        name = self.policy.choose(request, now, exclude)
        node = self.nodes[name]
        self.policy.dispatched(name, request, now)
        if not node.alive:
            self.failed_attempts += 1
            self.refused.append(now)
            self.policy.finished(name, request, now, Outcome.CONNECT_ERROR)
            return self._retry(now + CONNECT_REFUSED_S, request, exclude | {name}, attempts + 1)
        self.dispatched += 1
        if node.info.numa_node != self.gateway_numa(request):
            self.cross_numa += 1
        job = engine_job(request, node.model, now)
        attempt = _Attempt(request, name, parse_signature(request.signature)[0].value)
        job.tag = attempt
        node.opened += 1
        node.account(now, +1)
        node.jobs.add(job)
        if node.loss:
            lost = sum(self._rng.random() < node.loss for _ in range(segments(request)))
            if lost:
                attempt.retransmits = lost
                self._push(now + lost * RTO_S, "deliver", (name, job))
                return 0
        return self._apply(node, now, node.model.advance(now) + node.model.submit(job, now))

    def _deliver(self, now: float, payload: object) -> int:
        """A request held up by lost segments reaches its engine (unless the node died meanwhile: its kill
        already sent the request elsewhere)."""
        name, job = cast(tuple[str, Job], payload)
        node = self.nodes[name]
        if not node.alive or job not in node.jobs:
            return 0
        return self._apply(node, now, node.model.advance(now) + node.model.submit(job, now))

    def gateway_numa(self, request: SimRequest) -> int:
        """The NUMA node of the gateway process the request came through (requests spread over them by a hash of
        their id; `_topology` spreads them as Prism's policy spreads them over its routers)."""
        spread = (request.id * 0x9E37_79B1 & 0xFFFF_FFFF) >> 16
        return self.gateways_numa[spread % len(self.gateways_numa)]

    def _retry(self, now: float, request: SimRequest, exclude: frozenset[str], attempts: int) -> int:
        if attempts >= MAX_ATTEMPTS or len(exclude) >= len(self.nodes):
            self.lost += 1
            return 1
        self._push(now, "arrive", (request, exclude, attempts))
        return 0

    def _wake(self, now: float, payload: object) -> int:
        node = self.nodes[cast(str, payload)]
        if not node.alive or now < node.wake_at:
            return 0
        node.wake_at = math.inf
        return self._apply(node, now, node.model.advance(now))

    def _apply(self, node: _Node, now: float, events: list[Event]) -> int:
        """Tell the policy about the node's first tokens and ends; schedule its next wake-up."""
        done = 0
        for kind, job, t in events:
            attempt = job.tag
            if kind == "first_token":
                node.first_token(job, t)
            elif kind == "finished":
                assert isinstance(attempt, _Attempt | _Foreign)
                node.finished(job, attempt.slice_name, t)
            if isinstance(attempt, _Foreign):
                continue
            assert isinstance(attempt, _Attempt)
            if kind == "first_token":
                if node.loss and self._rng.random() < node.loss:
                    node.retransmits += 1
                    attempt.held_until = t + RTO_S
                    self._push(attempt.held_until, "seen", (attempt, kind))
                else:
                    self._first_token(attempt, t)
            elif kind == "finished":
                node.jobs.discard(job)
                node.account(t, -1)
                if attempt.held_until > t:
                    self._push(attempt.held_until, "seen", (attempt, kind))
                else:
                    done += self._finished(attempt, t)
        if self.view.kv_subscribed and (node.model.stored or node.model.removed):
            self._publish(node, now)
        node.model.stored.clear()
        node.model.removed.clear()
        due = node.model.next_event_s()
        if due < node.wake_at:
            node.wake_at = due
            self._push(due, "wake", node.spec.name)
        return done

    def _publish(self, node: _Node, now: float) -> None:
        """Queue the node's cache changes since its last batch as one KV event batch. The model lists evictions
        and admissions apart, so a block evicted and cached again (or cached and evicted) within the batch is
        reported by where it ended up: removals first, then what is still cached."""
        m = node.model
        removed = tuple(dict.fromkeys(b for b in m.removed if not m.cached(b)))
        stored = tuple(dict.fromkeys(b for _, blocks in m.stored for b in blocks if m.cached(b)))
        if removed or stored:
            self.view.kv_pending.append(KvEvent(node.spec.name, now, removed, stored))

    def _tick(self, now: float, _: object) -> int:
        self.view.now = now
        self.policy.tick(self.view, now)
        self._push(now + self.policy.tick_s, "tick")
        return 0

    def agent_vectors(self, now: float) -> list[NodeVector]:
        """What the agents send at `now`: one vector per live node, from its own agent. The seam for a cluster
        whose agents each see several engines (`_topology`: one agent per host of GPUs)."""
        return [node.vector(now, self.vector_period_s) for node in self.nodes.values() if node.alive]

    def _vectors(self, now: float, _: object) -> int:
        done = 0
        for node in self.nodes.values():
            if node.alive:
                done += self._apply(node, now, node.model.advance(now))
        if self.view.reporting:
            self.view.pending.extend(self.agent_vectors(now))
        self._push(now + self.vector_period_s, "vectors")
        return done

    def _degrade(self, now: float, payload: object) -> int:
        fault = cast(Degrade, payload)
        node = self.nodes[fault.node]
        done = self._apply(node, now, node.model.advance(now))  # work so far at full speed
        p = node.model.profile
        node.model.profile = replace(
            p,
            prefill_tokens_per_s=p.prefill_tokens_per_s / fault.slowdown,
            decode_tokens_per_s=p.decode_tokens_per_s / fault.slowdown,
            encoder_s={m: s * fault.slowdown for m, s in p.encoder_s.items()},
        )
        node.loss = fault.loss
        if fault.foreign:
            sizes = self.workload.requests
            mean_tokens = sum(r.input_tokens for r in sizes) / len(sizes)
            node.foreign_per_s = fault.foreign * p.prefill_tokens_per_s / mean_tokens
            self._push(now + self._foreign_rng.expovariate(node.foreign_per_s), "foreign", fault.node)
        return done

    def _foreign(self, now: float, name: object) -> int:
        """A request from outside the policy reaches the node: a workload request's size and modality, a prompt
        no other request shares. They come until the workload's last arrival."""
        node = self.nodes[cast(str, name)]
        if not node.alive or now > self.workload.requests[-1].arrival_s:
            return 0
        rng = self._foreign_rng
        like = rng.choice(self.workload.requests)
        blocks = tuple(rng.getrandbits(63) for _ in like.blocks)
        profile = node.model.profile
        job = Job(blocks, like.input_tokens, max(1, like.output_tokens), profile.media_s(like.media), now)
        job.media_tokens = like.media_tokens
        job.tag = _Foreign(parse_signature(like.signature)[0].value)
        if not node.model.fits(job):
            job.output_tokens = 1
        node.opened += 1
        self._push(now + rng.expovariate(node.foreign_per_s), "foreign", node.spec.name)
        return self._apply(node, now, node.model.advance(now) + node.model.submit(job, now))

    def _first_token(self, attempt: _Attempt, t: float) -> None:
        """The caller has the attempt's first token."""
        attempt.first_token_s = t
        ttft = t - attempt.request.arrival_s
        slo = TAU0_MS[Slice(attempt.slice_name)] / 1000 if self.slo_s is None else self.slo_s(attempt.request)
        self.ttft.append((attempt.slice_name, t, ttft, ttft <= slo))
        self.policy.first_token(attempt.node, attempt.request, t)

    def _finished(self, attempt: _Attempt, t: float) -> int:
        """The caller has the attempt's whole response: 1, a request done."""
        assert attempt.first_token_s is not None
        self.completed_ttft[attempt.request.id] = attempt.first_token_s - attempt.request.arrival_s
        self.policy.retransmitted(attempt.node, attempt.request, attempt.retransmits, t)
        self.policy.finished(attempt.node, attempt.request, t, Outcome.OK)
        return 1

    def _seen(self, now: float, payload: object) -> int:
        """A response held on the wire behind its lost first segment reaches its caller: the first token, or, for
        a reply that ended meanwhile, the end after it."""
        attempt, kind = cast(tuple[_Attempt, str], payload)
        if attempt.broken:
            return 0
        if kind == "first_token":
            self._first_token(attempt, now)
            return 0
        return self._finished(attempt, now)

    def _kill(self, now: float, name: object) -> int:
        node = self.nodes[cast(str, name)]
        lost = self._apply(node, now, node.model.advance(now))
        node.alive = False
        self.killed_at = now
        for attempt in sorted((cast(_Attempt, job.tag) for job in node.jobs), key=lambda a: a.request.id):
            attempt.broken = True
            node.account(now, -1)
            self.failed_attempts += 1
            self.policy.finished(node.spec.name, attempt.request, now, Outcome.CONNECT_ERROR)
            if attempt.first_token_s is None:
                lost += self._retry(now, attempt.request, frozenset({node.spec.name}), 1)
            else:
                lost += 1  # the stream broke after its first token: the caller sees an error (no TTFT to redo)
                self.lost += 1
        node.jobs.clear()
        return lost

    # --- result -------------------------------------------------------------------------------------------

    def _result(self, end: float, wall_s: float) -> RunResult:
        slices: dict[str, SliceStats] = {}
        groups: dict[str, list[tuple[float, bool]]] = {"all": []}
        for slice_name, _, t, met in self.ttft:
            groups["all"].append((t, met))
            groups.setdefault(slice_name, []).append((t, met))
        for name, values in groups.items():
            ms = [t * 1000 for t, _ in values]
            within = sum(met for _, met in values)
            slices[name] = SliceStats(
                len(ms), quantile(ms, 0.5), quantile(ms, 0.99), within / len(ms) if ms else math.nan
            )
        queries = sum(n.model.prefix_queries_tokens for n in self.nodes.values())
        hits = sum(n.model.prefix_hits_tokens for n in self.nodes.values())
        areas = [n.busy_area for n in self.nodes.values()]
        mean_area = sum(areas) / len(areas)
        timeline: list[tuple[float, float]] = []
        windows: dict[int, list[float]] = {}
        for _, t, ttft, _ in self.ttft:
            windows.setdefault(int(t // TIMELINE_WINDOW_S), []).append(ttft * 1000)
        for k in sorted(windows):
            timeline.append(((k + 0.5) * TIMELINE_WINDOW_S, quantile(windows[k], 0.99)))
        recovery = None if self.killed_at is None else recovery_s(self.killed_at, self.refused)
        return RunResult(
            trace=self.workload.name,
            policy=self.policy.name,
            utilisation=self.utilisation,
            seed=self.seed,
            requests=len(self.workload.requests),
            completed=len(self.workload.requests) - self.lost,
            failed_attempts=self.failed_attempts,
            slices=slices,
            kv_hit_rate=hits / queries if queries else 0.0,
            kv_hit_bound=math.nan,
            load_max_over_mean=max(areas) / mean_area if mean_area else math.nan,
            cross_numa_share=self.cross_numa / self.dispatched if self.dispatched else math.nan,
            killed_node=self.kill.node if self.kill is not None else None,
            killed_at_s=self.killed_at,
            recovery_s=recovery,
            timeline=timeline,
            wall_s=wall_s,
            ttft_s=self.completed_ttft,
        )
