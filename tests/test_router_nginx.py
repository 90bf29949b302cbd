"""`render_nginx`: a routing table as nginx upstream blocks with weights, max_fails and fail_timeout."""

from __future__ import annotations

import pytest

from prismlb.router import render_nginx
from prismlb.wire import RoutingTable, SliceTable, TableNode


def node(node_id: str, endpoint: str, weight: float, gpu: int | None = None) -> TableNode:
    return TableNode(node_id=node_id, endpoint=endpoint, weight=weight, gpu=gpu)


TABLE = RoutingTable(
    epoch=7,
    version=3,
    issued_unix_s=86400.0,
    guardian="degrade",
    slices=[
        SliceTable(
            name="llm",
            nodes=[
                node("a100-1", "http://10.0.0.1:8000", 1.0),
                node("a100-2", "http://10.0.0.2:8000/", 0.55),
                node("a100-3", "10.0.0.3:8000", 0.05),
            ],
        ),
        SliceTable(
            name="av",
            nodes=[node("l40s-1", "http://10.0.1.1:8000", 0.5, gpu=g) for g in range(4)]
            + [node("l40s-2", "http://[fd00::2]:8000", 0.25, gpu=0)],
        ),
        SliceTable(name="vlm", nodes=[], fallback="llm"),
        SliceTable(name="rag", nodes=[]),
    ],
)


def test_every_slice_becomes_an_upstream_with_nginx_weights() -> None:
    assert render_nginx(TABLE, max_fails=3, fail_timeout_s=30).splitlines() == [
        "# Prism routing table epoch 7 version 3, issued 1970-01-02T00:00:00Z, guardian 'degrade'",
        "upstream prism_llm {",
        "    hash $http_x_prism_affinity_key consistent;",
        "    server 10.0.0.1:8000 weight=20 max_fails=3 fail_timeout=30s;  # a100-1",
        "    server 10.0.0.2:8000 weight=11 max_fails=3 fail_timeout=30s;  # a100-2",
        "    server 10.0.0.3:8000 weight=1 max_fails=3 fail_timeout=30s;  # a100-3",
        "}",
        "upstream prism_av {",
        "    hash $http_x_prism_affinity_key consistent;",
        "    server 10.0.1.1:8000 weight=40 max_fails=3 fail_timeout=30s;  # l40s-1",  # four GPUs of one server
        "    server [fd00::2]:8000 weight=5 max_fails=3 fail_timeout=30s;  # l40s-2",
        "}",
        "# slice 'vlm' has no nodes: the servers of its fallback 'llm'",
        "upstream prism_vlm {",
        "    hash $http_x_prism_affinity_key consistent;",
        "    server 10.0.0.1:8000 weight=20 max_fails=3 fail_timeout=30s;  # a100-1",
        "    server 10.0.0.2:8000 weight=11 max_fails=3 fail_timeout=30s;  # a100-2",
        "    server 10.0.0.3:8000 weight=1 max_fails=3 fail_timeout=30s;  # a100-3",
        "}",
        "# slice 'rag': no nodes, so no upstream prism_rag",
    ]


def test_one_slice_round_robin_and_bad_endpoints_left_out() -> None:
    table = RoutingTable(
        epoch=1,
        version=1,
        issued_unix_s=0.0,
        slices=[
            SliceTable(
                name="llm",
                nodes=[node("ok", "http://host-1.pool:9000", 1.0), node("evil", "h:1; include /etc/passwd", 1.0)],
            ),
            SliceTable(name="vlm\n}", nodes=[]),
        ],
    )
    text = render_nginx(table, slice_name="llm", hash_key="")
    assert text.splitlines()[1:] == [
        "upstream prism_llm {",
        "    server host-1.pool:9000 weight=20 max_fails=1 fail_timeout=10s;  # ok",
        "    # node evil: endpoint is not host:port, left out",
        "}",
    ]
    assert "# slice 'vlm\\n}': no nodes, so no upstream prism_vlm__" in render_nginx(table)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="no slice 'x'"):
        render_nginx(TABLE, slice_name="x")
    with pytest.raises(ValueError, match="one nginx variable"):
        render_nginx(TABLE, hash_key="$x; evil")
    with pytest.raises(ValueError, match="max_fails"):
        render_nginx(TABLE, max_fails=-1)


def test_overflow_entries_are_backup_servers_or_left_out_under_hash() -> None:
    spill = TableNode(node_id="h100-1", endpoint="http://10.0.2.1:8000", weight=1.0, overflow=True)
    pool = node("l40s-1", "http://10.0.1.1:8000", 1.0)
    table = RoutingTable(epoch=1, version=1, issued_unix_s=0.0, slices=[SliceTable(name="av", nodes=[pool, spill])])
    assert render_nginx(table, hash_key="").splitlines()[1:] == [
        "upstream prism_av {",
        "    server 10.0.1.1:8000 weight=20 max_fails=1 fail_timeout=10s;  # l40s-1",
        "    server 10.0.2.1:8000 backup max_fails=1 fail_timeout=10s;  # h100-1",
        "}",
    ]
    hashed = render_nginx(table).splitlines()
    assert "    # 10.0.2.1:8000 (h100-1): overflow entry, left out (no backup servers with hash)" in hashed
    assert not any("server 10.0.2.1" in line for line in hashed)
