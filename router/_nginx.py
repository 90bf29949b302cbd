"""A routing table as nginx `upstream` blocks, for people who keep nginx in front of the inference servers, and
where nginx's `hash ... consistent` sends a key among those blocks' servers."""

from __future__ import annotations

import re
import time
import zlib
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prismlb.wire import RoutingTable, SliceTable

NGINX_WEIGHT_SCALE = 20
"""nginx weights are integers: weight = round(20 × table weight), so the brain's 0.05 steps map to 1…20."""
DEFAULT_HASH = "$http_x_prism_affinity_key"
POINTS_PER_WEIGHT = 160
"""Points per unit of `weight` on nginx's consistent-hash ring (`ngx_http_upstream_hash_module.c`)."""

_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*)(?::([0-9]{1,5}))?$")
_UNIX_PATH = re.compile(r"^/[A-Za-z0-9._/@+=,-]{0,106}$")  # an absolute path that fits sockaddr_un (108 bytes)
_URL_PATH = re.compile(r"^[A-Za-z0-9._~!&()*+,=:@%/-]*$")  # what an unquoted nginx argument carries as it is
_LISTEN = re.compile(r"^(?:(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):)?([0-9]{1,5})$")
_DEFAULT_PORTS = {"http": "", "https": ":443"}  # nginx's `server host` means port 80, which is right for http only


@dataclass(frozen=True)
class _Target:
    """Where nginx sends an endpoint's requests: its `server` address, and the scheme and path prefix of
    `proxy_pass`. The path has no trailing '/': the router puts it before the request's path, and so does
    `proxy_pass scheme://upstream/path/` in `location /`."""

    server: str
    scheme: str
    path: str


def _target(endpoint: str) -> _Target | str:
    """The endpoint as nginx can take it (`host:port`, `http(s)://host:port/path`, `unix:/path`), or why not."""
    if endpoint[:5].lower() == "unix:":
        path = endpoint[5:]
        if not _UNIX_PATH.match(path):
            return "not a unix socket path nginx takes (absolute, at most 107 plain characters)"
        return _Target(f"unix:{path}", "http", "")
    explicit = "://" in endpoint
    try:
        parts = urlsplit(endpoint if explicit else f"//{endpoint}")
    except ValueError:  # an unclosed IPv6 bracket, say
        return "not host:port or a URL of one"
    scheme = parts.scheme.lower() if explicit else "http"
    if scheme not in _DEFAULT_PORTS:
        return f"scheme {parts.scheme!r}: nginx proxies to http and https only"
    if "@" in parts.netloc:
        return "credentials in the URL, which an nginx server line cannot carry"
    match = _HOST_PORT.match(parts.netloc)
    if match is None:
        return "not host:port or a URL of one"
    if match[2] is not None and not 0 < int(match[2]) < 65536:
        return f"port {match[2]} is out of range"
    path = parts.path.rstrip("/")
    if not _URL_PATH.match(path):
        return "its path has characters an nginx config cannot carry"
    server = parts.netloc if match[2] is not None else parts.netloc + _DEFAULT_PORTS[scheme]
    return _Target(server, scheme, path)


def _quoted(text: str) -> str:
    """Text for a comment: as it is when printable, else its repr, so that no newline ends the comment."""
    return text if text.isprintable() else repr(text)


@dataclass
class _Upstream:
    """One slice's upstream as nginx takes it: servers with summed table weights and their node ids, overflow
    servers, the scheme and path every server is proxied with, and notes on the endpoints left out."""

    name: str
    scheme: str = "http"
    path: str = ""
    mixed: bool = False  # endpoints of other schemes or paths were left out
    weights: dict[str, float] = field(default_factory=dict)
    nodes: dict[str, list[str]] = field(default_factory=dict)
    spill: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """The servers' scheme and path, as a comment shows them."""
        return f"{self.scheme}://HOST:PORT{self.path}"

    def nginx_weights(self) -> dict[str, int]:
        """Each server's `weight=`, in the order the block lists them."""
        return {server: max(1, round(NGINX_WEIGHT_SCALE * w)) for server, w in self.weights.items()}

    def proxy_pass(self) -> str:
        """`proxy_pass` for `location /`: the endpoints' scheme, and their path before the request's."""
        return f"{self.scheme}://{self.name}{self.path}/" if self.path else f"{self.scheme}://{self.name}"


def _upstream(name: str, source: SliceTable) -> _Upstream:
    upstream = _Upstream(name)
    targets = []
    for node in source.nodes:
        target = _target(node.endpoint)
        if isinstance(target, str):
            upstream.notes.append(f"node {_quoted(node.node_id)}: {target}, left out")
        else:
            targets.append((node, target))
    by_kind: dict[tuple[str, str], float] = {}
    for node, target in targets:
        by_kind[target.scheme, target.path] = by_kind.get((target.scheme, target.path), 0.0) + node.weight
    if by_kind:  # one proxy_pass serves the whole upstream: the heaviest scheme and path win, the first on a tie
        upstream.scheme, upstream.path = max(by_kind, key=lambda kind: by_kind[kind])
    upstream.mixed = len(by_kind) > 1
    for node, target in targets:
        if (target.scheme, target.path) != (upstream.scheme, upstream.path):
            kind = f"{target.scheme}://HOST:PORT{target.path}"
            upstream.notes.append(f"node {_quoted(node.node_id)}: {kind}, not {upstream.kind}, left out")
        elif node.overflow:
            upstream.spill.setdefault(target.server, []).append(node.node_id)
        else:  # one server per address: its GPU entries add up
            upstream.weights[target.server] = upstream.weights.get(target.server, 0.0) + node.weight
            upstream.nodes.setdefault(target.server, []).append(node.node_id)
    return upstream


def _ids(node_ids: list[str]) -> str:
    return ", ".join(_quoted(node_id) for node_id in sorted(set(node_ids)))


def _block(upstream: _Upstream, max_fails: int, fail_timeout_s: float, hash_key: str) -> list[str]:
    if not upstream.weights:  # nginx refuses an upstream without a (non-backup) server
        spill = [
            f"{server} ({_ids(ids)}): overflow entry, never the only server" for server, ids in upstream.spill.items()
        ]
        return [
            f"# no upstream {upstream.name}: no endpoint of it is a server nginx takes",
            *(f"# {note}" for note in [*spill, *upstream.notes]),
        ]
    lines = []
    if upstream.mixed:
        lines.append(f"# endpoints disagree on scheme or path: the {upstream.kind} ones are the servers")
    if upstream.proxy_pass() != f"http://{upstream.name}":
        lines.append(f"# endpoints {upstream.kind}: in location /, proxy_pass {upstream.proxy_pass()};")
    lines.append(f"upstream {upstream.name} {{")
    if hash_key:
        lines.append(f"    hash {hash_key} consistent;")
    limits = f"max_fails={max_fails} fail_timeout={fail_timeout_s:g}s"
    for server, weight in upstream.nginx_weights().items():
        lines.append(f"    server {server} weight={weight} {limits};  # {_ids(upstream.nodes[server])}")
    for server, ids in upstream.spill.items():
        if server in upstream.weights:
            continue
        if hash_key:  # nginx takes no backup servers with hash: overflow is Prism routers' choice by expected TTFT
            lines.append(f"    # {server} ({_ids(ids)}): overflow entry, left out (no backup servers with hash)")
        else:
            lines.append(f"    server {server} backup {limits};  # {_ids(ids)}")
    lines.extend(f"    # {note}" for note in upstream.notes)
    lines.append("}")
    return lines


def _upstreams(table: RoutingTable, slice_name: str | None) -> list[tuple[SliceTable, SliceTable, _Upstream]]:
    """(slice, the slice whose nodes it takes, its upstream) for every slice or only `slice_name`: an empty
    slice takes its fallback's nodes, following fallbacks until one has nodes."""
    by_name = {s.name: s for s in table.slices}
    if slice_name is not None and slice_name not in by_name:
        raise ValueError(f"no slice {slice_name!r} in the table (slices: {', '.join(sorted(by_name)) or 'none'})")
    found = []
    for slice_table in table.slices:
        if slice_name is not None and slice_table.name != slice_name:
            continue
        source, seen = slice_table, {slice_table.name}
        while not source.nodes and source.fallback in by_name and source.fallback not in seen:
            source = by_name[source.fallback]
            seen.add(source.name)
        found.append(
            (slice_table, source, _upstream("prism_" + re.sub(r"[^A-Za-z0-9_]", "_", slice_table.name), source))
        )
    return found


def check_nginx_settings(max_fails: int, fail_timeout_s: float, hash_key: str, listen: str | None = None) -> None:
    """ValueError unless `render_nginx` can take these settings, so that a command can refuse them up front."""
    if max_fails < 0:
        raise ValueError(f"max_fails (--max-fails) must be at least 0, got {max_fails}")
    if not fail_timeout_s > 0:
        raise ValueError(f"fail_timeout_s (--fail-timeout) must be positive, got {fail_timeout_s:g}")
    if hash_key and not re.fullmatch(r"\$[A-Za-z0-9_]+", hash_key):
        raise ValueError(
            f"hash key (--nginx-hash) must be one nginx variable such as $http_x_session_token, got {hash_key!r}"
        )
    if listen is not None:
        match = _LISTEN.match(listen)
        if match is None or not 0 < int(match[1]) < 65536:
            raise ValueError(f"listen (--nginx-listen) must be PORT or HOST:PORT, port 1..65535, got {listen!r}")


def render_nginx(
    table: RoutingTable,
    *,
    slice_name: str | None = None,
    max_fails: int = 1,
    fail_timeout_s: float = 10.0,
    hash_key: str = DEFAULT_HASH,
    listen: str | None = None,
) -> str:
    """One `upstream prism_<slice>` block per slice (or only `slice_name`), with nginx weights, `max_fails`
    and `fail_timeout`, hashing on `hash_key` (empty: nginx's weighted round robin). An empty slice gets its
    fallback's servers. A slice's overflow entries (`TableNode.overflow`) are `backup` servers under round robin;
    nginx takes no backup servers with `hash`, so there they are left out, with a comment.

    Only what nginx loads is rendered: an endpoint nginx cannot take (another scheme, credentials, a bad port) is
    left out with a comment saying why, and a slice with no server left gets comments instead of the empty
    upstream nginx refuses. Endpoints are `host:port`, `http(s)://host:port/path` or `unix:/path`; `https` and a
    path prefix need their `proxy_pass` (`https://prism_<slice>/path/` in `location /`), which a comment gives.
    One `proxy_pass` serves all of an upstream's servers, so when endpoints disagree on scheme or path only those
    of the heaviest kind are servers, and comments say so.

    With `listen` (`PORT` or `HOST:PORT`), a `server` block follows that proxies `location /` to the slice's
    upstream with that `proxy_pass` (503 while it has no server): a config to include in nginx's `http` block as
    it is. It serves one slice, so a table of several slices needs `slice_name`.
    """
    check_nginx_settings(max_fails, fail_timeout_s, hash_key, listen)
    if listen is not None and slice_name is None and len(table.slices) != 1:
        raise ValueError(f"a server block proxies to one slice: name it (the table has {len(table.slices)})")
    issued = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(table.issued_unix_s))
    head = f"# Prism routing table epoch {table.epoch} version {table.version}, issued {issued}"
    lines = [f"{head}, guardian {table.guardian!r}"]
    upstreams = _upstreams(table, slice_name)
    for slice_table, source, upstream in upstreams:
        if not source.nodes:
            lines.append(f"# slice {slice_table.name!r}: no nodes, so no upstream {upstream.name}")
            continue
        if source is not slice_table:
            lines.append(f"# slice {slice_table.name!r} has no nodes: the servers of its fallback {source.name!r}")
        lines.extend(_block(upstream, max_fails, fail_timeout_s, hash_key))
    if listen is not None:
        lines.extend(_server_block(listen, upstreams[0][2]))
    return "\n".join(lines) + "\n"


def _server_block(listen: str, upstream: _Upstream) -> list[str]:
    if upstream.weights:
        location = [
            f"        proxy_pass {upstream.proxy_pass()};",
            "        proxy_http_version 1.1;",
            "        proxy_buffering off;  # streamed tokens go out as they come",
        ]
    else:
        location = [f"        return 503;  # no upstream {upstream.name}"]
    return ["server {", f"    listen {listen};", "    location / {", *location, "    }", "}"]


def ring_points(servers: Mapping[str, int]) -> list[tuple[int, str]]:
    """nginx's consistent-hash points `(hash, server)` for `{server: weight}`, sorted, duplicates dropped.

    As `ngx_http_upstream_init_chash` computes them (Cache::Memcached::Fast's ketama): `weight × 160` points per
    server; a server `host:port` hashes as `base = crc32(host "\\0" port)` (`unix:PATH` as the path with no port,
    anything else as a host with no port), and point `j` is the CRC-32 of base continued with point `j-1`'s value
    as 4 little-endian bytes (0 before the first).
    """
    points: list[tuple[int, str]] = []
    for server, weight in servers.items():
        host, port = _host_port(server)
        base = zlib.crc32(host + b"\0" + port)
        prev = 0
        for _ in range(POINTS_PER_WEIGHT * weight):
            prev = zlib.crc32(prev.to_bytes(4, "little"), base)
            points.append((prev, server))
    points.sort(key=lambda p: p[0])
    return [p for i, p in enumerate(points) if i == 0 or p[0] != points[i - 1][0]]


def _host_port(server: str) -> tuple[bytes, bytes]:
    """Split as nginx does: `unix:` paths have no port; otherwise digits after the last ':' are the port."""
    raw = server.encode()
    if raw[:5].lower() == b"unix:":
        return raw[5:], b""
    host, sep, port = raw.rpartition(b":")
    return (host, port) if sep and port.isdigit() else (raw, b"")


@dataclass(frozen=True)
class NginxChoice:
    """Where nginx sends a key: the upstream, and the `server` it picks with the table's node ids there (None and
    none for the empty key, which nginx balances round robin)."""

    upstream: str
    server: str | None
    node_ids: tuple[str, ...]


def nginx_choices(table: RoutingTable, keys: Sequence[str], slice_name: str) -> list[NginxChoice]:
    """The server nginx's `hash $var consistent` picks in the upstream `render_nginx` writes for `slice_name`,
    for a request whose `$var` is each key, while every server is up (a failed server passes its keys on to the
    next point of the ring): the first ring point at or after the key's CRC-32, wrapping, as
    `ngx_http_upstream_init_chash_peer` finds it. ValueError for an unknown slice or one with no upstream."""
    ((slice_table, _source, upstream),) = _upstreams(table, slice_name)
    if not upstream.weights:
        raise ValueError(f"slice {slice_table.name!r} has no upstream: no endpoint of it is a server nginx takes")
    points = ring_points(upstream.nginx_weights())
    hashes = [h for h, _ in points]
    choices = []
    for key in keys:
        if not key:
            choices.append(NginxChoice(upstream.name, None, ()))
            continue
        server = points[bisect_left(hashes, zlib.crc32(key.encode())) % len(points)][1]
        choices.append(NginxChoice(upstream.name, server, tuple(sorted(set(upstream.nodes[server])))))
    return choices
