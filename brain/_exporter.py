"""Prometheus view of the registry: per-node health, weight, alarms and latest metrics."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ._predictor import Predictor
from ._registry import Registry


class RegistryCollector(Collector):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        health = GaugeMetricFamily("prism_brain_node_health", "Health score in [0, 1]", labels=["node"])
        weight = GaugeMetricFamily(
            "prism_brain_node_weight", "Routing weight per slice (and GPU)", labels=["node", "slice", "gpu"]
        )
        alarm = GaugeMetricFamily("prism_brain_node_alarm", "1 while a dimension is over its alarm", labels=["node", "dimension"])
        metric = GaugeMetricFamily(
            "prism_brain_node_metric", "Latest value the node reported (unit in the name)", labels=["node", "metric"]
        )
        for node_id, state in list(self._registry.nodes.items()):
            health.add_metric([node_id], state.health.score)
            for (slice_, gpu), value in state.weights.items():
                weight.add_metric([node_id, slice_.value, "" if gpu is None else str(gpu)], value)
            for name in state.health.alarms:
                alarm.add_metric([node_id, name], 1.0)
            for name, value in msgspec.structs.asdict(state.vector.metrics).items():
                if value is not None:
                    metric.add_metric([node_id, name], float(value))
        yield from (health, weight, alarm, metric)


class PredictorCollector(Collector):
    """The predictors' scores on recent held-out windows, side by side, and which one the weights use."""

    def __init__(self, predictor: Predictor) -> None:
        self._predictor = predictor

    def collect(self) -> Iterator[GaugeMetricFamily]:
        evaluation = self._predictor.evaluation
        if evaluation is None:
            return
        mae = GaugeMetricFamily("prism_brain_predictor_mae_ms", "MAE on held-out recent windows", labels=["predictor"])
        p99 = GaugeMetricFamily(
            "prism_brain_predictor_p99_error_ms", "P99 absolute error on held-out windows", labels=["predictor"]
        )
        used = GaugeMetricFamily("prism_brain_predictor_in_use", "1 for the predictor the weights use", labels=["predictor"])
        for name, score in sorted(evaluation.scores.items()):
            mae.add_metric([name], score.mae_ms)
            p99.add_metric([name], score.p99_abs_error_ms)
            used.add_metric([name], 1.0 if name == evaluation.best else 0.0)
        yield from (mae, p99, used)
