"""A node's measurements as Prometheus families: one family per quantity, in base units (seconds, bytes, ratios
0 to 1), counters ending in `_total`. The agent exports its own node and the brain every node it hears, from this
one table, so both name a quantity alike."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from prismlb.wire import NodeMetrics

MS_TO_S = 1e-3
"""The wire carries latencies in ms (`Millis`); Prometheus takes seconds."""


@dataclass(frozen=True)
class NodeFamily:
    """How one `NodeMetrics` field is exported: its family name after the service's prefix, its HELP text, its
    type and the factor that takes the wire's unit to the base unit."""

    field: str
    name: str
    help: str
    counter: bool = False
    scale: float = 1.0


NODE_FAMILIES: tuple[NodeFamily, ...] = (
    NodeFamily("cpu_util_ratio", "cpu_util_ratio", "Host CPU busy share, 0 to 1"),
    NodeFamily("mem_used_bytes", "mem_used_bytes", "Host memory in use"),
    NodeFamily("mem_total_bytes", "mem_total_bytes", "Host memory installed"),
    NodeFamily("connect_calls_total", "connect_calls_total", "connect() calls the eBPF program counted", counter=True),
    NodeFamily(
        "tcp_retransmits_per_conn",
        "tcp_retransmits_per_connection",
        "TCP segments retransmitted per connection open in the agent's period",
    ),
    NodeFamily(
        "tcp_handshake_p95_ms",
        "tcp_handshake_p95_seconds",
        "P95 of the TCP handshakes the host completed as a client in the agent's period",
        scale=MS_TO_S,
    ),
    NodeFamily("tcp_retransmits_per_s", "tcp_retransmits_per_second", "TCP segments retransmitted per second"),
    NodeFamily("tcp_resets_per_s", "tcp_resets_per_second", "TCP resets sent or received per second"),
    NodeFamily(
        "tcp_refused_per_s",
        "tcp_refused_per_second",
        "TCP connects per second that never completed (refused, timed out, unreachable or abandoned)",
    ),
    NodeFamily("gpu_mem_frag_ratio", "gpu_mem_frag_ratio", "GPU allocator fragmentation, 0 to 1"),
    NodeFamily("kv_cache_miss_ratio", "kv_cache_miss_ratio", "Share of prompt tokens the engine's KV cache missed"),
    NodeFamily(
        "cpu_preproc_p95_ms",
        "cpu_preproc_p95_seconds",
        "P95 of the CPU preprocessing stages (decode, features, tokenize)",
        scale=MS_TO_S,
    ),
    NodeFamily("nvlink_util_ratio", "nvlink_util_ratio", "NVLink utilisation of the node's busiest GPU, 0 to 1"),
    NodeFamily("gpu_count", "gpus", "GPUs on the node"),
    NodeFamily("gpu_mem_used_bytes", "gpu_mem_used_bytes", "GPU memory in use, summed over the node's GPUs"),
    NodeFamily("gpu_mem_total_bytes", "gpu_mem_total_bytes", "GPU memory, summed over the node's GPUs"),
    NodeFamily("gpu_util_ratio", "gpu_util_ratio", "Utilisation of the node's busiest GPU, 0 to 1"),
    NodeFamily("pcie_util_ratio", "pcie_util_ratio", "PCIe utilisation of the node's busiest GPU, 0 to 1"),
    NodeFamily("kv_cache_usage_ratio", "kv_cache_usage_ratio", "Share of the engine's KV cache in use"),
    NodeFamily("requests_running", "requests_running", "Requests the engine is running"),
    NodeFamily("requests_waiting", "requests_waiting", "Requests waiting in the engine's queue"),
    NodeFamily("requests_per_s", "requests_per_second", "Requests the node served per second"),
    NodeFamily(
        "prefill_tokens_per_s",
        "prefill_tokens_per_second",
        "Prompt tokens computed (cache hits left out) per second spent prefilling",
    ),
)


def node_families(
    prefix: str, labels: Sequence[str], nodes: Iterable[tuple[Sequence[str], NodeMetrics]]
) -> list[Metric]:
    """Every family of `NODE_FAMILIES`, named `prefix` + its name, with one sample per node (its label values
    first) for each field it measured; a family nobody measured is there without samples, so a scrape always
    lists the same names."""
    families: list[tuple[NodeFamily, GaugeMetricFamily | CounterMetricFamily]] = [
        (
            spec,
            (CounterMetricFamily if spec.counter else GaugeMetricFamily)(prefix + spec.name, spec.help, labels=labels),
        )
        for spec in NODE_FAMILIES
    ]
    for label_values, metrics in nodes:
        for spec, family in families:
            value = getattr(metrics, spec.field)
            if value is not None:
                family.add_metric(label_values, value * spec.scale)
    return [family for _, family in families]
