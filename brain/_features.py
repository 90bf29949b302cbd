"""The predictor's series and its 8 features per time step: 7 from a node vector, shared by the node's series, and
the series' own latency; their normalisation; and the latency target.

A series is one latency entry of a node's vectors (`series_p99_ms`): each slice's own entry (`"llm"`, `"vlm"`,
`"av"`, `"rag"`, from the spans the agent saw) and the engine's `"engine"` entry (all of the engine's requests,
whatever their slice). Its target is that entry's P99 time to first token, in ms, of the requests that finished
their first token in a window, None in a window without one: TTFT is what a slice's latency tolerance τ0 is
defined on, and a slice is weighed against its own tolerance, so a node serving images and audio must not get
its audio weight (τ0 250 ms) from its image latency. A slice's forecast is its own series' while the node has
one, else the engine series' (`slice_predictions`): a node whose spans carry no slice (an engine source alone)
has the one engine series, whose forecast stands for every slice it serves, as its engine-wide P99 does for the
weights' observed fallback.

Features, each scaled to about [0, 1] by a fixed transform (no fitted statistics, so online training and
checkpoints never depend on a data-dependent scaler):

| # | feature | from | transform |
|---|---|---|---|
| 0 | host CPU | `cpu_util_ratio` | as is |
| 1 | GPU busy | `gpu_util_ratio` | as is |
| 2 | KV-cache usage | `kv_cache_usage_ratio` | as is |
| 3 | KV-cache (prefix) miss | `kv_cache_miss_ratio` | as is |
| 4 | running requests | `requests_running` | log1p(x) / 4 |
| 5 | waiting requests (queue) | `requests_waiting` | log1p(x) / 4 |
| 6 | arrival rate | `requests_per_s` | log1p(x) / 4 |
| 7 | this window's P99 TTFT of the series | `series_p99_ms(vector)[key]` | log1p(ms) / 10 |

Features 0–6 (`node_features`) are the node's: the engine's queue, cache and GPU are what every slice it serves
waits on. Host memory is left out: an inference server's host memory barely moves with load, while GPU busy
time does.

An absent metric (not measured, so absent on the wire) is NaN here; `Predictor.observe` fills it with the
node's previous value of that feature, or 0 when the node never reported it, and a series' latency in a window
without requests with the series' previous one. Carrying the last value forward matches how the agent treats a
source between its own periods, and a dimension a node never reports stays a constant 0 that the model learns
to ignore. The predictor learns to predict a series' next-window value from the sequence of its feature rows up
to the current window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from prismlb.semantics import ENGINE_LATENCY_KEY, Slice
from prismlb.wire import NodeVector

NODE_FEATURES = (
    "cpu_util",
    "gpu_util",
    "kv_cache_usage",
    "kv_cache_miss",
    "requests_running",
    "requests_waiting",
    "requests_per_s",
)
FEATURES = (*NODE_FEATURES, "p99_ttft")
SERIES_KEYS = frozenset({*(s.value for s in Slice), ENGINE_LATENCY_KEY})
"""The latency entries that are series: the weights read no other (a vector may carry at most 16 entries)."""
COUNT_SCALE = 4.0  # log1p(53) ≈ 4: 53 running or waiting requests, or 53 requests/s, map to 1
LATENCY_SCALE = 10.0  # log1p(22,000 ms) ≈ 10
MAX_LATENCY_FEATURE = 1.3  # predictions are clamped to [0 ms, expm1(13) ms ≈ 7.4 min]


def series_p99_ms(vector: NodeVector) -> dict[str, float | None]:
    """This window's P99 TTFT in ms per series of the node, keyed as its latency entries; None for an entry
    without one."""
    return {key: entry.ttft_p99_ms for key, entry in vector.latency.items() if key in SERIES_KEYS}


def slice_predictions(forecasts: Mapping[str, float | None]) -> dict[Slice, float]:
    """Each slice's forecast from a node's series forecasts (None: the series has none): its own series' while the
    node has that series, else the engine series'. A slice whose own series has no forecast is absent, so the
    weights take its observed P99 rather than the engine's forecast of the node's other slices."""
    engine = forecasts.get(ENGINE_LATENCY_KEY)
    chosen = {s: forecasts[s.value] if s.value in forecasts else engine for s in Slice}
    return {s: value for s, value in chosen.items() if value is not None}


def latency_feature(ms: float) -> float:
    """A P99 in ms as feature 7 (`latency_to_feature` of one value)."""
    return math.log1p(ms) / LATENCY_SCALE


def latency_to_feature(ms: torch.Tensor) -> torch.Tensor:
    return torch.log1p(ms) / LATENCY_SCALE


def feature_to_latency(value: torch.Tensor) -> torch.Tensor:
    """Inverse of `latency_to_feature`, clamped to [0, MAX_LATENCY_FEATURE] first."""
    return torch.expm1(value.clamp(0.0, MAX_LATENCY_FEATURE) * LATENCY_SCALE)


def _count(value: float | None) -> float:
    return math.nan if value is None else math.log1p(value) / COUNT_SCALE


def _ratio(value: float | None) -> float:
    return math.nan if value is None else value


def node_features(vector: NodeVector) -> tuple[float, ...]:
    """The vector's 7 normalised node features (`NODE_FEATURES`); NaN marks an absent metric."""
    m = vector.metrics
    return (
        _ratio(m.cpu_util_ratio),
        _ratio(m.gpu_util_ratio),
        _ratio(m.kv_cache_usage_ratio),
        _ratio(m.kv_cache_miss_ratio),
        _count(m.requests_running),
        _count(m.requests_waiting),
        _count(m.requests_per_s),
    )
