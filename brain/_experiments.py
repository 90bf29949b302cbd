"""A/B gray releases: named experiments splitting a slice's traffic between model versions.

Each arm's fraction is clamped to [0.001, 1.0] (the design's floor of 0.1% and cap of 100%). Fractions
are relative shares: after clamping they are divided by their sum, so `{"v1": 0.9, "v2": 0.2}` becomes 0.818 /
0.182 and `{"v1": 0.95, "v2": 0.05}` is a 5% canary. A lone arm takes the whole slice. An arm that falls under
the floor after the division is raised back to 0.001, so stored fractions may sum to slightly more than 1;
`assign_arm` divides by the actual sum and never leaves a gap.

Every change bumps a monotonic `revision`; the brain puts `snapshot()` into its next routing table, so the
change reaches routers with a table version, whole (a table is one message). With a state directory the
experiments and the revision are persisted to `experiments.json` (written to a temporary file, then renamed)
and reloaded on restart.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import msgspec

from prismlb.wire import ConfigError, Experiment, ExperimentArm

_log = logging.getLogger("prism.brain")

EXPERIMENTS_FILE = "experiments.json"
MIN_FRACTION = 0.001
MAX_FRACTION = 1.0
MAX_ARMS = 16
MAX_EXPERIMENTS = 64
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class _State(msgspec.Struct, kw_only=True):
    revision: Annotated[int, msgspec.Meta(ge=0)] = 0
    experiments: Annotated[list[Experiment], msgspec.Meta(max_length=MAX_EXPERIMENTS)] = []


def clamp_fraction(fraction: float) -> float:
    """The design's clamp: at least 0.1% and at most 100% of the slice."""
    if not math.isfinite(fraction):
        raise ValueError(f"fraction must be a finite number, got {fraction!r}")
    return max(MIN_FRACTION, min(MAX_FRACTION, fraction))


def normalise(arms: Mapping[str, float]) -> list[ExperimentArm]:
    """Clamp each fraction, divide by their sum, then raise any arm under the floor back to it."""
    if not 1 <= len(arms) <= MAX_ARMS:
        raise ValueError(f"an experiment needs 1 to {MAX_ARMS} arms, got {len(arms)}")
    for version in arms:
        if not 0 < len(version) <= 256:
            raise ValueError(f"model version must be 1 to 256 characters, got {version!r}")
    clamped = {version: clamp_fraction(fraction) for version, fraction in arms.items()}
    total = sum(clamped.values())
    return [
        ExperimentArm(model_version=version, fraction=max(MIN_FRACTION, fraction / total))
        for version, fraction in clamped.items()
    ]


class Experiments:
    """The registry of experiments; thread-safe, persisted under `state_dir` when given."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._path = state_dir / EXPERIMENTS_FILE if state_dir is not None else None
        self._state = self._load()

    @property
    def revision(self) -> int:
        return self._state.revision

    def snapshot(self) -> list[Experiment]:
        """The current experiments, sorted by name (the list the next routing table carries)."""
        return list(self._state.experiments)

    def set(self, name: str, slice_name: str, arms: Mapping[str, float]) -> Experiment:
        """Create or replace an experiment; one experiment per slice; returns it as stored."""
        if not _NAME.match(name):
            raise ValueError(f"experiment name must match {_NAME.pattern}, got {name!r}")
        if not 0 < len(slice_name) <= 64:
            raise ValueError(f"slice must be 1 to 64 characters, got {slice_name!r}")
        experiment = Experiment(name=name, slice=slice_name, arms=normalise(arms))
        with self._lock:
            current = {e.name: e for e in self._state.experiments}
            if current.get(name) == experiment:
                return experiment
            for other in current.values():
                if other.slice == slice_name and other.name != name:
                    raise ValueError(f"slice {slice_name!r} already has experiment {other.name!r}")
            if name not in current and len(current) >= MAX_EXPERIMENTS:
                raise ValueError(f"at most {MAX_EXPERIMENTS} experiments")
            current[name] = experiment
            revision = self._commit(current)
        _log.info(
            "experiment %s on slice %s: %s (revision %d)",
            name,
            slice_name,
            ", ".join(f"{a.model_version}={a.fraction:.3f}" for a in experiment.arms),
            revision,
        )
        return experiment

    def remove(self, name: str) -> bool:
        """Remove an experiment; False when there was none of that name."""
        with self._lock:
            current = {e.name: e for e in self._state.experiments}
            if current.pop(name, None) is None:
                return False
            revision = self._commit(current)
        _log.info("experiment %s removed (revision %d)", name, revision)
        return True

    def _commit(self, experiments: dict[str, Experiment]) -> int:
        state = _State(revision=self._state.revision + 1, experiments=[experiments[n] for n in sorted(experiments)])
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(msgspec.json.format(msgspec.json.encode(state)) + b"\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
        self._state = state
        return state.revision

    def _load(self) -> _State:
        if self._path is None:
            return _State()
        try:
            data = self._path.read_bytes()
        except FileNotFoundError:
            return _State()
        try:
            state = msgspec.json.decode(data, type=_State)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{self._path}: not a valid experiments file: {exc}") from None
        names = [e.name for e in state.experiments]
        slices = [e.slice for e in state.experiments]
        if len(set(names)) != len(names) or len(set(slices)) != len(slices):
            raise ConfigError(f"{self._path}: experiment names and slices must be unique")
        _log.info("loaded %d experiments (revision %d) from %s", len(state.experiments), state.revision, self._path)
        return state
