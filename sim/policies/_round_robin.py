"""nginx's round robin: smooth weighted round robin over an upstream, with nginx's passive health checks.

Source: nginx/nginx mainline (1.27 sources), `src/http/ngx_http_upstream_round_robin.c`
(`ngx_http_upstream_get_peer`, `ngx_http_upstream_free_round_robin_peer`) and the `server` parameters of
https://nginx.org/en/docs/http/ngx_http_upstream_module.html (defaults weight=1 max_fails=1 fail_timeout=10s).
`NginxUpstream` is the peer state the least_conn and hash modules share with it, as in nginx.

Each peer keeps `current_weight`, `effective_weight`, `conns`, `fails`, `accessed` and `checked`. Selection adds
`effective_weight` to every ready peer's `current_weight` (and steps a lowered `effective_weight` back up by 1),
takes the highest and subtracts the total from it; with equal weights that is a plain cycle in upstream order.
A peer is skipped while `fails >= max_fails` and `now - checked <= fail_timeout`; after that one request probes
it (`checked = now`). A failed attempt adds a fail, sets `accessed = checked = now` and lowers `effective_weight`
by `weight / max_fails`; a good one clears `fails` when a probe happened since the last failure.

Simplifications: the upstream is the view's nodes in order, `server host:port` from each node's address, no
`backup`, `down`, `max_conns` or `slow_start` servers and at least two servers (nginx skips health accounting
for one). Times are the simulator's float seconds, not nginx's whole seconds. Only a refused connect (a
CONNECT_ERROR reported at the instant of dispatch) is a failure; a stream cut by a node kill had its response
header already, so nginx frees that peer without the failed flag. The simulator's `exclude` is nginx's per-request
`tried` set. Where nginx answers 502 "no live upstreams" (every untried peer is down) the first node not
excluded is returned instead, so the simulator's attempt fails or succeeds there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from .._types import ClusterView, Outcome, Policy, SimRequest
from ._fallback import first_not_excluded

MAX_FAILS = 1
FAIL_TIMEOUT_S = 10.0


def server_of(address: str) -> str:
    """The `server` directive nginx would hold for a node address: `host:port` without a scheme or path."""
    return urlsplit(address).netloc if "://" in address else address


@dataclass(slots=True)
class Peer:
    """One `server` of the upstream and nginx's per-peer state."""

    name: str
    server: str
    weight: int
    effective_weight: int
    current_weight: int = 0
    conns: int = 0
    fails: int = 0
    accessed: float = 0.0
    checked: float = 0.0


class NginxUpstream(Policy):
    """The upstream state nginx's balancers share: peers, smooth weighted round robin and passive health."""

    def __init__(
        self,
        weights: Mapping[str, int] | None = None,
        max_fails: int = MAX_FAILS,
        fail_timeout_s: float = FAIL_TIMEOUT_S,
    ) -> None:
        self.weights = dict(weights or {})
        self.max_fails = max_fails
        self.fail_timeout_s = fail_timeout_s
        self.peers: list[Peer] = []
        self._by_name: dict[str, Peer] = {}
        self._sent_at: dict[int, float] = {}

    def start(self, view: ClusterView, now: float) -> None:
        weight = [self.weights.get(n.name, 1) for n in view.nodes]
        self.peers = [Peer(n.name, server_of(n.address), w, w) for n, w in zip(view.nodes, weight, strict=True)]
        self._by_name = {p.name: p for p in self.peers}

    def ready(self, peer: Peer, now: float, exclude: frozenset[str]) -> bool:
        """Not tried by this request and not within fail_timeout of max_fails failures."""
        if peer.name in exclude:
            return False
        return not (self.max_fails and peer.fails >= self.max_fails and now - peer.checked <= self.fail_timeout_s)

    @staticmethod
    def smooth(candidates: Iterable[Peer]) -> Peer | None:
        """nginx's smooth weighted round robin step over `candidates` (None when there are none)."""
        best: Peer | None = None
        total = 0
        for peer in candidates:
            peer.current_weight += peer.effective_weight
            total += peer.effective_weight
            if peer.effective_weight < peer.weight:
                peer.effective_weight += 1
            if best is None or peer.current_weight > best.current_weight:
                best = peer
        if best is not None:
            best.current_weight -= total
        return best

    def round_robin(self, now: float, exclude: frozenset[str]) -> str:
        """`ngx_http_upstream_get_round_robin_peer`."""
        return self.picked(self.smooth(p for p in self.peers if self.ready(p, now, exclude)), now, exclude)

    def picked(self, peer: Peer | None, now: float, exclude: frozenset[str]) -> str:
        """Start a probe window on the chosen peer; with none, the first node not excluded (nginx: 502)."""
        if peer is None:
            return first_not_excluded([p.name for p in self.peers], exclude)
        if now - peer.checked > self.fail_timeout_s:
            peer.checked = now
        return peer.name

    def dispatched(self, node: str, request: SimRequest, now: float) -> None:
        self._by_name[node].conns += 1
        self._sent_at[request.id] = now

    def finished(self, node: str, request: SimRequest, now: float, outcome: Outcome) -> None:
        peer = self._by_name[node]
        peer.conns -= 1
        refused = self._sent_at.pop(request.id, None) == now and outcome is Outcome.CONNECT_ERROR
        if refused:
            peer.fails += 1
            peer.accessed = peer.checked = now
            if self.max_fails:
                peer.effective_weight = max(0, peer.effective_weight - peer.weight // self.max_fails)
        elif peer.accessed < peer.checked:
            peer.fails = 0


class RoundRobin(NginxUpstream):
    """nginx's default balancer: smooth weighted round robin, equal weights, max_fails=1 fail_timeout=10s."""

    name = "round-robin"

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        return self.round_robin(now, exclude)
