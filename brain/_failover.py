"""Cross-zone failover: for each caller zone (where routers run), which serving zones take what fraction of its
traffic, published with every routing table as the zone split.

Zone-local routing is cheap (no inter-zone round trip, no cross-zone transfer) until the local zone cannot
serve: its nodes stop (a zone outage), slow down (a brownout) or its callers bring more than it can take (a
surge). The brain sees a zone only through its nodes' vectors (`ZoneObservation`), and a zone that stops
reporting still counts its nodes as alive until their last vectors are 1.5 agent periods old, so an outage
shows as alive nodes dropping away one by one within a period, while its requests already fail.

Two deciders, one interface (`split(zones, previous) -> ZoneSplit`):

- `LocalFirst`, the rule: every caller zone keeps its traffic local while its zone's healthy capacity (alive
  nodes × mean routing weight) covers the caller's share of the cluster's demand, else keeps the fraction it
  covers; the rest goes to the other zones by their healthy spare capacity (`split_from_local`).
- `StudentPolicy`, a small LSTM distilled from a PPO teacher trained in the zone simulator
  (`prismlb.sim._failover_train`), which sees the last `HISTORY` cycles of each caller zone's features and can
  learn what the rule cannot express: nodes going stale one after another is an outage, so leave at once;
  a slow zone whose queues stay short needs no spill.

The action: per caller zone, one local share out of `LEVELS`; the rest is spread by `split_from_local`. A
discrete choice of the local share rather than a continuous split over zones because (a) the question that
matters is how much traffic leaves the caller's zone, and where it goes when it leaves has a good closed-form
answer (spare capacity), (b) a categorical policy over 6 levels trains quickly and stably with PPO, has a mode
to take at inference (deterministic splits) and a distribution to distil with KL, and (c) it is independent
of the number of zones. The network is shared by all caller zones (parameter sharing): each caller zone is
one agent with the same fixed-length input (`features`: its own zone, the other zones aggregated by capacity),
so one model serves 2 zones or 6 and learns from every zone's experience.

`FailoverScheduler` is what the brain runs: the student when loaded and within the feature ranges it was
trained on, else the rule, each fallback counted by reason; it reloads the model file when it changed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

LEVELS: tuple[float, ...] = (1.0, 0.9, 0.75, 0.5, 0.25, 0.0)
"""The local shares a caller zone may choose."""
SLO_MS = 200.0
"""The P99 the features and the simulator's reward are scaled by."""
QUEUE_SCALE = 8.0
"""Requests waiting per node that count as one unit in the features."""
FEATURE_CAP = 3.0
"""Scaled P99 and queue features are capped here: beyond, the zone is in trouble whatever the exact value."""
PRESSURE_CAP = 4.0
"""The demand-to-capacity features are capped here (and take it when the denominator is 0)."""
FEATURE_NAMES: tuple[str, ...] = (
    "local_alive",
    "local_weight",
    "local_p99",
    "local_queue",
    "local_capacity_share",
    "others_alive",
    "others_weight",
    "others_p99",
    "others_queue",
    "pressure",
    "others_spare",
    "last_local_share",
)
FEATURES = len(FEATURE_NAMES)
HISTORY = 10
"""Cycles the student sees (2 s at the brain's 0.2 s cycle: two agent periods, enough to see nodes go stale)."""
HIDDEN = 32
MODEL_FORMAT = 1
RANGE_MARGIN = 0.1
"""A feature may leave its trained range by this fraction of the range before the student is not trusted."""
COUNTS = (
    "student",
    "rule",
    "fallback_missing",
    "fallback_range",
    "fallback_invalid",
    "fallback_error",
    "reloads",
    "reload_errors",
)

ZoneSplit = dict[str, dict[str, float]]
"""Caller zone -> serving zone -> fraction of the caller zone's traffic (each row sums to 1)."""

_log = logging.getLogger(__name__)


class FailoverModelError(ValueError):
    """A student model file that cannot be used: unreadable, another format, or weights that do not fit."""


@dataclass(frozen=True, slots=True)
class ZoneObservation:
    """What the brain knows about one zone in one cycle."""

    zone: str
    nodes: int
    """Nodes known in the zone, including ones that stopped reporting (the brain forgets a node some minutes
    after its last vector)."""
    alive: int
    """Nodes whose last vector is at most 1.5 agent periods old."""
    weight: float
    """Mean routing weight (health × tail prediction, 0..1) of the alive nodes; 0 when none."""
    p99_ms: float
    """Highest observed/predicted P99 among alive nodes (0 when none)."""
    queue: float
    """Mean requests waiting per alive node."""
    demand: float
    """Share of the cluster's caller traffic that originates in this zone (sums to 1 over zones; equal shares
    when routers do not say)."""


class SplitPolicy(Protocol):
    """Anything that decides a zone split from this cycle's observations and the split published last cycle."""

    def split(self, zones: Sequence[ZoneObservation], previous: ZoneSplit) -> ZoneSplit: ...


def capacity(zone: ZoneObservation) -> float:
    """Healthy capacity in node units: alive nodes × their mean routing weight."""
    return zone.alive * zone.weight


def local_share(previous: ZoneSplit, caller: str) -> float:
    """The share of its own traffic `caller` kept last cycle (all of it before the first split)."""
    row = previous.get(caller)
    return 1.0 if row is None else row.get(caller, 0.0)


def _ratio(numerator: float, denominator: float, cap: float) -> float:
    """numerator / denominator capped, `cap` for a positive numerator over 0 and 0 for 0 / 0."""
    if denominator > 0:
        return min(numerator / denominator, cap)
    return cap if numerator > 0 else 0.0


def features(caller: str, zones: Sequence[ZoneObservation], local_share: float) -> np.ndarray:
    """The policy input for one caller zone, `FEATURES` long whatever the number of zones (`FEATURE_NAMES`).

    The local zone: alive / nodes, weight, P99 / SLO and queue / QUEUE_SCALE (capped), its share of the
    cluster's healthy capacity. The other zones together: alive / nodes, and weight, P99 and queue averaged
    weighted by each zone's healthy capacity (by alive nodes when none has any). Pressure: the caller's need
    (its demand share × the cluster's healthy capacity) over the local healthy capacity; others' spare: the
    other zones' healthy spare capacity (capacity less their own callers' need) over the caller's need. And
    the local share kept last cycle. One function for the simulator, the training and the brain, so the student
    sees the same numbers in all three.
    """
    total = sum(capacity(z) for z in zones)
    local: ZoneObservation | None = None
    others_nodes = others_alive = 0
    others_capacity = others_spare = 0.0
    weighted = np.zeros(3)
    by_alive = np.zeros(3)
    for zone in zones:
        if zone.zone == caller:
            local = zone
            continue
        others_nodes += zone.nodes
        others_alive += zone.alive
        cap = capacity(zone)
        others_capacity += cap
        others_spare += max(0.0, cap - zone.demand * total)
        values = (zone.weight, min(zone.p99_ms / SLO_MS, FEATURE_CAP), min(zone.queue / QUEUE_SCALE, FEATURE_CAP))
        weighted += cap * np.asarray(values)
        by_alive += zone.alive * np.asarray(values)
    if others_capacity > 0:
        others = weighted / others_capacity
    elif others_alive > 0:
        others = by_alive / others_alive
    else:
        others = np.zeros(3)
    demand = local.demand if local is not None else 0.0
    need = demand * total
    local_capacity = capacity(local) if local is not None else 0.0
    return np.array(
        [
            local.alive / local.nodes if local is not None and local.nodes > 0 else 0.0,
            local.weight if local is not None else 0.0,
            min(local.p99_ms / SLO_MS, FEATURE_CAP) if local is not None else 0.0,
            min(local.queue / QUEUE_SCALE, FEATURE_CAP) if local is not None else 0.0,
            local_capacity / total if total > 0 else 0.0,
            others_alive / others_nodes if others_nodes > 0 else 0.0,
            others[0],
            others[1],
            others[2],
            _ratio(need, local_capacity, PRESSURE_CAP),
            _ratio(others_spare, need, PRESSURE_CAP),
            local_share,
        ]
    )


def split_from_local(caller: str, local_share: float, zones: Sequence[ZoneObservation]) -> dict[str, float]:
    """A caller zone's row of the split from its local share.

    The rest goes to the other zones in proportion to their healthy spare capacity (alive × weight, less what
    their own callers need: their demand share × the cluster's healthy capacity); when none has spare, in
    proportion to healthy capacity, and when none has any, to alive nodes. A local zone without alive nodes
    keeps nothing while another zone has some; a row stays all local when no other zone can take any. Zones
    that get nothing are left out of the row.
    """
    total = sum(capacity(z) for z in zones)
    local_alive = False
    others: list[ZoneObservation] = []
    for zone in zones:
        if zone.zone == caller:
            local_alive = zone.alive > 0
        elif zone.alive > 0:
            others.append(zone)
    share = min(1.0, max(0.0, local_share)) if local_alive else 0.0
    if share >= 1.0 or not others:
        return {caller: 1.0}
    weights = [max(0.0, capacity(z) - z.demand * total) for z in others]
    if sum(weights) <= 0:
        weights = [capacity(z) for z in others]
    if sum(weights) <= 0:
        weights = [float(z.alive) for z in others]
    scale = (1.0 - share) / sum(weights)
    row = {caller: share} if share > 0 else {}
    for zone, weight in zip(others, weights, strict=True):
        if weight > 0:
            row[zone.zone] = weight * scale
    return row


class LocalFirst:
    """The rule: zone-local first, health-based failover.

    A caller zone keeps all its traffic while its zone's healthy capacity covers its need (its demand share of
    the cluster's healthy capacity), else the fraction covered; a zone without alive nodes keeps none. The rest
    by `split_from_local`. Stateless: `previous` is not used.
    """

    def split(self, zones: Sequence[ZoneObservation], previous: ZoneSplit) -> ZoneSplit:
        total = sum(capacity(z) for z in zones)
        out: ZoneSplit = {}
        for zone in zones:
            need = zone.demand * total
            cap = capacity(zone)
            out[zone.zone] = split_from_local(zone.zone, 1.0 if need <= cap else cap / need, zones)
        return out


class SpreadByCapacity:
    """What a zone-blind balancer does: every caller's traffic over all zones by their healthy capacity (by
    alive nodes when no zone has any). A baseline for the simulator, not something the brain runs."""

    def split(self, zones: Sequence[ZoneObservation], previous: ZoneSplit) -> ZoneSplit:
        weights = {z.zone: capacity(z) for z in zones if z.alive > 0}
        if sum(weights.values()) <= 0:
            weights = {z.zone: float(z.alive) for z in zones if z.alive > 0}
        total = sum(weights.values())
        if total <= 0:
            return {z.zone: {z.zone: 1.0} for z in zones}
        row = {name: weight / total for name, weight in weights.items() if weight > 0}
        return {z.zone: dict(row) for z in zones}


class FeatureHistory:
    """Each caller zone's last `length` feature vectors, oldest first; a caller's first vector fills its whole
    window (a steady past), and a caller absent from a cycle starts over when it comes back."""

    def __init__(self, length: int = HISTORY) -> None:
        self.length = length
        self._rows: dict[str, deque[np.ndarray]] = {}

    def push(self, caller: str, vector: np.ndarray) -> np.ndarray:
        """Add this cycle's vector; the window, shape (length, FEATURES)."""
        rows = self._rows.get(caller)
        if rows is None:
            rows = self._rows[caller] = deque([vector] * self.length, maxlen=self.length)
        else:
            rows.append(vector)
        return np.stack(rows)

    def retain(self, callers: Sequence[str]) -> None:
        """Forget callers not in `callers`."""
        keep = set(callers)
        for caller in [c for c in self._rows if c not in keep]:
            del self._rows[caller]

    def clear(self) -> None:
        self._rows.clear()


class StudentNetwork(nn.Module):
    """LSTM over a caller zone's feature window -> logits over LEVELS (from its last step)."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.lstm = nn.LSTM(FEATURES, hidden, batch_first=True)
        self.head = nn.Linear(hidden, len(LEVELS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, steps, FEATURES) -> (batch, len(LEVELS)) logits."""
        out, _ = self.lstm(x)
        logits: torch.Tensor = self.head(out[:, -1, :])
        return logits


def save_student(path: Path, network: StudentNetwork, ranges: np.ndarray) -> None:
    """Write a student model file: the state dict, the format version, LEVELS, FEATURES, HISTORY, the hidden
    size and the feature ranges seen in training ((2, FEATURES): low, high), to a temporary file then renamed,
    so a scheduler reloading it never reads half a file."""
    if ranges.shape != (2, FEATURES):
        raise ValueError(f"feature ranges must be (2, {FEATURES}), got {ranges.shape}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(
                {
                    "format": MODEL_FORMAT,
                    "levels": list(LEVELS),
                    "features": FEATURES,
                    "feature_names": list(FEATURE_NAMES),
                    "history": HISTORY,
                    "hidden": network.lstm.hidden_size,
                    "ranges": ranges.astype(float).tolist(),
                    "state": network.state_dict(),
                },
                f,
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class _Logits:
    """The student network's forward pass in numpy, from its weights: for 3 callers × 10 steps, torch's LSTM
    call costs about 200 µs of dispatch on one thread (and ms when its thread pool competes with the brain's
    other work), these few small matrix products about 130 µs on a loaded core, with no thread pool."""

    def __init__(self, network: StudentNetwork) -> None:
        state = {name: value.detach().double().numpy() for name, value in network.state_dict().items()}
        hidden = network.lstm.hidden_size
        self._hidden = hidden
        cell = slice(2 * hidden, 3 * hidden)
        # The cell candidate's tanh(x) is 2σ(2x) - 1: doubled here, one sigmoid covers all four gates.
        self._w_input = state["lstm.weight_ih_l0"].T.copy()
        self._w_hidden = state["lstm.weight_hh_l0"].T.copy()
        self._bias = state["lstm.bias_ih_l0"] + state["lstm.bias_hh_l0"]
        for array in (self._w_input, self._w_hidden):
            array[:, cell] *= 2
        self._bias[cell] *= 2
        self._w_out = state["head.weight"].T.copy()
        self._b_out = state["head.bias"]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """(batch, steps, FEATURES) -> (batch, len(LEVELS))."""
        n = self._hidden
        pre = x @ self._w_input + self._bias
        h = np.zeros((x.shape[0], n))
        c = np.zeros((x.shape[0], n))
        for step in range(x.shape[1]):
            s = pre[:, step] + h @ self._w_hidden
            s = 1.0 / (1.0 + np.exp(-s))
            c = s[:, n : 2 * n] * c + s[:, :n] * (2.0 * s[:, 2 * n : 3 * n] - 1.0)
            h = s[:, 3 * n :] * np.tanh(c)
        out: np.ndarray = h @ self._w_out + self._b_out
        return out


class StudentPolicy:
    """The distilled LSTM student: keeps each caller zone's last HISTORY feature vectors and takes the most
    likely level (the mode: no sampling, the same inputs give the same split).

    `in_range` says whether the last `split`'s features were all within the ranges seen in training (widened
    by RANGE_MARGIN); `FailoverScheduler` uses the rule when they were not.
    """

    def __init__(self, network: StudentNetwork, ranges: np.ndarray) -> None:
        self.network = network.eval()
        self.logits = _Logits(network)
        spread = ranges[1] - ranges[0]
        self._low = ranges[0] - RANGE_MARGIN * spread - 1e-6
        self._high = ranges[1] + RANGE_MARGIN * spread + 1e-6
        self._history = FeatureHistory(HISTORY)
        self.in_range = True

    @classmethod
    def load(cls, path: Path) -> StudentPolicy:
        """Read a file written by `save_student`; FailoverModelError when it cannot be used."""
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:
            raise FailoverModelError(f"{path}: not readable as a student model: {exc}") from exc
        if not isinstance(state, dict) or state.get("format") != MODEL_FORMAT:
            raise FailoverModelError(f"{path}: not a failover student model of format {MODEL_FORMAT}")
        expected = {"levels": list(LEVELS), "features": FEATURES, "history": HISTORY}
        for key, value in expected.items():
            if state.get(key) != value:
                raise FailoverModelError(f"{path}: {key} {state.get(key)!r}, this version uses {value!r}")
        try:
            hidden = int(state["hidden"])
            ranges = np.asarray(state["ranges"], dtype=float)
            network = StudentNetwork(hidden)
            network.load_state_dict(state["state"])
        except Exception as exc:
            raise FailoverModelError(f"{path}: weights do not fit a student network: {exc}") from exc
        if ranges.shape != (2, FEATURES) or not np.isfinite(ranges).all():
            raise FailoverModelError(f"{path}: feature ranges must be finite, (2, {FEATURES})")
        if not all(torch.isfinite(p).all() for p in network.parameters()):
            raise FailoverModelError(f"{path}: non-finite weights")
        return cls(network, ranges)

    def reset(self) -> None:
        """Forget every caller's history (a new episode in the simulator)."""
        self._history.clear()

    def split(self, zones: Sequence[ZoneObservation], previous: ZoneSplit) -> ZoneSplit:
        callers = [z.zone for z in zones]
        self._history.retain(callers)
        windows = []
        in_range = True
        for caller in callers:
            x = features(caller, zones, local_share(previous, caller))
            in_range = in_range and bool(((x >= self._low) & (x <= self._high)).all())
            windows.append(self._history.push(caller, x))
        self.in_range = in_range
        if not callers:
            return {}
        choice = self.logits(np.stack(windows)).argmax(axis=1).tolist()
        return {caller: split_from_local(caller, LEVELS[i], zones) for caller, i in zip(callers, choice, strict=True)}


def _valid(zones: Sequence[ZoneObservation]) -> bool:
    """Observations the student may see: a list or tuple of them with distinct non-empty names, counts that are
    non-negative integers with alive <= nodes, finite non-negative numbers and a weight within 0..1."""
    if not isinstance(zones, list | tuple):
        return False
    names = set()
    for z in zones:
        if not isinstance(z, ZoneObservation) or not isinstance(z.zone, str) or not z.zone or z.zone in names:
            return False
        names.add(z.zone)
        if not (isinstance(z.nodes, int) and isinstance(z.alive, int) and 0 <= z.alive <= z.nodes):
            return False
        numbers = (z.weight, z.p99_ms, z.queue, z.demand)
        if not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in numbers) or z.weight > 1:
            return False
    return True


def _clean_number(value: object, high: float = math.inf) -> float:
    if isinstance(value, int | float) and math.isfinite(value) and value > 0:
        return min(float(value), high)
    return 0.0


def _sanitised(zones: Sequence[object]) -> list[ZoneObservation]:
    """Observations the rule can use from invalid ones: entries that are not observations or repeat a name are
    dropped, bad numbers read as 0 (a zone with a bad weight gets no traffic), alive is at most nodes."""
    out: list[ZoneObservation] = []
    names = set()
    for z in zones if isinstance(zones, list | tuple) else ():
        if not isinstance(z, ZoneObservation) or not isinstance(z.zone, str) or not z.zone or z.zone in names:
            continue
        names.add(z.zone)
        nodes = int(_clean_number(z.nodes)) if not isinstance(z.nodes, bool) else 0
        alive = min(int(_clean_number(z.alive)) if not isinstance(z.alive, bool) else 0, nodes)
        out.append(
            replace(
                z,
                nodes=nodes,
                alive=alive,
                weight=_clean_number(z.weight, 1.0),
                p99_ms=_clean_number(z.p99_ms),
                queue=_clean_number(z.queue),
                demand=_clean_number(z.demand),
            )
        )
    return out


class FailoverScheduler:
    """What the brain runs each cycle: the student when it is loaded and its inputs are in the range it was
    trained on, else LocalFirst, each fallback counted by reason (`counts`).

    The model file is checked every `reload_s` (the design's 10 minutes: a model is retrained offline, so a
    slow check costs nothing) and reloaded when its mtime, size or inode changed: loaded into a new
    StudentPolicy, then one reference swapped, so a split never sees half a model; a file that does not load
    keeps the running student and counts `reload_errors` (also at start, where the rule runs until a good
    file comes). A missing file is not an error: the rule runs (`fallback_missing`) until one appears.
    `split` never raises: invalid observations are counted (`fallback_invalid`) and the rule decides on their
    sanitised form; a student that raises is counted (`fallback_error`).
    """

    def __init__(self, model_path: Path | None = None, reload_s: float = 600.0) -> None:
        self.model_path = model_path
        self.reload_s = reload_s
        self.counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self._rule = LocalFirst()
        self._student: StudentPolicy | None = None
        self._stamp: tuple[int, int, int] | None = None
        self._checked_at: float | None = None
        self._previous: ZoneSplit = {}
        self._source = "rule"
        self._check_model(initial=True)

    @property
    def source(self) -> str:
        """Who decided the last split: "student" or "rule"."""
        return self._source

    @property
    def student(self) -> StudentPolicy | None:
        return self._student

    def split(self, zones: Sequence[ZoneObservation], now: float) -> ZoneSplit:
        """This cycle's split; `now` in monotonic seconds (the reload schedule's clock)."""
        if self._checked_at is None:
            self._checked_at = now
        elif now - self._checked_at >= self.reload_s:
            self._checked_at = now
            self._check_model(initial=False)
        decided: ZoneSplit | None = None
        reason = ""
        if not _valid(zones):
            reason = "fallback_invalid"
            zones = _sanitised(zones)
        elif self._student is None:
            reason = "fallback_missing"
        else:
            try:
                decided = self._student.split(zones, self._previous)
                if not self._student.in_range:
                    decided, reason = None, "fallback_range"
            except Exception:
                _log.exception("failover student failed; the rule decides this cycle")
                decided, reason = None, "fallback_error"
        if decided is None:
            self.counts[reason] += 1
            self.counts["rule"] += 1
            self._source = "rule"
            decided = self._rule.split(zones, self._previous)
        else:
            self.counts["student"] += 1
            self._source = "student"
        self._previous = decided
        return decided

    def _check_model(self, initial: bool) -> None:
        """Load the model file if it changed since the last check; a load after the start counts `reloads`."""
        if self.model_path is None:
            return
        try:
            stat = self.model_path.stat()
        except FileNotFoundError:
            return
        except OSError as exc:
            self.counts["reload_errors"] += 1
            _log.warning("failover model %s not readable: %s", self.model_path, exc)
            return
        stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            student = StudentPolicy.load(self.model_path)
        except FailoverModelError as exc:
            self.counts["reload_errors"] += 1
            _log.warning(
                "failover model not loaded, %s: %s", "keeping the running one" if self._student else "rule", exc
            )
            return
        if not initial:
            self.counts["reloads"] += 1
        self._student = student
        _log.info("failover student loaded from %s", self.model_path)
