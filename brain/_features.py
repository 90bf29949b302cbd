"""The predictor's 8 features per time step from a node vector, their normalisation, and its latency target.

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
| 7 | this window's P99 TTFT | `observed_p99_ms(vector)` | log1p(ms) / 10 |

Host memory is left out: an inference server's host memory barely moves with load, while GPU busy time does.

An absent metric (not measured, so absent on the wire) is NaN here; `Predictor.observe` fills it with the
node's previous value of that feature, or 0 when the node never reported it. Carrying the last value forward
matches how the agent treats a source between its own periods, and a dimension a node never reports stays
a constant 0 that the model learns to ignore.

The target is the P99 time to first token, in ms, of the requests that finished their first token in a
window: the largest `ttft_p99_ms` over the vector's latency entries (the per-slice entries from spans and the
engine's "engine" entry), None when no entry has one. TTFT is what the slices' latency tolerance τ0 is
defined on, and the largest over slices is the node's worst tail. The predictor learns to predict the next
window's value from the sequence of feature rows up to the current window.
"""

from __future__ import annotations

import math

import torch

from prismlb.wire import NodeVector

FEATURES = (
    "cpu_util",
    "gpu_util",
    "kv_cache_usage",
    "kv_cache_miss",
    "requests_running",
    "requests_waiting",
    "requests_per_s",
    "p99_ttft",
)
COUNT_SCALE = 4.0  # log1p(53) ≈ 4: 53 running or waiting requests, or 53 requests/s, map to 1
LATENCY_SCALE = 10.0  # log1p(22,000 ms) ≈ 10
MAX_LATENCY_FEATURE = 1.3  # predictions are clamped to [0 ms, expm1(13) ms ≈ 7.4 min]


def observed_p99_ms(vector: NodeVector) -> float | None:
    """The window's P99 TTFT in ms: the largest over the vector's latency entries."""
    values = [entry.ttft_p99_ms for entry in vector.latency.values() if entry.ttft_p99_ms is not None]
    return max(values) if values else None


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
    """The vector's 8 normalised features; NaN marks an absent metric."""
    m = vector.metrics
    p99 = observed_p99_ms(vector)
    return (
        _ratio(m.cpu_util_ratio),
        _ratio(m.gpu_util_ratio),
        _ratio(m.kv_cache_usage_ratio),
        _ratio(m.kv_cache_miss_ratio),
        _count(m.requests_running),
        _count(m.requests_waiting),
        _count(m.requests_per_s),
        math.nan if p99 is None else math.log1p(p99) / LATENCY_SCALE,
    )
