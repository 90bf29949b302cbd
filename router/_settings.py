"""The router's settings: bounded load, passive health (nginx), circuit breaker, sessions, topology."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prismlb.semantics import SLO_SCALE

LOAD_MODES = ("requests", "prefill")


@dataclass(frozen=True, slots=True)
class Settings:
    """Every knob of a Router. Passive health has nginx's defaults and the breaker the design's; the
    placement knobs (load, prefix memory, balance) were chosen across every workload of the cluster replay at
    once (`bench/knobs.py`, docs/eval.md)."""

    load: str = "prefill"
    """What bounded load balances. "requests": a request counts 1 while it is in flight, plus the brain's
    load estimates (requests running and waiting). "prefill": a request counts its `Request.cost` (its prompt
    tokens) from when it is sent until its first token: the prefill work this caller has queued on each
    endpoint, which is what a new request's time to first token waits behind (the brain's estimates, which
    count requests, are left out)."""
    prefix_memory: int = 100_000
    """Affinity keys remembered with the entry this router last sent each to and its cost (0: off; used with
    `load="prefill"` only). A remembered key goes back to that entry while the entry's queued prefill work, less the
    tokens the request should find cached there (the smaller of its cost and the last one), is under the
    bound: a conversation follows its cache, also after the bound once moved it off its ring owner. A request with
    block hashes consults it only when no node is known to hold its prefix and the remembered node's engine sends no
    KV events: where they come, the index knows the prefix was evicted there (docs/router.md)."""
    prefix_index: bool = True
    """Place requests that carry block hashes (`Request.blocks`) by expected time to first token: each candidate's
    queued prefill work plus the request's tokens its cache lacks (from the cluster's prefix index), over its
    prefill speed, stretched by its weight (docs/router.md). Off: they take the ring like keyed requests."""
    cache_affinity: float = 3.0
    """The node holding the longest prefix of a request keeps it while its expected time to first token is within
    this factor of the least expected one, for a node holding the whole prompt, and `1 + (factor − 1) × share` for
    one holding that share of the prompt's blocks: sending a prompt where its prefix is not cached costs more than
    that request's own wait, since it copies the prefix into a second cache and evicts what other prompts would
    have reused there, and the more of the prompt the more so (1: always the least expected time)."""
    placed_ttl_s: float = 30.0
    """How long this router's own placement counts a prompt's blocks as cached on the node it went to, until the
    engine's KV events say so (`PrefixIndex`)."""
    ttft_candidates: int = 16
    """Entries the expected-TTFT choice weighs: every entry of a group this small; in larger groups the nodes
    holding the prompt's prefix and the first ones along the key's probe order, up to this many."""
    overflow: float = 2.0
    """A request with block hashes goes to one of its slice's overflow entries (capable nodes outside the slice's
    pool, which the brain keeps for other slices) when its expected time to first token there, times this, is
    still under the pool's best: a pool's preferred hardware waits its turn until queueing on it costs more than
    twice the detour, so the detour's queue, which the other slice's requests would have to wait behind, is taken
    only to halve a wait (0: never; docs/router.md)."""
    overflow_yields: bool = True
    """An overflow entry is passed over while a slice whose pool holds it has requests waiting in this router's room
    (`hold_tokens`): that slice is short of capacity already and has nowhere to go but its pool, so a detour there
    would take from it what the detour's own slice can wait for at home. When no such slice waits the detour is
    taken by `overflow` alone, so a quiet cluster keeps the tail it gains from overflowing (docs/router.md)."""
    share_load: bool = True
    """With `load="prefill"`, report this router's queued prefill work per node to the brain it follows and count
    its peers' (the brain's `ClusterLoad` sums less this router's own report) in the expected time to first token:
    routers embedded in many callers then see each node's whole queue, not their own share of it (docs/router.md).
    Reports go every `load_report_s` while they change; peers' figures older than `peer_load_ttl_s` are ignored."""
    share_turns: bool = True
    """With `share_load` and a waiting room (`hold_tokens`), also report the head of each of this router's rooms (the
    request it lets go next) and let a head go only while no peer's, from the brain's last sums, is due sooner (late
    ones after every one in time, as in one room): routers embedded in many callers then keep one order over all of
    their waiting requests, where each would order only its own share and all of them would fill the same free
    engine at once (docs/router.md). A peer's head counts for `peer_load_ttl_s`, as its queued work does."""
    load_report_s: float = 0.02
    """How often a router connected to a brain sends its queued prefill work while it changes."""
    peer_load_ttl_s: float = 2.0
    """How long the peers' queued prefill work from the brain is used after it arrived: past it (a brain gone,
    a lost stream) the router counts its own queue alone, as it would without peers."""
    hold_tokens: int = 1024
    """With `load="prefill"`, requests whose callers report first tokens (the httpx transports' streamed requests,
    `Router.call(..., first_tokens=True)`) wait at the router while every entry of their slice (and of its overflow
    that a detour may take: `overflow`, `overflow_yields`) has more than this many prompt tokens queued (sent, no
    first token yet, this router's and its peers'; once speeds are measured, counted in time: an entry twice
    `assumed_prefill_tokens_per_s` has room up to twice as many), and go in order of deadline: arrival plus TTFT SLO
    (`Request.slo_s`, else `semantics.ttft_slo_s`; docs/router.md). An engine serves its queue in arrival order; kept
    short, the order is the router's, and a short prompt due soon no longer waits behind long ones. 1,024 (half an
    engine step's prefill, 0.1 s on an A100: still far longer than a grant's way to the engine) was chosen over 512,
    1,536 and 2,048 across every workload of the replay at once (docs/eval.md, "Half a step in the room"), as 2,048
    was over 1 and 8,192 before: with 8,192 the engines' queues are long enough to keep most of their order (0: never
    hold)."""
    hold_cached_tokens: int = 1024
    """A request whose prompt the prefix index finds cached on a node of its slice but for at most this many tokens
    takes no turn (`hold_tokens`): it goes at once, counted as passed. The room orders prefill work, and such a
    request brings almost none; held, it waits behind requests that need the turn, while its holder's queue and
    cache move on. A short uncached prompt still waits: its order is what the room is for. 1,024 was chosen over 512,
    768, 1,536 and 2,048 across every workload of the replay at once (with `hold_tokens` at 2,048), and over passing
    uncached prompts as short too (docs/eval.md, "Cached prompts take no turn"; 0: every request waits)."""
    assumed_prefill_tokens_per_s: float = 10_000.0
    """The prefill speed a waiting request's deadline assumes while the brain has measured none in its slice (a
    cold start), and the one `hold_tokens` is counted at once speeds are measured: an 8B model on an A100.
    Deadlines need seconds: without a speed every prompt would get τ0 alone, and the first seconds' requests would go
    in arrival order, long prompts before short ones."""
    slo_scale: float = SLO_SCALE
    """The TTFT SLO the waiting room orders requests by (`hold_tokens`), as a multiple of a request's prefill alone on
    a typical entry of its slice, floored at the slice's τ0 (`semantics.ttft_slo_s`); `Request.slo_s` overrides it per
    request. Set it to the service's own SLO: with the replay scored against an SLO of 10 times, routers told 10
    reach 1.036 times the goodput of routers keeping the default 5 over its 20 workloads (bursty 1.11-1.16, Azure
    code 1.30, Azure conv 0.96), and against 3 times, 1.030 with `late_margin` shrunk in proportion (docs/eval.md,
    "Under an SLO the routers do not assume"). The default is the evaluation's, after DistServe."""
    late_margin: float = 2.0
    """A waiting request is late once its deadline is nearer than this many times its prefill alone on the slice's
    fastest entry; late requests go after every request still in time (`hold_tokens`). A request granted its turn
    still waits for the queue it is placed behind and prefills beside its node's decode batch, so one with less time
    left than twice its own prefill seldom meets its deadline, and the turn saves more given to one that can. The
    fastest entry, as the request would go wherever it starts soonest: a slowed GPU in the slice does not make every
    request late. 1: late only once its prefill alone could no longer end in time; 0: only past its deadline. 2 was
    chosen over 1, 1.5 and 3 across every workload of the replay at once (docs/eval.md), at the default SLO of five
    times the prefill alone. Under a tighter SLO (`slo_scale`, or a request's own `slo_s`, below five times its
    prefill alone) the margin shrinks with it, so that it stays the same share of the request's budget: scored and
    ordered by three times, 1.2 reached 1.019 times the goodput of 2 over the 20 workloads (1.5: 1.016, 0.8: 0.991;
    docs/eval.md, "Under an SLO the routers do not assume"). Under a looser one it stays: 4 at ten times, 0.992."""
    client_stall: bool = True
    """Add to each endpoint's expected time to first token the network stall that this router's own connections to it
    forecast: the segments they retransmitted per request over the last `semantics.STALL_SMOOTHING_S` (15 s), each a
    minimum retransmission timeout (200 ms), counted by the httpx transports from the kernel's `TCP_INFO`
    (`Lease.retransmitted`). A request lost on its way to a node is sent again by the caller's kernel, never by the
    node's, so the node's agent, whose retransmits make the brain's stall (`TableNode.stall_ms`), cannot see it;
    the two add up (docs/router.md)."""
    hold_max_s: float = 10.0
    """The longest a request waits for its turn; then it goes whatever the queues (counted as expired)."""
    balance: float = 1.05
    """Bounded-load factor c: an entry takes a request only while its load stays under c × its weighted share
    of the slice's load (Mirrokni et al.); 0 turns the bound off."""
    max_fails: int = 1
    """nginx `max_fails`: failed attempts within `fail_timeout_s` that make an endpoint unavailable (0: never)."""
    fail_timeout_s: float = 10.0
    """nginx `fail_timeout`: the window failures are counted in, and how long the endpoint is then unavailable."""
    slow_s: float = 60.0
    """A first token (or streamed response head) this late counts as a timeout for the circuit breaker. The
    design's 300 ms suits short interactive prompts; a healthy GPU takes seconds to prefill a long
    prompt under load: in the replay 300 ms and 1 s cost tail latency on a third of the workloads, and on the
    whole Azure traces (prompts of tens of thousands of tokens) 10 s and 30 s do too (`bench/knobs.py`)."""
    open_after: int = 3
    """Timeouts in a row that open an endpoint's circuit."""
    open_s: float = 5.0
    """Seconds an open circuit gets no requests before it turns half-open and admits trial requests."""
    max_open_share: float = 0.1
    """Share of the router's endpoints that may have open circuits at once (at least one may), Envoy's
    `max_ejection_percent`: when most endpoints are slow the cluster is overloaded, and opening their circuits
    would only take capacity away."""
    half_open_trials: int = 1
    """Trial requests a half-open circuit admits at a time; a successful one closes it, a failed one reopens it."""
    connect_tries: int = 2
    """Attempts `Router.call` and the httpx transports make for one request, each on an endpoint not tried yet:
    only after a refused connection, or (the transports) an HTTP 503 or 429, which no endpoint acted on."""
    session_ttl_s: float = 1800.0
    """How long a session stays on its endpoint after its last request."""
    max_sessions: int = 100_000
    """Sessions remembered at most; past that the least recently used are forgotten."""
    zone: str = ""
    """The caller's zone: with the brain's zone split in the table (`RoutingTable.zones`), each key goes to the
    serving zone its row assigns it (stable per key), placed among that zone's entries; "" or a zone without a row:
    every entry of the slice. Under an A/B experiment the arms decide, not the split."""
    numa_node: int | None = None
    """The caller's NUMA node: GPU entries on it weigh 1.0, across NUMA nodes 0.4 (None: all weigh 1.0)."""
    base_points: int = 128
    """Ring points of an entry of weight 1.0."""
    max_ring_points: int = 1 << 20
    """Ring points of one slice at most: past it every entry's points are scaled down alike (a fleet of
    per-GPU entries would otherwise make rings of tens of millions of points)."""
    max_drop_share: float = 0.5
    """A table that drops more than this share of the current table's nodes at once (drained ones aside) is
    refused until such tables have kept coming for `drop_hold_s` (1.0: never refused)."""
    drop_hold_s: float = 15.0
    """How long tables that drop many nodes must keep coming before the router takes them."""

    def affinity(self, held: int, blocks: int) -> float:
        """How many times the least expected time to first token a node holding `held` of a prompt's `blocks`
        leading blocks may take and keep the request: `cache_affinity` for the whole prompt, less in proportion for a
        part of it, 1 for none. A node holding one block of a six-block prompt saves the request a sixth of its
        prefill and the cluster one block's copy; a wait up to the full factor is worth it only for what the whole
        prompt saves (measured on every workload of the replay: TTFT p99 0.96-0.97x at 50, 80 and 95% load, goodput
        unchanged, docs/eval.md)."""
        share = min(1.0, held / blocks) if blocks > 0 else 0.0
        return 1.0 + (self.cache_affinity - 1.0) * share

    def __post_init__(self) -> None:
        if self.load not in LOAD_MODES:
            raise ValueError(f"load must be one of {', '.join(LOAD_MODES)}, got {self.load!r}")
        if self.prefix_memory < 0:
            raise ValueError(f"prefix_memory must be 0 (off) or positive, got {self.prefix_memory}")
        if not (self.balance == 0 or self.balance >= 1):
            raise ValueError(f"balance must be 0 (off) or at least 1, got {self.balance}")
        for name in (
            "max_fails",
            "open_after",
            "half_open_trials",
            "connect_tries",
            "max_sessions",
            "base_points",
            "ttft_candidates",
        ):
            low = 0 if name == "max_fails" else 1
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")
        if not 0.0 <= self.max_open_share <= 1.0:
            raise ValueError(f"max_open_share must be within [0, 1], got {self.max_open_share}")
        if not 0.0 <= self.max_drop_share <= 1.0:
            raise ValueError(f"max_drop_share must be within [0, 1], got {self.max_drop_share}")
        if not (self.overflow == 0 or self.overflow >= 1):
            raise ValueError(f"overflow must be 0 (off) or at least 1, got {self.overflow}")
        if not self.cache_affinity >= 1.0:
            raise ValueError(f"cache_affinity must be at least 1, got {self.cache_affinity}")
        if self.placed_ttl_s < 0:
            raise ValueError(f"placed_ttl_s must not be negative, got {self.placed_ttl_s}")
        if self.max_ring_points < 1 or self.drop_hold_s < 0:
            raise ValueError("max_ring_points must be at least 1 and drop_hold_s not negative")
        if not (1.0 <= self.slo_scale < math.inf):  # NaN included
            raise ValueError(f"slo_scale must be a number of at least 1, got {self.slo_scale}")
        if not self.late_margin >= 0:  # NaN included
            raise ValueError(f"late_margin must not be negative, got {self.late_margin}")
        if self.hold_tokens < 0:
            raise ValueError(f"hold_tokens must be 0 (off) or positive, got {self.hold_tokens}")
        if self.hold_cached_tokens < 0:
            raise ValueError(f"hold_cached_tokens must be 0 (off) or positive, got {self.hold_cached_tokens}")
        for name in (
            "fail_timeout_s",
            "slow_s",
            "open_s",
            "session_ttl_s",
            "load_report_s",
            "peer_load_ttl_s",
            "hold_max_s",
            "assumed_prefill_tokens_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
