"""SGLang router's `cache_aware` policy: an approximate radix tree per worker, load balancing when imbalanced.

Source: sgl-project/sglang `sgl-router/` (the Rust router published as sglang-router; main, 2025):
`src/policies/cache_aware.rs`, `src/policies/tree.rs`, `src/routers/http/router.rs` (`select_worker_for_model`,
`record_outcome`), `src/core/worker.rs` (health checks), `src/core/circuit_breaker.rs`, with the launcher's
defaults from `py_src/sglang_router/router_args.py`: cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5, eviction_interval_secs 120, max_tree_size 2**26, health_check_interval_secs 60,
health_failure_threshold 3, health_success_threshold 2, cb_failure_threshold 10, cb_success_threshold 3,
cb_timeout_duration_secs 60 (the Rust structs' own defaults differ: 0.5, 32, 1.1, 10000, ...; the launcher's apply).

Per attempt the router keeps the available workers (healthy and circuit not open) and, with their loads (requests
the router has in flight on each), is imbalanced when `max - min > 64` and `max > 1.5 * min`: then the least
loaded worker wins. Otherwise the tree's longest prefix match gives a tenant; if matched / total > 0.3 that
tenant wins, else the tenant with the smallest tree. The request is inserted under the winner. A chosen tenant
that is no longer available is removed from the tree and the first available worker is used. Every 120 s each
tenant's least recently used leaves are evicted until its tree is at most `max_tree_size`.

Dead workers: the health checker probes every 60 s; 3 failures in a row mark a worker unhealthy, 2 successes
healthy again. Each attempt's outcome feeds the worker's circuit breaker: 10 failures in a row open it for 60 s,
then it is half-open (1 failure reopens it, 3 successes close it).

Simplifications and mappings:
- The tree's "text" is the request's block ids, one symbol per block (chained ids make it a trie), so the match
  rate is matched blocks / total blocks and a tree's size is counted in blocks; eviction removes single blocks
  rather than whole radix edges. SGLang's 2**26 characters at 4 characters per token (the EPP's estimate) map to
  2**26 / (4 * block_tokens) blocks: 32768 blocks per worker at the replay's 512-token blocks.
- Where `DashMap` iteration order decides (which tenant of a shared node matches, ties for the smallest tree),
  the first worker in view order wins: fixed, like a fixed hash order.
- Health probes are `view.stats(name)`; the simulator's tick runs them every 60 s from time 0.
- An attempt refused at the instant of dispatch is a breaker failure; other ends are successes, counted when
  the attempt ends (the router counts one when response headers arrive); a stream cut by a node kill counts
  nothing, its header having come back already.
- The simulator's `exclude` (the router would simply re-select, possibly the same worker): an excluded worker
  keeps its tree and counts toward the load range but is never returned; where it would be, the first available
  worker not excluded is. With none (the router answers 503) the first node not excluded is returned.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from .._types import ClusterView, Outcome, Policy, SimRequest
from .._workload import BLOCK_TOKENS
from ._fallback import first_not_excluded

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
EVICTION_INTERVAL_S = 120.0
MAX_TREE_SIZE_CHARS = 2**26
CHARS_PER_TOKEN = 4
HEALTH_CHECK_INTERVAL_S = 60.0
HEALTH_FAILURE_THRESHOLD = 3
HEALTH_SUCCESS_THRESHOLD = 2
CB_FAILURE_THRESHOLD = 10
CB_SUCCESS_THRESHOLD = 3
CB_TIMEOUT_S = 60.0


@dataclass(slots=True)
class _Node:
    """One block of the shared tree: its parent block, children and the tenants holding it (last access)."""

    parent: int | None
    children: set[int] = field(default_factory=set)
    tenants: dict[str, float] = field(default_factory=dict)


class PrefixTree:
    """sgl-router's multi-tenant approximate radix tree over block ids."""

    def __init__(self, tenants: list[str]) -> None:
        self.order = {t: i for i, t in enumerate(tenants)}
        self.size = dict.fromkeys(tenants, 0)
        self.nodes: dict[int, _Node] = {}

    def insert(self, blocks: tuple[int, ...], tenant: str, now: float) -> None:
        """Add `blocks` to `tenant`'s tree, refreshing its access time along the path."""
        self.size.setdefault(tenant, 0)
        parent: int | None = None
        for block in blocks:
            node = self.nodes.get(block)
            if node is None:
                node = self.nodes[block] = _Node(parent)
                if parent is not None:
                    self.nodes[parent].children.add(block)
            if tenant not in node.tenants:
                self.size[tenant] += 1
            node.tenants[tenant] = now
            parent = block

    def match(self, blocks: tuple[int, ...], now: float) -> tuple[int, str | None]:
        """Blocks matched and the (first) tenant holding the deepest one; refreshes that tenant's path."""
        matched = 0
        while matched < len(blocks) and blocks[matched] in self.nodes:
            matched += 1
        if not matched:
            return 0, None
        deepest = self.nodes[blocks[matched - 1]]
        tenant = min(deepest.tenants, key=self.order.__getitem__)
        for block in blocks[:matched]:
            self.nodes[block].tenants[tenant] = now
        return matched, tenant

    def smallest(self) -> str | None:
        """The tenant with the fewest blocks (first in worker order on ties); None without tenants."""
        return min(self.size, key=lambda t: (self.size[t], self.order[t]), default=None)

    def _leaf_of(self, block: int, tenant: str) -> bool:
        """Whether `block` is a leaf of `tenant`'s tree (no child of it holds the tenant)."""
        return all(tenant not in self.nodes[c].tenants for c in self.nodes[block].children)

    def _drop(self, block: int, tenant: str) -> int | None:
        """Take `tenant` off `block`; remove the block when nobody holds it. Returns its parent."""
        node = self.nodes[block]
        del node.tenants[tenant]
        self.size[tenant] -= 1
        if not node.children and not node.tenants:
            del self.nodes[block]
            if node.parent is not None:
                self.nodes[node.parent].children.discard(block)
        return node.parent

    def evict(self, max_size: int) -> None:
        """Drop each tenant's least recently used leaves until its tree holds at most `max_size` blocks."""
        seq = itertools.count()
        heap = [
            (ts, next(seq), tenant, block)
            for block, node in self.nodes.items()
            for tenant, ts in node.tenants.items()
            if self._leaf_of(block, tenant)
        ]
        heapq.heapify(heap)
        while heap:
            _, _, tenant, block = heapq.heappop(heap)
            if self.size[tenant] <= max_size:
                continue
            parent = self._drop(block, tenant)
            if parent is not None and tenant in self.nodes[parent].tenants and self._leaf_of(parent, tenant):
                heapq.heappush(heap, (self.nodes[parent].tenants[tenant], next(seq), tenant, parent))

    def remove(self, tenant: str) -> None:
        """Remove a tenant from every block and from the size table (`remove_tenant`)."""
        for block in [b for b, n in self.nodes.items() if tenant in n.tenants]:
            node = self.nodes[block]
            del node.tenants[tenant]
            if not node.tenants and not node.children:
                self._prune(block)
        self.size.pop(tenant, None)

    def _prune(self, block: int) -> None:
        """Remove `block` and then its ancestors while nobody holds them and they have no children."""
        while block in self.nodes and not self.nodes[block].tenants and not self.nodes[block].children:
            parent = self.nodes.pop(block).parent
            if parent is None:
                return
            self.nodes[parent].children.discard(block)
            block = parent


@dataclass(slots=True)
class _Worker:
    """Router-side state of one worker: load, health-check streaks and circuit breaker."""

    load: int = 0
    healthy: bool = True
    health_fails: int = 0
    health_oks: int = 0
    breaker: str = "closed"
    breaker_changed: float = 0.0
    cb_fails: int = 0
    cb_oks: int = 0

    def available(self, now: float) -> bool:
        """`is_healthy() && circuit_breaker().can_execute()` (an open breaker turns half-open after its timeout)."""
        if self.breaker == "open" and now - self.breaker_changed >= CB_TIMEOUT_S:
            self.breaker, self.breaker_changed, self.cb_fails, self.cb_oks = "half_open", now, 0, 0
        return self.healthy and self.breaker != "open"

    def outcome(self, ok: bool, now: float) -> None:
        """`CircuitBreaker::record_outcome`."""
        if ok:
            self.cb_fails, self.cb_oks = 0, self.cb_oks + 1
            if self.breaker == "half_open" and self.cb_oks >= CB_SUCCESS_THRESHOLD:
                self.breaker, self.breaker_changed, self.cb_fails, self.cb_oks = "closed", now, 0, 0
        else:
            self.cb_oks, self.cb_fails = 0, self.cb_fails + 1
            if self.breaker == "half_open" or (self.breaker == "closed" and self.cb_fails >= CB_FAILURE_THRESHOLD):
                self.breaker, self.breaker_changed = "open", now

    def probe(self, ok: bool) -> None:
        """One health check (`check_health_async`)."""
        if ok:
            self.health_fails, self.health_oks = 0, self.health_oks + 1
            if not self.healthy and self.health_oks >= HEALTH_SUCCESS_THRESHOLD:
                self.healthy, self.health_oks = True, 0
        else:
            self.health_oks, self.health_fails = 0, self.health_fails + 1
            if self.healthy and self.health_fails >= HEALTH_FAILURE_THRESHOLD:
                self.healthy, self.health_fails = False, 0


class WorkerOutcomes:
    """sgl-router's workers and their accounting, shared by the routers forked from it: a worker per node
    (`start_workers`), requests in flight per worker (its load), and each attempt's outcome fed to the worker's
    circuit breaker when the attempt ends (an attempt refused at the instant of dispatch is a failure, a
    completed one a success)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        """The workers in view order, the order in which ties go."""
        self.workers: dict[str, _Worker] = {}
        self._sent_at: dict[int, float] = {}

    def start_workers(self, view: ClusterView) -> None:
        """A worker per node of the view: healthy, idle, its breaker closed."""
        self.names = [n.name for n in view.nodes]
        self.workers = {n: _Worker() for n in self.names}

    def dispatched(self, node: str, request: SimRequest, now: float) -> None:
        self.workers[node].load += 1
        self._sent_at[request.id] = now

    def finished(self, node: str, request: SimRequest, now: float, outcome: Outcome) -> None:
        worker = self.workers[node]
        worker.load = max(0, worker.load - 1)
        refused = self._sent_at.pop(request.id, None) == now and outcome is Outcome.CONNECT_ERROR
        if refused or outcome is Outcome.OK:
            worker.outcome(not refused, now)


class SGLangCacheAware(WorkerOutcomes, Policy):
    """sgl-router `cache_aware` with the launcher's defaults, health checker and circuit breaker."""

    name = "sglang"
    tick_s = HEALTH_CHECK_INTERVAL_S

    def __init__(
        self,
        block_tokens: int = BLOCK_TOKENS,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
    ) -> None:
        super().__init__()
        self.max_tree_blocks = MAX_TREE_SIZE_CHARS // (CHARS_PER_TOKEN * block_tokens)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = PrefixTree([])
        self._evicted_at = 0.0

    def start(self, view: ClusterView, now: float) -> None:
        self.start_workers(view)
        self.tree = PrefixTree(self.names)
        self._evicted_at = now

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        available = [n for n in self.names if self.workers[n].available(now)]
        allowed = [n for n in available if n not in exclude]
        if not allowed:
            return first_not_excluded(self.names, exclude)
        loads = [self.workers[n].load for n in available]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            chosen = min(allowed, key=lambda n: self.workers[n].load)
            self.tree.insert(request.blocks, chosen, now)
            return chosen
        matched, tenant = self.tree.match(request.blocks, now)
        rate = matched / len(request.blocks) if request.blocks else 0.0
        selected = tenant if tenant is not None and rate > self.cache_threshold else self.tree.smallest()
        if selected in allowed:
            self.tree.insert(request.blocks, selected, now)
            return selected
        if selected is not None and selected not in available:
            self.tree.remove(selected)
        return allowed[0]

    def tick(self, view: ClusterView, now: float) -> None:
        for name in self.names:
            self.workers[name].probe(view.stats(name) is not None)
        if now - self._evicted_at >= EVICTION_INTERVAL_S:
            self.tree.evict(self.max_tree_blocks)
            self._evicted_at = now
