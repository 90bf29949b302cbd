"""Next-window P99 latency per (node, slice) series: the design's LSTM-Attention model, trained online,
beside baselines.

A node has one series per latency entry it reports (`_features.series_p99_ms`: each slice's own, and the
engine's), each with its own history: its target and latency feature are that entry's P99, its other 7 features
the node's, shared by all its series. A series starts at its first observed P99 and gets a row every window of
its node from then on (its P99 None in a window without requests); one without an observed P99 in any of its
`history` kept windows (a slice the node no longer serves) is dropped, so a node never holds more series than
entries it reported with a value in that many windows, and nothing is kept that training or evaluation could
use no more. One model serves all series: it trains on samples from every series and infers them in one batch,
since a latency follows its node's queue and cache the same way whatever the slice.

Four predictors see the same windows: the last observed P99 (`last_value`), an exponentially weighted moving
average of it (`ewma`), two stacked LSTM layers alone (`lstm`) and the design's model (`lstm_attention`).
Each series' most recent `holdout` windows are never trained on; `evaluate()` scores all four on them, over all
series, and `best()` names the one with the lowest MAE there. A model must beat EWMA to be used: with too few
held-out samples, before training, or when it is worse, the choice is EWMA.

Thread use: `observe`, `predict` and `evaluate` may run on the brain loop while `train_step` runs in a
background thread. Training works on its own copies of the models and publishes them by swapping one
reference, so inference never sees half-updated weights and never waits for a training step.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from prismlb.wire import NodeVector

from ._features import (
    FEATURES,
    NODE_FEATURES,
    feature_to_latency,
    latency_feature,
    latency_to_feature,
    node_features,
    series_p99_ms,
)

PREDICTORS = ("last_value", "ewma", "lstm", "lstm_attention")
MODELS = ("lstm", "lstm_attention")
_CHECKPOINT_FORMAT = 1


class LstmAttention(nn.Module):
    """The design's model: 2 stacked LSTM layers → multi-head scaled dot-product self-attention → linear.

    The attention's query is the last step's LSTM output and its keys and values are all steps (the last
    position of self-attention over the window), added back to that output before the linear head.
    """

    def __init__(self, features: int = len(FEATURES), hidden: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, layers, batch_first=True)
        self.attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, steps, features) → (batch,) predicted next-window P99 as a latency feature."""
        h, _ = self.lstm(x)
        last = h[:, -1:, :]
        attended, _ = self.attention(last, h, h, need_weights=False)
        out: torch.Tensor = self.head(last + attended)
        return out[:, 0, 0]


class Lstm(nn.Module):
    """The same LSTM without attention: the last step's output → linear."""

    def __init__(self, features: int = len(FEATURES), hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x)
        out: torch.Tensor = self.head(h[:, -1, :])
        return out[:, 0]


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    steps: int = 16  # windows per input sequence; a series with fewer gets no prediction
    history: int = 512  # windows kept per series; one without an observed P99 in all of them is dropped
    holdout: int = 16  # each series' most recent targets: never trained on, scored by evaluate()
    ewma_alpha: float = 0.5
    batch_size: int = 256
    learning_rate: float = 3e-4
    average_decay: float = 0.99  # inference uses an exponential moving average of the trained weights
    min_evaluation_samples: int = 32  # fewer held-out samples: EWMA is used
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Score:
    mae_ms: float
    p99_abs_error_ms: float


@dataclass(frozen=True, slots=True)
class Evaluation:
    """All four predictors scored on the same held-out windows; `best` is the one the weights should use."""

    samples: int
    scores: dict[str, Score]
    best: str

    def ratio_to_ewma(self, predictor: str) -> float:
        """MAE of `predictor` over EWMA's MAE."""
        return self.scores[predictor].mae_ms / self.scores["ewma"].mae_ms


_Snapshot = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # feature rows, P99 ms, trainable target indices
_P99, _LAST, _EWMA = len(FEATURES), len(FEATURES) + 1, len(FEATURES) + 2  # columns after the features


class _History:
    """One series' last `capacity` windows, one row each: the features (the node's, then the series' latency),
    the observed P99 and the last-value and EWMA forecasts of it made before it was seen (NaN where there is
    none); `idle` counts the windows since its last observed P99.

    The buffer holds twice the capacity and is compacted when full, so the recent windows are always one
    contiguous slice.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.data = torch.full((2 * capacity, len(FEATURES) + 3), math.nan, dtype=torch.float64)
        self.start = 0
        self.end = 0
        self.latency = 0.0  # the latest latency feature, carried forward through windows without requests
        self.idle = 0
        self.last_ms: float | None = None
        self.ewma_ms: float | None = None

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, node_row: Sequence[float], p99_ms: float | None, alpha: float) -> None:
        """One window: the node's features (absent values already filled) and the series' P99 (None: none)."""
        if self.end == len(self.data):
            size = len(self)
            self.data[:size] = self.data[self.start : self.end].clone()
            self.start, self.end = 0, size
        if p99_ms is None:
            self.idle += 1
        else:
            self.latency, self.idle = latency_feature(p99_ms), 0
        self.data[self.end] = torch.tensor(
            (
                *node_row,
                self.latency,
                math.nan if p99_ms is None else p99_ms,
                math.nan if self.last_ms is None else self.last_ms,
                math.nan if self.ewma_ms is None else self.ewma_ms,
            ),
            dtype=torch.float64,
        )
        if p99_ms is not None:
            self.last_ms = p99_ms
            self.ewma_ms = p99_ms if self.ewma_ms is None else alpha * p99_ms + (1.0 - alpha) * self.ewma_ms
        self.end += 1
        if len(self) > self.capacity:
            self.start += 1

    def windows(self, stops: list[int], steps: int) -> torch.Tensor:
        """(len(stops), steps, features) copy: the `steps` feature rows before each buffer position in `stops`."""
        return self.data[torch.tensor(stops)[:, None] + torch.arange(-steps, 0), :_P99]

    def targets(self, first: int, stop: int, steps: int, forecasts: bool = False) -> list[int]:
        """Buffer positions in [start + first, start + stop) with an observed P99 and `steps` rows before,
        and with both baseline forecasts if `forecasts`."""
        lo = self.start + max(first, steps)
        hi = self.start + stop
        if hi <= lo:
            return []
        columns = [_P99, _LAST, _EWMA] if forecasts else [_P99]
        usable = ~torch.isnan(self.data[lo:hi, columns]).any(dim=1)
        return (torch.nonzero(usable)[:, 0] + lo).tolist()


class _Node:
    """One node's series by latency key, and its latest node-feature row (absent values filled), which they share."""

    def __init__(self) -> None:
        self.features: tuple[float, ...] = (0.0,) * len(NODE_FEATURES)
        self.series: dict[str, _History] = {}


class Predictor:
    """Per-series history, the four predictors, online training, evaluation and checkpoints."""

    def __init__(self, config: PredictorConfig = PredictorConfig()) -> None:
        if config.history <= config.steps + config.holdout:
            raise ValueError("history must be longer than steps + holdout")
        self.config = config
        self.trained_steps = 0
        self._nodes: dict[str, _Node] = {}
        self._lock = threading.Lock()  # nodes and their series, serving models, evaluation
        self._training_lock = threading.Lock()  # training models and optimisers
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self._training: dict[str, nn.Module] = {"lstm": Lstm(), "lstm_attention": LstmAttention()}
        self._averaged = {name: copy.deepcopy(model).requires_grad_(False) for name, model in self._training.items()}
        self._optimizers = {
            name: torch.optim.Adam(model.parameters(), lr=config.learning_rate)
            for name, model in self._training.items()
        }
        self._sampler = torch.Generator().manual_seed(config.seed)
        self._serving = self._publishable()
        self._evaluation: Evaluation | None = None
        self._evaluation_cpu_s = 0.0
        self._best = "ewma"

    def observe(self, node_id: str, features_row: Sequence[float], p99_ms: Mapping[str, float | None]) -> None:
        """Append one window of a node: its features (`node_features`, NaN = absent) and each series' P99.

        `p99_ms` is this window's P99 by series key (`series_p99_ms`, None without requests); each is the target
        for its series' sequence that ended one window earlier. A key with a P99 and no series yet starts one;
        a series missing from `p99_ms` gets the window as one without requests. History is bounded to
        `config.history` windows per series, and a series without an observed P99 in all of them is dropped.
        """
        if len(features_row) != len(NODE_FEATURES):
            raise ValueError(f"expected {len(NODE_FEATURES)} features, got {len(features_row)}")
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                node = self._nodes[node_id] = _Node()
            node.features = tuple(p if math.isnan(v) else v for v, p in zip(features_row, node.features, strict=True))
            for key, p99 in p99_ms.items():
                if p99 is not None and key not in node.series:
                    node.series[key] = _History(self.config.history)
            for key, history in list(node.series.items()):
                history.append(node.features, p99_ms.get(key), self.config.ewma_alpha)
                if history.idle >= self.config.history:
                    del node.series[key]

    def observe_vector(self, vector: NodeVector) -> None:
        """`observe` a node vector's features and series."""
        self.observe(vector.node_id, node_features(vector), series_p99_ms(vector))

    def forget(self, node_id: str) -> None:
        """Drop a node and all its series (it left the cluster)."""
        with self._lock:
            self._nodes.pop(node_id, None)

    def history_lengths(self, node_id: str) -> dict[str, int]:
        """Windows kept per series of the node; empty for a node without any."""
        with self._lock:
            node = self._nodes.get(node_id)
            return {} if node is None else {key: len(history) for key, history in node.series.items()}

    def best(self) -> str:
        """The predictor the weights should use: the last evaluation's lowest MAE, EWMA unless a model beat it."""
        return self._best

    @property
    def evaluation(self) -> Evaluation | None:
        return self._evaluation

    def predict(self, node_ids: Iterable[str], predictor: str | None = None) -> dict[str, dict[str, float | None]]:
        """Next-window P99 in ms per node and series key from `predictor` (default `best()`), one batched inference
        for all series of all the nodes.

        Every node asked for maps to all its series (none for an unknown node). A series with fewer than
        `config.steps` windows, too short for the models' input, has its EWMA, whichever predictor: a node that
        has just joined would otherwise be weighed by its raw P99 of a window or two, the noisiest figure there is
        (in the replay the first 16 windows were a tenth to two thirds of a run; with the EWMA there TTFT p99 fell
        2-3% at 50, 80 and 95% load and goodput held, docs/eval.md).
        """
        name = predictor or self._best
        if name not in PREDICTORS:
            raise ValueError(f"unknown predictor {name!r}; one of {', '.join(PREDICTORS)}")
        steps = self.config.steps
        result: dict[str, dict[str, float | None]] = {}
        ready: list[tuple[str, str]] = []
        windows: list[torch.Tensor] = []
        with self._lock:
            for node_id in node_ids:
                node = self._nodes.get(node_id)
                forecasts = result[node_id] = {}
                for key, history in node.series.items() if node is not None else ():
                    if len(history) < steps:
                        forecasts[key] = history.ewma_ms
                    elif name == "last_value":
                        forecasts[key] = history.last_ms
                    elif name == "ewma":
                        forecasts[key] = history.ewma_ms
                    else:
                        forecasts[key] = None  # filled in by the batch below, keeping the series' order
                        ready.append((node_id, key))
                        windows.append(history.data[history.end - steps : history.end, :_P99])
            batch = torch.stack(windows).float() if windows else None
            model = self._serving[name] if name in MODELS else None
        if batch is not None and model is not None:
            with torch.inference_mode():
                predicted = feature_to_latency(model(batch).double())
            for (node_id, key), value in zip(ready, predicted.tolist(), strict=True):
                result[node_id][key] = value
        return result

    def train_step(self, budget_s: float, max_steps: int | None = None) -> int:
        """Train both models on minibatches of every series' non-held-out windows, publish them and re-evaluate, so
        `best()` follows; all within `budget_s` seconds of this thread's CPU time (training stops early by the
        previous evaluation's cost) or after `max_steps` steps, whichever ends first.

        Runs in the calling thread with one torch thread (`torch.set_num_threads(1)`, process-wide). Returns
        the number of optimiser steps; 0 when no window can be trained on yet.
        """
        torch.set_num_threads(1)
        started = time.thread_time()
        training_s = budget_s - self._evaluation_cpu_s
        snapshot = self._training_snapshot()
        done = 0
        with self._training_lock:
            if snapshot[2].numel():
                done = self._train(snapshot, started, training_s, max_steps)
                serving = self._publishable()
                with self._lock:
                    self._serving = serving
        self.evaluate()
        return done

    def _train(self, snapshot: _Snapshot, started: float, training_s: float, max_steps: int | None) -> int:
        """Minibatch steps until this thread has used `training_s` CPU seconds since `started`, or `max_steps`."""
        rows, targets, ends = snapshot
        offsets = torch.arange(-self.config.steps, 0)
        done = 0
        while (max_steps is None or done < max_steps) and time.thread_time() - started < training_s:
            pick = ends[torch.randint(len(ends), (self.config.batch_size,), generator=self._sampler)]
            x = rows[pick[:, None] + offsets]
            y = latency_to_feature(targets[pick]).float()
            for name, model in self._training.items():
                optimizer = self._optimizers[name]
                optimizer.zero_grad(set_to_none=True)
                torch.autograd.backward(nn.functional.l1_loss(model(x), y))
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                self._average(name)
            self.trained_steps += 1
            done += 1
        return done

    def evaluate(self) -> Evaluation:
        """Score all four predictors on every series' held-out windows (the same windows for each)."""
        started = time.thread_time()
        steps, holdout = self.config.steps, self.config.holdout
        windows: list[torch.Tensor] = []
        truth: list[torch.Tensor] = []
        baselines: list[torch.Tensor] = []
        with self._lock:
            for history in self._series():
                positions = history.targets(len(history) - holdout, len(history), steps, forecasts=True)
                if positions:
                    windows.append(history.windows(positions, steps))
                truth.append(history.data[positions, _P99])
                baselines.append(history.data[positions, _LAST:])
            serving = self._serving
        predictions: dict[str, torch.Tensor] = {}
        if windows:
            batch = torch.cat(windows).float()
            base = torch.cat(baselines)
            predictions["last_value"], predictions["ewma"] = base[:, 0], base[:, 1]
            with torch.inference_mode():
                for name in MODELS:
                    predictions[name] = feature_to_latency(serving[name](batch).double())
        actual = torch.cat(truth) if windows else torch.empty(0, dtype=torch.float64)
        scores = {name: _score(predictions.get(name), actual) for name in PREDICTORS}
        best = "ewma"
        if len(actual) >= self.config.min_evaluation_samples:
            best = min(("ewma", "last_value", *MODELS), key=lambda name: scores[name].mae_ms)
        evaluation = Evaluation(len(actual), scores, best)
        with self._lock:
            self._evaluation, self._best = evaluation, best
        self._evaluation_cpu_s = time.thread_time() - started
        return evaluation

    def checkpoint(self, path: Path) -> None:
        """Write models, optimiser and sampler state and the current choice atomically (temporary file, fsync,
        rename).

        Waits for a running `train_step` to finish, so the models are saved between steps.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f, self._training_lock:
                torch.save(
                    {
                        "format": _CHECKPOINT_FORMAT,
                        "config": asdict(self.config),
                        "features": list(FEATURES),
                        "trained_steps": self.trained_steps,
                        "best": self._best,
                        "models": {name: model.state_dict() for name, model in self._training.items()},
                        "averaged": {name: model.state_dict() for name, model in self._averaged.items()},
                        "optimizers": {name: optimizer.state_dict() for name, optimizer in self._optimizers.items()},
                        "sampler": self._sampler.get_state(),
                    },
                    f,
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def load(self, path: Path) -> None:
        """Restore a checkpoint written by `checkpoint`; histories are not in it (the brain keeps them)."""
        state = torch.load(path, weights_only=True)
        if state.get("format") != _CHECKPOINT_FORMAT or state.get("features") != list(FEATURES):
            raise ValueError(f"{path}: not a predictor checkpoint of this version")
        if state["config"]["steps"] != self.config.steps:
            raise ValueError(f"{path}: trained on {state['config']['steps']} steps, configured {self.config.steps}")
        with self._training_lock:
            for name, model in self._training.items():
                model.load_state_dict(state["models"][name])
                self._averaged[name].load_state_dict(state["averaged"][name])
                self._optimizers[name].load_state_dict(state["optimizers"][name])
            self._sampler.set_state(state["sampler"])
            self.trained_steps = state["trained_steps"]
            serving = self._publishable()
        with self._lock:
            self._serving, self._best, self._evaluation = serving, state["best"], None

    def _average(self, name: str) -> None:
        """Move the averaged weights towards the trained ones (decay warmed up over the first steps)."""
        decay = min(self.config.average_decay, (1.0 + self.trained_steps) / (10.0 + self.trained_steps))
        pairs = zip(self._averaged[name].parameters(), self._training[name].parameters(), strict=True)
        with torch.no_grad():
            for averaged, trained in pairs:
                averaged.lerp_(trained, 1.0 - decay)

    def _publishable(self) -> dict[str, nn.Module]:
        """Frozen copies of the averaged models, for inference."""
        return {name: copy.deepcopy(model).eval() for name, model in self._averaged.items()}

    def _series(self) -> list[_History]:
        """Every node's series; the caller holds `_lock`."""
        return [history for node in self._nodes.values() for history in node.series.values()]

    def _training_snapshot(self) -> _Snapshot:
        """All series' rows and P99 concatenated, and the flat indices of trainable targets (not held out)."""
        rows: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        ends: list[int] = []
        offset = 0
        with self._lock:
            for history in self._series():
                usable = len(history) - self.config.holdout
                if usable <= 0:
                    continue
                ends.extend(p - history.start + offset for p in history.targets(0, usable, self.config.steps))
                rows.append(history.data[history.start : history.start + usable, :_P99].float())
                targets.append(history.data[history.start : history.start + usable, _P99].clone())
                offset += usable
        if not rows:
            return torch.empty(0, len(FEATURES)), torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.long)
        return torch.cat(rows), torch.cat(targets), torch.tensor(ends, dtype=torch.long)


def _score(predicted: torch.Tensor | None, actual: torch.Tensor) -> Score:
    if predicted is None or not len(actual):
        return Score(math.nan, math.nan)
    errors = (predicted - actual).abs()
    return Score(errors.mean().item(), torch.quantile(errors, 0.99).item())
