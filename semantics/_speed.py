"""A node's prefill speed: how it is published in a table, by the brain and by a gateway without one (held until its
measure drifts, in coarse steps, so that a table is not sent again to every router for each window's noise), and how
a router stands in for one its table does not carry yet (its own first tokens, on the table's scale)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

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


def callers_speeds(
    measured: Mapping[str, float], seen: Mapping[str, float], classes: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Speeds for the nodes `measured` lacks, from `seen`, on `measured`'s scale.

    `measured`: the speeds an engine's own counters give (an agent's or a gateway's `/metrics` measure, over at
    least 16 prefills); `seen`: what a router's callers saw, its prompt tokens over the seconds to their first
    tokens (`EndpointStatus.first_token_speed`), which it has from a node's first streamed answer on. That one also
    reads a busy engine's queue and the hop, so it is scaled by the median ratio of the two over the nodes that have
    both (1 when none has: every speed is then the callers' own, still comparable with each other). It keeps the
    nodes' order where the engines' measures are not in yet: a fleet's median in their place would take a slow
    GPU for a typical one while its first placements stick to it.

    `classes`: each node's GPU class ("" or absent: unknown). A node of a class is given the median of its class's
    scaled speeds, whether its own callers saw it or not: GPUs of one class prefill alike, and what their first
    tokens tell apart is mostly which one had a queue, which the expected time counts already. A node of no class
    keeps its own."""
    both = [measured[k] / seen[k] for k in measured.keys() & seen.keys() if seen[k] > 0]
    scale = statistics.median(both) if both else 1.0
    own = {k: rate * scale for k, rate in seen.items() if k not in measured and rate > 0}
    if not classes:
        return own
    pooled: dict[str, list[float]] = {}
    for k, rate in own.items():
        if classes.get(k):
            pooled.setdefault(classes[k], []).append(rate)
    medians = {gpu_class: statistics.median(rates) for gpu_class, rates in pooled.items()}
    unclassed = {k: rate for k, rate in own.items() if not classes.get(k)}
    return unclassed | {k: medians[c] for k, c in classes.items() if c in medians and k not in measured}
