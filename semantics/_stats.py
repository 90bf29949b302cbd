"""The one quantile of the project: what the agent reports as a P99 is what the replay's agent reports, the
benches print and the brain's trace replay reads."""

from __future__ import annotations

import math
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float, *, ordered: bool = False) -> float:
    """The `q` quantile (0..1) of `values` by linear interpolation between the closest ranks (numpy's default,
    Prometheus' `histogram_quantile` within a bucket); NaN for no values. `ordered`: `values` are sorted already
    (a caller taking several quantiles of one sample sorts it once)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile is within 0..1, got {q}")
    if not values:
        return math.nan
    data = values if ordered else sorted(values)
    position = q * (len(data) - 1)
    low = math.floor(position)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (position - low)
