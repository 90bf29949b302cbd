"""nginx `hash $http_x_modality_signature consistent`: a ketama ring keyed by the request's modality signature.

Source: nginx/nginx mainline (1.27 sources), `src/http/modules/ngx_http_upstream_hash_module.c`
(`ngx_http_upstream_update_chash`, `ngx_http_upstream_find_chash_point`, `ngx_http_upstream_get_chash_peer`);
https://nginx.org/en/docs/http/ngx_http_upstream_module.html#hash.

The ring holds 160 points per unit of weight per server. A server `host:port` hashes as in Cache::Memcached::Fast:
`base = crc32(host "\\0" port)` and point `j` is `crc32` of base followed by point `j-1`'s value as 4
little-endian bytes (0 for the first); points are sorted and duplicate values dropped. A request goes to the
first point at or after `crc32(key)`, wrapping; a point whose server is tried or down (passive health, as in
`_round_robin`) is passed over for the next one, and after more than 20 such tries nginx falls back to plain
round robin. An empty key also means round robin.

The key is the request's `X-Modality-Signature` value, faithfully: every request of one signature goes to one
node, so all "text" traffic lands on a single server while it is up. That is the point of this baseline.

Simplifications: those of `NginxUpstream`; the walk restarts from the key's point on each attempt of a request
(nginx keeps its position, which passes the same points).
"""

from __future__ import annotations

import bisect
import zlib

from prismlb.router import nginx_ring_points as ring_points

from .._types import ClusterView, SimRequest
from ._round_robin import NginxUpstream

MAX_TRIES = 20


class NginxConsistentHash(NginxUpstream):
    """nginx `hash $http_x_modality_signature consistent` with max_fails=1 fail_timeout=10s."""

    name = "nginx-hash"
    ring: list[tuple[int, str]]
    """(point, server) in point order, built at `start` from the upstream's peers and weights."""
    _hashes: list[int]

    def start(self, view: ClusterView, now: float) -> None:
        super().start(view, now)
        self.ring = ring_points({p.server: p.weight for p in self.peers})
        self._hashes = [h for h, _ in self.ring]

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        key = request.signature.encode()
        if not key:
            return self.round_robin(now, exclude)
        point = bisect.bisect_left(self._hashes, zlib.crc32(key))
        for _ in range(MAX_TRIES + 1):
            server = self.ring[point % len(self.ring)][1]
            best = self.smooth(p for p in self.peers if p.server == server and self.ready(p, now, exclude))
            if best is not None:
                return self.picked(best, now, exclude)
            point += 1
        return self.round_robin(now, exclude)
