"""Splitting traffic by fractions, stable per key: A/B arms (the brain defines experiments, routers apply them) and
the zone split (the brain's failover scheduler sets it, routers in each zone apply it)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from prismlb.wire import Experiment, ZoneRoute


def _share(salt: str, key: str | bytes, fractions: Sequence[float]) -> int:
    """The index of the share `key` falls in: a point hashed from (salt, key), laid over the fractions in order.
    Stable per key; a change of fractions moves only keys near the boundaries that moved."""
    raw = key.encode() if isinstance(key, str) else key
    digest = hashlib.blake2b(salt.encode() + b"\0" + raw, digest_size=8).digest()
    point = int.from_bytes(digest, "big") / 2**64 * sum(fractions)
    for index, fraction in enumerate(fractions):
        point -= fraction
        if point < 0:
            return index
    return len(fractions) - 1


def assign_arm(experiment: Experiment, session_key: str | bytes) -> str:
    """The model version for a session: stable per (experiment, session), spread by the arms' fractions."""
    arms = experiment.arms
    return arms[_share(experiment.name, session_key, [arm.fraction for arm in arms])].model_version


def assign_zone(route: ZoneRoute, key: str | bytes) -> str:
    """The serving zone for a key from a router in `route.caller`: stable per key while the split holds."""
    shares = route.shares
    return shares[_share("zone:" + route.caller, key, [share.fraction for share in shares])].zone
