"""Tallies a service keeps by kind in a plain dict (a `RejectCounter`'s failures, a relay's events) as one
Prometheus counter family, read at scrape time: every such family is labelled and ordered alike."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.core import CounterMetricFamily


def kind_counter(name: str, help_text: str, counts: Mapping[str, float], label: str = "kind") -> CounterMetricFamily:
    """`counts` as the counter `name`, one sample per kind under `label`, in the kinds' order (so that consecutive
    scrapes list them the same way)."""
    family = CounterMetricFamily(name, help_text, labels=[label])
    for kind, value in sorted(counts.items()):
        family.add_metric([kind], value)
    return family
