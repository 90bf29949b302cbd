"""The sources of a node vector, each at its period (SPEC §3: fragmentation 2 s, KV miss 5 s, CPU
preprocessing P95 10 s, NVLink 3 s; host and load every vector period)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from ._config import AgentConfig
from ._ebpf import ConnectCounter
from ._gpu import GpuCollector
from ._host import HostSampler
from ._node import Reading, Source
from ._signals import SpanSignals

FRAGMENTATION_PERIOD_S = 2.0
KV_MISS_PERIOD_S = 5.0
PREPROCESSING_PERIOD_S = 10.0
NVLINK_PERIOD_S = 3.0

_log = logging.getLogger("prism.agent")


def _gpu(collector: GpuCollector) -> Reading:
    sample = collector.sample()
    return Reading(metrics=dataclasses.asdict(sample.node), gpus=sample.devices)


def _host(sampler: HostSampler) -> Reading:
    host = sampler.sample()
    return Reading(
        metrics={
            "cpu_util_ratio": host.cpu_util_ratio,
            "mem_used_bytes": host.mem_used_bytes,
            "mem_total_bytes": host.mem_total_bytes,
        }
    )


@contextmanager
def node_sources(config: AgentConfig, counter: ConnectCounter | None, signals: SpanSignals) -> Iterator[list[Source]]:
    """The sources this agent can read, opened for the block and closed after it."""
    period = config.period_s
    host = HostSampler()
    sources = [
        Source("host", period, lambda: _host(host)),
        Source(
            "load",
            period,
            lambda: Reading(metrics={"requests_per_s": signals.requests_per_s()}, latency=signals.latency()),
        ),
        Source(
            "fragmentation",
            FRAGMENTATION_PERIOD_S,
            lambda: Reading(metrics={"gpu_mem_frag_ratio": signals.fragmentation_ratio(3 * FRAGMENTATION_PERIOD_S)}),
        ),
        Source(
            "preprocessing",
            PREPROCESSING_PERIOD_S,
            lambda: Reading(metrics={"cpu_preproc_p95_ms": signals.cpu_preprocessing_p95_ms()}),
        ),
    ]
    if counter is not None:
        sources.append(Source("ebpf", period, lambda: Reading(metrics={"connect_calls_total": counter.total()})))
    with ExitStack() as stack:
        gpus, detail = GpuCollector.open()
        if gpus is None:
            _log.info("GPU off: %s", detail)
        else:
            _log.info("GPU on: %s", detail)
            stack.callback(gpus.close)
            sources.append(Source("gpu", NVLINK_PERIOD_S, lambda: _gpu(gpus)))
        yield sources
