"""nginx's `least_conn`: the ready peer with the fewest active connections, ties broken by round robin.

Source: nginx/nginx mainline (1.27 sources), `src/http/modules/ngx_http_upstream_least_conn_module.c`
(`ngx_http_upstream_get_least_conn_peer`); https://nginx.org/en/docs/http/ngx_http_upstream_module.html#least_conn.

The first ready peer with the least `conns / weight` wins; when several share it, nginx's smooth weighted round
robin runs over exactly those peers. `conns` counts attempts dispatched and not yet finished by this balancer
(one nginx worker process, as `zone`-less nginx counts per worker). Passive health and every simplification
are those of `NginxUpstream` (see `_round_robin`).
"""

from __future__ import annotations

from .._types import SimRequest
from ._round_robin import NginxUpstream


class LeastConnections(NginxUpstream):
    """nginx `least_conn` with equal weights and max_fails=1 fail_timeout=10s."""

    name = "least-conn"

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        ready = [p for p in self.peers if self.ready(p, now, exclude)]
        if not ready:
            return self.picked(None, now, exclude)
        least = min(ready, key=lambda p: p.conns / p.weight)
        tied = [p for p in ready if p.conns * least.weight == least.conns * p.weight]
        return self.picked(self.smooth(tied) if len(tied) > 1 else least, now, exclude)
