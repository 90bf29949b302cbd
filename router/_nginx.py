"""A routing table as nginx `upstream` blocks, for people who keep nginx in front of the inference servers."""

from __future__ import annotations

import re
import time
from urllib.parse import urlsplit

from prismlb.wire import RoutingTable, SliceTable

NGINX_WEIGHT_SCALE = 20
"""nginx weights are integers: weight = round(20 × table weight), so the brain's 0.05 steps map to 1…20."""
DEFAULT_HASH = "$http_x_prism_affinity_key"

_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*)(:[0-9]{1,5})?$")


def _server(endpoint: str) -> str | None:
    """`host:port` of an endpoint such as `http://10.0.0.5:8000/v1`; None when it is not one."""
    netloc = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}").netloc
    return netloc if _HOST_PORT.match(netloc) else None


def _upstream_name(slice_name: str) -> str:
    return "prism_" + re.sub(r"[^A-Za-z0-9_]", "_", slice_name)


def _block(name: str, source: SliceTable, max_fails: int, fail_timeout_s: float, hash_key: str) -> list[str]:
    weights: dict[str, float] = {}
    nodes: dict[str, list[str]] = {}
    skipped: list[str] = []
    spill: dict[str, list[str]] = {}
    for node in source.nodes:
        server = _server(node.endpoint)
        if server is None:
            skipped.append(node.node_id)
            continue
        if node.overflow:
            spill.setdefault(server, []).append(node.node_id)
            continue
        weights[server] = weights.get(server, 0.0) + node.weight  # one server per address: its GPU entries add up
        nodes.setdefault(server, []).append(node.node_id)
    lines = [f"upstream {name} {{"]
    if hash_key:
        lines.append(f"    hash {hash_key} consistent;")
    for server, weight in weights.items():
        nginx_weight = max(1, round(NGINX_WEIGHT_SCALE * weight))
        lines.append(
            f"    server {server} weight={nginx_weight} max_fails={max_fails} fail_timeout={fail_timeout_s:g}s;"
            f"  # {', '.join(sorted(set(nodes[server])))}"
        )
    for server, ids in spill.items():
        if server in weights:
            continue
        label = ", ".join(sorted(set(ids)))
        if hash_key:  # nginx takes no backup servers with hash: overflow is Prism routers' choice by expected TTFT
            lines.append(f"    # {server} ({label}): overflow entry, left out (no backup servers with hash)")
        else:
            limits = f"max_fails={max_fails} fail_timeout={fail_timeout_s:g}s"
            lines.append(f"    server {server} backup {limits};  # {label}")
    lines.extend(f"    # node {node_id}: endpoint is not host:port, left out" for node_id in skipped)
    lines.append("}")
    return lines


def render_nginx(
    table: RoutingTable,
    *,
    slice_name: str | None = None,
    max_fails: int = 1,
    fail_timeout_s: float = 10.0,
    hash_key: str = DEFAULT_HASH,
) -> str:
    """One `upstream prism_<slice>` block per slice (or only `slice_name`), with nginx weights, `max_fails`
    and `fail_timeout`, hashing on `hash_key` (empty: nginx's weighted round robin). An empty slice gets its
    fallback's servers; a slice with neither gets a comment, since nginx refuses an empty upstream. A slice's
    overflow entries (`TableNode.overflow`) are `backup` servers under round robin; nginx takes no backup servers
    with `hash`, so there they are left out, with a comment.
    """
    if max_fails < 0 or fail_timeout_s <= 0:
        raise ValueError("max_fails must be at least 0 and fail_timeout_s positive")
    if hash_key and not re.fullmatch(r"\$[A-Za-z0-9_]+", hash_key):
        raise ValueError(f"hash key must be one nginx variable such as $http_x_session_token, got {hash_key!r}")
    by_name = {s.name: s for s in table.slices}
    if slice_name is not None and slice_name not in by_name:
        raise ValueError(f"no slice {slice_name!r} in the table (slices: {', '.join(sorted(by_name)) or 'none'})")
    issued = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(table.issued_unix_s))
    lines = [
        f"# Prism routing table epoch {table.epoch} version {table.version}, issued {issued}, guardian {table.guardian!r}"
    ]
    for slice_table in table.slices:
        if slice_name is not None and slice_table.name != slice_name:
            continue
        source, seen = slice_table, {slice_table.name}
        while not source.nodes and source.fallback in by_name and source.fallback not in seen:
            source = by_name[source.fallback]
            seen.add(source.name)
        name = _upstream_name(slice_table.name)
        if not source.nodes:
            lines.append(f"# slice {slice_table.name!r}: no nodes, so no upstream {name}")
            continue
        if source is not slice_table:
            lines.append(f"# slice {slice_table.name!r} has no nodes: the servers of its fallback {source.name!r}")
        lines.extend(_block(name, source, max_fails, fail_timeout_s, hash_key))
    return "\n".join(lines) + "\n"
