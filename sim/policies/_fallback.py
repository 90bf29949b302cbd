"""What a baseline sends an attempt to when it has no candidate for it."""

from __future__ import annotations

from collections.abc import Sequence


def first_not_excluded(names: Sequence[str], exclude: frozenset[str]) -> str:
    """The first of `names` not in `exclude`, else the first of all. The modelled routers answer an error there
    (nginx's 502 "no live upstreams", the others' no available worker); the replay sends the attempt here instead,
    so that it fails or succeeds on a node as the `Policy` contract asks."""
    return next((name for name in names if name not in exclude), names[0])
