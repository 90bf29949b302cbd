"""Prometheus view of the brain: per-node health, weight, alarms and latest metrics, the predictors' scores, and
the counters the brain keeps as plain numbers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prismlb.service import MS_TO_S, node_families

from ._predictor import Predictor
from ._registry import Registry
from ._weights import published_admit


class RegistryCollector(Collector):
    """Every live node: the brain's health score, weights, published network stall and alarms for it, and the
    measurements it last reported (one family per quantity, labelled by node)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        health = GaugeMetricFamily("prism_brain_node_health", "Health score in [0, 1]", labels=["node"])
        weight = GaugeMetricFamily(
            "prism_brain_node_weight", "Routing weight per slice (and GPU)", labels=["node", "slice", "gpu"]
        )
        alarm = GaugeMetricFamily(
            "prism_brain_node_alarm", "1 while a dimension is over its alarm", labels=["node", "dimension"]
        )
        stall = GaugeMetricFamily(
            "prism_brain_node_stall_seconds",
            "Network stall a request can expect, from retransmits, as published to routers (0: none)",
            labels=["node"],
        )
        admit = GaugeMetricFamily(
            "prism_brain_node_admit_wait_seconds",
            "Wait for room in the engine's KV cache a new request can expect, as published to routers (0: room)",
            labels=["node"],
        )
        nodes = list(self._registry.nodes.items())
        for node_id, state in nodes:
            health.add_metric([node_id], state.health.score)
            stall.add_metric([node_id], (state.published_stall_ms or 0.0) / 1000)
            admit.add_metric([node_id], (published_admit(state.vector) or 0.0) / 1000)
            for (slice_, gpu), value in state.weights.items():
                weight.add_metric([node_id, slice_.value, "" if gpu is None else str(gpu)], value)
            for name in state.health.alarms:
                alarm.add_metric([node_id, name], 1.0)
        yield from (health, weight, stall, admit, alarm)
        yield from node_families(
            "prism_brain_node_", ["node"], (([node_id], state.vector.metrics) for node_id, state in nodes)
        )


_SCORE_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("mae_ms", "prism_brain_predictor_mae_seconds", "Mean absolute error on held-out recent windows"),
    ("p99_abs_error_ms", "prism_brain_predictor_p99_error_seconds", "P99 absolute error on held-out windows"),
)
"""(score field in ms, family in seconds, HELP) for each score of a predictor, labelled by the predictor."""


class PredictorCollector(Collector):
    """The predictors' scores on recent held-out windows, side by side, and which one the weights use."""

    def __init__(self, predictor: Predictor) -> None:
        self._predictor = predictor

    def collect(self) -> Iterator[Metric]:
        evaluation = self._predictor.evaluation
        if evaluation is None:
            return
        scores = sorted(evaluation.scores.items())
        for field, name, help_text in _SCORE_FAMILIES:
            family = GaugeMetricFamily(name, help_text, labels=["predictor"])
            for predictor, score in scores:
                family.add_metric([predictor], getattr(score, field) * MS_TO_S)
            yield family
        used = GaugeMetricFamily(
            "prism_brain_predictor_in_use", "1 for the predictor the weights use", labels=["predictor"]
        )
        for predictor, _ in scores:
            used.add_metric([predictor], 1.0 if predictor == evaluation.best else 0.0)
        yield used


class TallyCollector(Collector):
    """Counters over tallies the brain keeps as plain integers (prometheus_client's `Counter` cannot read a
    value, only be incremented): each is read at scrape time. `counters` holds (name without `_total`, HELP,
    read) triples."""

    def __init__(self, counters: Sequence[tuple[str, str, Callable[[], float]]]) -> None:
        self._counters = tuple(counters)

    def collect(self) -> Iterator[Metric]:
        for name, help_text, read in self._counters:
            yield CounterMetricFamily(name, help_text, value=read())
