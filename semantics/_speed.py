"""How a node's prefill speed is published in a table, by the brain and by a gateway without one: held until its
measure drifts, in coarse steps, so that a table is not sent again to every router for each window's noise."""

from __future__ import annotations

import math

from prismlb.wire import MAX_TABLE_VALUE

RATE_STEPS_PER_DOUBLING = 8
RATE_HYSTERESIS = 0.15
"""A published prefill speed moves only when its measure drifts more than 15% from it, in steps of 2^(1/8) (9%)."""


def held_speed(rate: float, held: float | None) -> float:
    """The speed to publish for a measure of `rate` tokens per second, where `held` was published before (None:
    nothing yet): `held` while `rate` is within `RATE_HYSTERESIS` of it, else `rate` on the nearest step (at most
    the wire's largest table value)."""
    if held is not None and abs(rate - held) <= RATE_HYSTERESIS * held:
        return held
    step = 2.0 ** (round(math.log2(rate) * RATE_STEPS_PER_DOUBLING) / RATE_STEPS_PER_DOUBLING)
    return min(step, MAX_TABLE_VALUE)
