"""The project's one quantile (prismlb.semantics.quantile)."""

from __future__ import annotations

import math

import pytest

from prismlb.semantics import quantile


def test_quantile_interpolates_between_closest_ranks() -> None:
    assert quantile([10.0], 0.99) == 10.0
    assert quantile([10.0, 0.0], 0.5) == 5.0, "unsorted input is sorted"
    assert quantile([float(i) for i in range(101)], 0.95) == pytest.approx(95.0)
    assert quantile([0.0, 100.0], 0.99) == pytest.approx(99.0), "not the nearest rank (100)"
    assert quantile([1.0, 2.0, 4.0], 0.75, ordered=True) == pytest.approx(3.0)


def test_quantile_of_nothing_is_nan_and_q_is_checked() -> None:
    assert math.isnan(quantile([], 0.5))
    for q in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError):
            quantile([1.0], q)
