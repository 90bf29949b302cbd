"""Messages shared by agent, brain and router (msgspec structs, msgpack on the wire).

Units are in field names. A metric that was not measured is absent (None, omitted on the wire), never 0.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

SCHEMA_VERSION = 1

# Every number on the wire is bounded at decode, to a range no arithmetic of the brain or router can overflow
# with (squares, sums over a fleet, float conversion): one absurd value from one peer is refused there.
MAX_COUNT = 2**53
"""Counts and byte sizes: exactly representable as a float."""
MAX_REQUESTS = 10**9
"""Requests running, waiting or per second on one node."""
MAX_MS = 1e7
"""Latencies in ms (about 2.8 hours)."""
MAX_UNIX_S = 1e11
"""Unix timestamps (the year 5138)."""

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Requests = Annotated[int, msgspec.Meta(ge=0, le=MAX_REQUESTS)]
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Millis = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_MS)]
Rate = Annotated[float, msgspec.Meta(ge=0.0, le=float(MAX_REQUESTS))]
PerConnection = Annotated[float, msgspec.Meta(ge=0.0, le=float(MAX_COUNT))]
"""Events per connection over a window: a count divided by at least one connection."""
UnixSeconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_UNIX_S)]
NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$")]
Name = Annotated[str, msgspec.Meta(max_length=256)]
Labels = Annotated[dict[Annotated[str, msgspec.Meta(min_length=1, max_length=64)], Name], msgspec.Meta(max_length=64)]
Weight = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
SliceName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
MAX_TABLE_VALUE = 1e12
Bounded = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TABLE_VALUE)]  # finite because bounded (no per-struct check)


class _Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """Every float field is range-bounded, so decoding refuses NaN and infinities without a check of its own.

    Not tracked by the garbage collector (`gc=False`): a message is a tree of frozen structs that can never be
    part of a reference cycle, and a brain holds one vector per node (150 objects each) until the next, which the
    collector would otherwise keep walking (a quarter of decoding time at 20,000 nodes, bench/ingest.py)."""


class NodeMetrics(_Message, kw_only=True):
    """One node's measurements for one sample; absent fields were not measured."""

    # host
    cpu_util_ratio: Ratio | None = None
    mem_used_bytes: Count | None = None
    mem_total_bytes: Count | None = None
    connect_calls_total: Count | None = None
    # the host's TCP connections on the traced ports and processes, from the eBPF program, over the agent's period
    tcp_retransmits_per_conn: PerConnection | None = None
    """Segments retransmitted per connection open during the period (absent without any)."""
    tcp_handshake_p95_ms: Millis | None = None
    """P95 of the handshakes this host completed as a client in the period (absent without any)."""
    tcp_retransmits_per_s: Rate | None = None
    """Segments retransmitted per second: over the node's requests per second, the retransmits a request meets."""
    tcp_resets_per_s: Rate | None = None
    """RSTs sent or received."""
    tcp_refused_per_s: Rate | None = None
    """Connects that never completed: refused, timed out, unreachable or abandoned."""
    # the design's four health dimensions
    gpu_mem_frag_ratio: Ratio | None = None
    kv_cache_miss_ratio: Ratio | None = None
    cpu_preproc_p95_ms: Millis | None = None
    nvlink_util_ratio: Ratio | None = None
    # GPUs, summed (memory) or at their worst (utilisation) over the node's devices
    gpu_count: Count | None = None
    gpu_mem_used_bytes: Count | None = None
    gpu_mem_total_bytes: Count | None = None
    gpu_util_ratio: Ratio | None = None
    pcie_util_ratio: Ratio | None = None
    # inference engine
    kv_cache_usage_ratio: Ratio | None = None
    requests_running: Requests | None = None
    requests_waiting: Requests | None = None
    # load the node served
    requests_per_s: Rate | None = None
    prefill_tokens_per_s: Rate | None = None
    """Prompt tokens the engine computed (cache hits left out) per second it spent prefilling: its prefill
    speed as measured, whatever its GPU, model and parallelism."""


class ModalityLatency(_Message, kw_only=True):
    """Observed latency of one modality slice's requests over the agent's window."""

    requests: Count
    errors: Count = 0
    """Of those requests, the ones that ended in an error (request span status ERROR)."""
    ttft_p50_ms: Millis | None = None
    ttft_p95_ms: Millis | None = None
    ttft_p99_ms: Millis | None = None
    e2e_p50_ms: Millis | None = None
    e2e_p95_ms: Millis | None = None
    e2e_p99_ms: Millis | None = None


class GpuState(_Message, kw_only=True):
    """One GPU of the node: memory, interconnect load and where it sits in the host's topology."""

    index: Count
    uuid: Name
    name: Name = ""
    mem_used_bytes: Count
    mem_total_bytes: Count
    util_ratio: Ratio | None = None
    nvlink_util_ratio: Ratio | None = None
    pcie_util_ratio: Ratio | None = None
    numa_node: Count | None = None
    nvlink_peers: Annotated[list[Count], msgspec.Meta(max_length=64)] = []


class KvSummary(_Message, kw_only=True):
    """The engine's cached KV blocks as a Bloom filter over their block hashes (compact, no false negatives)."""

    blocks: Count
    bloom: Annotated[bytes, msgspec.Meta(max_length=16384)]
    bloom_hashes: Annotated[int, msgspec.Meta(ge=1, le=16)]
    block_size_tokens: Count | None = None


class NodeVector(_Message, kw_only=True):
    """What an agent reports about its node every period: measurements only. Health and alarms are the brain's
    to judge, from these measurements (`prismlb.semantics.health`); a field an older agent still sends (its
    `alarms`, `health_score`) is unknown here and ignored at decode."""

    node_id: NodeId
    host: Name
    endpoint: Name
    zone: Name = ""
    labels: Labels = {}
    seq: Count
    sample_time_unix_s: UnixSeconds
    period_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]
    metrics: NodeMetrics
    started_unix_s: UnixSeconds | None = None
    latency: Annotated[dict[SliceName, ModalityLatency], msgspec.Meta(max_length=16)] = {}
    gpus: Annotated[list[GpuState], msgspec.Meta(max_length=64)] = []
    kv: KvSummary | None = None


class TableNode(_Message, kw_only=True):
    """One routing target in a slice: a node, or one GPU of it in topology-aware slices. Its id was checked
    against NodeId's pattern when the node's vectors were; only its length is checked again here, which
    keeps decoding a table (every router, every version) three times cheaper."""

    node_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    endpoint: Name
    weight: Weight
    zone: Name = ""
    model_version: Name = ""
    load: Bounded | None = None  # the brain's estimate of requests on the node (running + waiting)
    predicted_p99_ms: Bounded | None = None
    prefill_tokens_per_s: Bounded | None = None
    """The brain's estimate of the node's prefill speed (per GPU entry in topology-aware slices), which a
    router divides queued prompt tokens by to expect a time to first token."""
    stall_ms: Bounded | None = None
    """The network stall a request to the node can expect, from its kernel's retransmits (absent: none seen),
    which a router adds to the node's expected time to first token."""
    admit_ms: Bounded | None = None
    """The wait for room in the node's KV cache a new request can expect (absent: none), from its engine's cache
    usage, running and waiting requests and pace; a router takes it instead of the node's queued prefill when it
    is longer: a full cache admits nothing until a request ends, however short the prefill queue."""
    gpu: Count | None = None
    numa_node: Count | None = None
    gpu_class: Name = ""
    """The node's GPU class (its agent's `gpu` label; empty when unlabelled): a router stands in for a speed the table
    lacks with its callers' first tokens pooled over the nodes of one class, as the brain stands in with the class's
    measured nodes."""
    overflow: bool = False
    """A node outside the slice's pool whose model serves the slice: routers send the slice's requests here only
    while the pool's nodes are expected to be much slower to a first token (`Settings.overflow`)."""


class SliceTable(_Message, kw_only=True):
    name: SliceName
    nodes: Annotated[list[TableNode], msgspec.Meta(max_length=1_000_000)]
    fallback: SliceName | None = None  # where this slice's requests go while it has no nodes


class ExperimentArm(_Message, kw_only=True):
    model_version: Name
    fraction: Annotated[float, msgspec.Meta(ge=0.001, le=1.0)]


class Experiment(_Message, kw_only=True):
    """A gray release: a slice's traffic split between model versions, stable per session."""

    name: SliceName
    slice: SliceName
    arms: Annotated[list[ExperimentArm], msgspec.Meta(min_length=1, max_length=16)]


Priority = Annotated[int, msgspec.Meta(ge=-1000, le=1000)]


class ZoneShare(_Message, kw_only=True):
    zone: Name
    fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class ZoneRoute(_Message, kw_only=True):
    """One caller zone's row of the brain's zone split: which serving zones take what share of the traffic of the
    routers in `caller` (`Settings.zone`). Routers spread keys over the shares stably (`assign_zone`), so a
    conversation stays in one zone while the split holds."""

    caller: Name
    shares: Annotated[list[ZoneShare], msgspec.Meta(min_length=1, max_length=64)]


ZoneRoutes = Annotated[list[ZoneRoute], msgspec.Meta(max_length=64)]


class RoutingTable(_Message, kw_only=True):
    """A complete, versioned routing table.

    `brain_id` names the brain that issued it; (epoch, version) orders one brain's tables, also across its
    restarts. Routers follow one live brain at a time: the one with the highest (priority, brain_id)."""

    epoch: Count
    version: Count
    issued_unix_s: UnixSeconds
    brain_id: Name = ""
    priority: Priority = 0
    drained: Annotated[list[Name], msgspec.Meta(max_length=100_000)] = []
    """Nodes the operator drained: leaving the table on purpose, so a router's guard against a table that
    drops many nodes at once does not count them."""
    slices: Annotated[list[SliceTable], msgspec.Meta(max_length=64)]
    experiments: Annotated[list[Experiment], msgspec.Meta(max_length=64)] = []
    shed_classes: Annotated[list[Name], msgspec.Meta(max_length=16)] = []  # refused while the guardian degrades
    guardian: Name = "normal"
    zones: ZoneRoutes = []
    """The zone split (`brain/_failover.py`); empty: routers ignore zones."""

    @property
    def order(self) -> tuple[int, int]:
        return (self.epoch, self.version)


class Heartbeat(_Message, kw_only=True):
    """Sent by the brain between tables so routers can tell a quiet brain from a missed table, and a live
    brain from a dead one."""

    epoch: Count
    version: Count
    issued_unix_s: UnixSeconds
    brain_id: Name = ""
    priority: Priority = 0

    @property
    def order(self) -> tuple[int, int]:
        return (self.epoch, self.version)


class SnapshotRequest(_Message, kw_only=True):
    """A late-joining (or lagging) router asks for the current table: its head and the full state of the
    slices it names (every slice when `slices` is None)."""

    slices: Annotated[list[SliceName], msgspec.Meta(max_length=64)] | None = None
    kv: bool = False
    """Ask for the brain's KV index instead (`KvDelta` resets then `KvSnapshotEnd`), not the table."""


class EntryRef(_Message, kw_only=True):
    """A table entry named by its node and, for a per-GPU entry, its GPU."""

    node_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    gpu: Count | None = None


class SliceHead(_Message, kw_only=True):
    """One slice in a table head: the table version at which its entries last changed, and how many it has."""

    name: SliceName
    version: Count
    entries: Count
    fallback: SliceName | None = None


class TableHead(_Message, kw_only=True):
    """A routing table without its entries, published after the slice updates that bring a router's copy of
    every slice to the versions it names; with them, it is the `RoutingTable` of the same (epoch, version)."""

    brain_id: Name = ""
    priority: Priority = 0
    epoch: Count
    version: Count
    issued_unix_s: UnixSeconds
    slices: Annotated[list[SliceHead], msgspec.Meta(max_length=64)]
    experiments: Annotated[list[Experiment], msgspec.Meta(max_length=64)] = []
    shed_classes: Annotated[list[Name], msgspec.Meta(max_length=16)] = []
    guardian: Name = "normal"
    drained: Annotated[list[Name], msgspec.Meta(max_length=100_000)] = []
    zones: ZoneRoutes = []

    @property
    def order(self) -> tuple[int, int]:
        return (self.epoch, self.version)


MAX_UPDATE_ENTRIES = 20_000
"""Entries in one slice update message: a slice larger than this (a fleet of per-GPU entries) goes in parts."""


class SliceUpdate(_Message, kw_only=True):
    """Part `part` of `parts` of one slice's change at table `version`: the entries added or changed and the
    ones removed since `base_version` (0: the slice's full state, replacing whatever the router held)."""

    brain_id: Name = ""
    epoch: Count
    version: Count
    slice: SliceName
    base_version: Count
    part: Annotated[int, msgspec.Meta(ge=0, lt=1024)] = 0
    parts: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    upserts: Annotated[list[TableNode], msgspec.Meta(max_length=MAX_UPDATE_ENTRIES)] = []
    removes: Annotated[list[EntryRef], msgspec.Meta(max_length=MAX_UPDATE_ENTRIES)] = []


BlockHash = Annotated[int, msgspec.Meta(ge=0)]
"""A Prism chain hash of one prompt block (`prismlb.router.block_hash`): an unsigned 64-bit int. msgpack has no
larger ints (and msgspec no bound past int64's), so `ge=0` is the whole check: decoding refuses the rest."""
MAX_KV_BLOCKS = 7_000
"""Hashes (stored and removed together) in one `KvBlocks`: 9 bytes each at most in msgpack, so a message stays
under the 64 KiB vector limit with room for its other fields; larger changes go in several messages."""
MAX_KV_DELTA_BLOCKS = 1_000_000
"""Hashes in one list of a `KvDelta`: a snapshot's per-node resets go in parts of this many (9 MB), under the
16 MiB table frame limit; live deltas carry what one `KvBlocks` did."""


class KvBlocks(_Message, kw_only=True):
    """Agent → brain: what changed in the node's prefix cache (Prism block hashes) since its last `KvBlocks`.

    `seq` counts this agent process's `KvBlocks` (+1 each, from 0 at start), so the brain sees a lost message
    (a skip) or a restarted agent (it goes back) and treats the node's set as unknown until the next reset. With
    `reset`, `stored` is the node's whole set, or its first part when the set is larger than one message: the
    parts that follow are plain `stored` messages with the next sequence numbers, so a receiver that misses one
    sees the gap instead of taking half a set as the whole. Agents send a reset at start and periodically."""

    node_id: NodeId
    seq: Count
    reset: bool = False
    block_size_tokens: Count | None = None
    stored: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_KV_BLOCKS)] = []
    removed: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_KV_BLOCKS)] = []


class KvDelta(_Message, kw_only=True):
    """Brain → routers (PUB, topic `prism.kvdelta`): one node's prefix-cache change, in the brain's order.

    `seq` counts the brain's deltas within its epoch (+1 each, from 1), so a router sees a lost delta and asks for
    a KV snapshot. `reset`: the node's set is `stored` (empty: the node is gone or its set unknown); otherwise
    remove `removed`, then add `stored`. A snapshot's deltas all carry the seq of the `KvSnapshotEnd` after them."""

    brain_id: Name = ""
    epoch: Count
    seq: Count
    node_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    reset: bool = False
    block_size_tokens: Count | None = None
    stored: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_KV_DELTA_BLOCKS)] = []
    removed: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_KV_DELTA_BLOCKS)] = []


class KvSnapshotEnd(_Message, kw_only=True):
    """Ends a KV snapshot (the brain's snapshot socket, after one reset `KvDelta` per node and its parts): the
    snapshot is the brain's index as of delta `seq`, so the router goes on with delta `seq + 1`; `nodes` names
    every node in it (a node the router held that is not listed is gone)."""

    brain_id: Name = ""
    epoch: Count
    seq: Count
    nodes: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=128)]], msgspec.Meta(max_length=100_000)]


MAX_ROUTER_LOAD_NODES = 400
"""Nodes in one `RouterLoad`'s `loads`: 139 bytes each at most (a 128-character id and a float); a router loading
more nodes reports its heaviest."""
MAX_PLACED_BLOCKS = 12_000
"""Block hashes in one `Placed` (and, the router sees to it, in one `RouterLoad`): 9 bytes each at most, so a
report stays under `MAX_REPORT_BYTES` with its loads."""
MAX_REPORT_BYTES = 256 * 1024
"""Largest frame the brain's snapshot socket takes, where routers' reports arrive beside snapshot requests."""
MAX_CLUSTER_LOAD_NODES = 100_000
MAX_ROOM_HEADS = 64
"""Slices whose waiting-room head one `RouterLoad` names (a router with more waiting reports the most urgent)."""
MAX_CLUSTER_HEADS = 1024
"""Room heads in one `ClusterLoad`: two per slice, the most urgent slices first."""
RouterId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
MAX_SECONDS = MAX_MS / 1000
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]


class RoomHead(_Message, kw_only=True):
    """The request a router's waiting room for one slice lets go next (`router._turns`), in seconds relative to
    the message, since routers' clocks differ: `due_s` until its deadline while it is in time; once late (it then
    goes after every request in time, in the order they became late), `late_s` since it became so. In a
    `ClusterLoad`, `router_id` names the router whose head it is and the times are counted to the sums' sending."""

    slice: SliceName
    due_s: Seconds = 0.0
    late_s: Seconds | None = None
    router_id: Annotated[str, msgspec.Meta(max_length=64)] = ""

    def urgency(self, now: float) -> tuple[int, float]:
        """Its place in the rooms' order on a clock reading `now` (smaller goes first): (0, deadline) in time,
        (1, when it became late) once late, as `Room.head` orders its own."""
        return (0, now + self.due_s) if self.late_s is None else (1, now - self.late_s)

    @classmethod
    def at(cls, slice_: str, urgency: tuple[int, float], now: float, router_id: str = "") -> RoomHead:
        """The head whose `urgency(now)` is `urgency` (its times within the wire's bounds): what a router reports of
        its own, and the relay of a report aged since it came."""
        late, when = urgency
        if late:
            return cls(slice=slice_, late_s=min(MAX_SECONDS, max(0.0, now - when)), router_id=router_id)
        return cls(slice=slice_, due_s=min(MAX_SECONDS, max(0.0, when - now)), router_id=router_id)


class Placed(_Message, kw_only=True):
    """A prompt's blocks a router sent to a node, which that node will cache once it has computed them; in a
    `ClusterLoad`, `router_id` names the router that placed it (so that it skips its own)."""

    node_id: NodeId
    blocks: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_PLACED_BLOCKS)]
    router_id: Annotated[str, msgspec.Meta(max_length=64)] = ""


class RouterLoad(_Message, kw_only=True):
    """Router → brain (on the snapshot socket's DEALER): the prefill work this router has queued on each node,
    and the prompts it placed since its last report.

    `loads` maps a node to the prompt tokens (cache hits left out) of the requests this router sent there that
    have no first token yet; a node absent from it has none. It is the router's whole figure each time, not a
    change, so a lost report is made good by the next; `seq` (+1 each) lets the brain drop one that arrives after
    a newer one. `placed` are the router's new placements (the blocks the chosen node does not hold yet): its
    peers count them as cached there, as the router itself does, until the engine's KV events confirm them."""

    router_id: RouterId
    zone: Name = ""
    """The router's zone (`Settings.zone`): the brain counts each zone's callers' demand from it."""
    seq: Count
    loads: Annotated[dict[NodeId, Bounded], msgspec.Meta(max_length=MAX_ROUTER_LOAD_NODES)] = {}
    placed: Annotated[list[Placed], msgspec.Meta(max_length=MAX_PLACED_BLOCKS)] = []
    heads: Annotated[list[RoomHead], msgspec.Meta(max_length=MAX_ROOM_HEADS)] = []
    """The head of each of the router's waiting rooms with requests waiting, as of this report."""


class ClusterLoad(_Message, kw_only=True):
    """Brain → routers (PUB, topic `prism.load`): every router's queued prefill work per node, summed, and their
    new placements.

    A router subtracts its own last report to see what its peers have queued. `routers` counts the routers
    whose reports are in the sums (those heard within the brain's expiry)."""

    brain_id: Name = ""
    seq: Count
    routers: Count
    loads: Annotated[dict[NodeId, Bounded], msgspec.Meta(max_length=MAX_CLUSTER_LOAD_NODES)] = {}
    placed: Annotated[list[Placed], msgspec.Meta(max_length=MAX_CLUSTER_LOAD_NODES)] = []
    """Every router's placements reported since the last `ClusterLoad`."""
    heads: Annotated[list[RoomHead], msgspec.Meta(max_length=MAX_CLUSTER_HEADS)] = []
    """Per slice, the two most urgent of the routers' waiting-room heads (two, so that the router holding the first
    still sees the next)."""


Message = (
    NodeVector
    | RoutingTable
    | Heartbeat
    | SnapshotRequest
    | TableHead
    | SliceUpdate
    | KvBlocks
    | KvDelta
    | KvSnapshotEnd
    | RouterLoad
    | ClusterLoad
)
