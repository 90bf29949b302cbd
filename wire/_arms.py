"""A/B arm assignment, shared by the brain (which defines experiments) and the router (which applies them)."""

from __future__ import annotations

import hashlib

from ._messages import Experiment


def assign_arm(experiment: Experiment, session_key: str | bytes) -> str:
    """The model version for a session: stable per (experiment, session), spread by the arms' fractions."""
    key = session_key.encode() if isinstance(session_key, str) else session_key
    digest = hashlib.blake2b(experiment.name.encode() + b"\0" + key, digest_size=8).digest()
    point = int.from_bytes(digest, "big") / 2**64 * sum(arm.fraction for arm in experiment.arms)
    for arm in experiment.arms:
        point -= arm.fraction
        if point < 0:
            return arm.model_version
    return experiment.arms[-1].model_version
