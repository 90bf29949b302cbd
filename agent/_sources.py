"""The sources of a node vector, each at its period (fragmentation 2 s, KV miss 5 s, CPU
preprocessing P95 10 s, NVLink 3 s; host and load every vector period). Latency per slice comes from the
worker library's spans; the engine's own histograms, over all its requests, go under the key "engine". The request
rate is the spans' where they arrive, else the engine's count of finished requests."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prismlb.semantics import ENGINE_LATENCY_KEY
from prismlb.service import kind_counter

from ._config import AgentConfig, brain_endpoints
from ._ebpf import ConnectCounter
from ._engine import EngineCollector
from ._gpu import GpuCollector
from ._host import HostSampler
from ._kv_events import KvEventSubscriber
from ._kv_stream import KvStream
from ._node import Reading, Source
from ._signals import SpanSignals

FRAGMENTATION_PERIOD_S = 2.0
KV_MISS_PERIOD_S = 5.0
PREPROCESSING_PERIOD_S = 10.0
NVLINK_PERIOD_S = 3.0

_log = logging.getLogger("prism.agent")


def _engine(collector: EngineCollector) -> Reading:
    sample = collector.sample()
    latency = sample.latency()
    return Reading(
        metrics={
            "kv_cache_usage_ratio": sample.kv_cache_usage_ratio,
            "kv_cache_miss_ratio": sample.kv_cache_miss_ratio,
            "prefill_tokens_per_s": sample.prefill_tokens_per_s,
            "requests_running": sample.requests_running,
            "requests_waiting": sample.requests_waiting,
            "requests_per_s": sample.requests_per_s,
        },
        latency={ENGINE_LATENCY_KEY: latency} if latency is not None else None,
    )


def _gpu(collector: GpuCollector) -> Reading:
    sample = collector.sample()
    return Reading(metrics=dataclasses.asdict(sample.node), gpus=sample.devices)


def _host(sampler: HostSampler) -> Reading:
    return Reading(metrics=dataclasses.asdict(sampler.sample()))


def _ebpf(counter: ConnectCounter) -> Reading:
    """The connect() count and the TCP health of the window since the previous read (the source's period)."""
    return Reading(metrics={"connect_calls_total": counter.total(), **counter.network.read()})


class _CollectorCounts(Collector):
    """The engine scraper's, the KV-event subscriber's and the KV stream's own counters on /metrics."""

    def __init__(
        self, engine: EngineCollector | None, kv: KvEventSubscriber | None, stream: KvStream | None = None
    ) -> None:
        self._engine, self._kv, self._stream = engine, kv, stream

    def collect(self) -> Iterator[Metric]:
        if self._engine is not None:
            yield kind_counter(
                "prism_agent_engine_scrape_failures", "Failed engine scrapes by kind", self._engine.failures.counts()
            )
        if self._kv is not None:
            stats = self._kv.stats()
            for name, help_text, value in (
                ("batches", "KV-event batches applied", stats.batches),
                ("events", "KV events applied", stats.events),
                ("replayed_batches", "KV-event batches recovered by replay", stats.replayed_batches),
                ("missed_batches", "KV-event batches lost in gaps", stats.missed_batches),
                ("evicted_blocks", "Blocks dropped from the bounded block set", stats.evicted_blocks),
            ):
                yield CounterMetricFamily(f"prism_agent_kv_{name}", help_text, value=value)
            yield GaugeMetricFamily("prism_agent_kv_blocks", "KV blocks the engine holds", value=stats.blocks)
            yield kind_counter("prism_agent_kv_failures", "KV-event failures by kind", self._kv.failures.counts())
        if self._stream is not None:
            for name, help_text, value in (
                ("stream_sent", "KvBlocks messages every brain's queue took", self._stream.sent),
                ("stream_dropped", "KvBlocks messages a brain's full queue dropped", self._stream.dropped),
                ("stream_resets", "Whole block sets sent to the brains", self._stream.resets),
            ):
                yield CounterMetricFamily(f"prism_agent_kv_{name}", help_text, value=value)


@contextmanager
def node_sources(
    config: AgentConfig, counter: ConnectCounter | None, signals: SpanSignals, registry: CollectorRegistry
) -> Iterator[list[Source]]:
    """The sources this agent can read, opened for the block and closed after it; the engine's out-of-range
    values are counted with the spans' in `signals.invalid`."""
    period = config.period_s
    host = HostSampler()
    sources = [
        Source("host", period, lambda: _host(host)),
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
        sources.append(Source("ebpf", period, lambda: _ebpf(counter)))
    with ExitStack() as stack:
        gpus, detail = GpuCollector.open()
        if gpus is None:
            _log.info("GPU off: %s", detail)
        else:
            _log.info("GPU on: %s", detail)
            stack.callback(gpus.close)
            sources.append(Source("gpu", NVLINK_PERIOD_S, lambda: _gpu(gpus)))
        engine = kv = stream = None
        if config.engine_url is not None:
            engine = EngineCollector(config.engine_url, invalid=signals.invalid)
            sources.append(Source("engine", KV_MISS_PERIOD_S, lambda: _engine(engine)))
        if config.kv_events is not None:
            kv = stack.enter_context(KvEventSubscriber(config.kv_events, config.kv_replay, dp_ranks=config.kv_dp_ranks))
            kv.start()
            sources.append(Source("kv_events", KV_MISS_PERIOD_S, lambda: Reading(kv=kv.summary())))
            stream = stack.enter_context(
                KvStream(
                    kv,
                    config.node_id,
                    brain_endpoints(config.brain),
                    curve=config.curve,
                    full_every_s=config.kv_full_every_s,
                )
            )
            stream.start()
        # last, so that the request spans' rate, where there is one, stands over the engine's count
        sources.append(
            Source(
                "load",
                period,
                lambda: Reading(metrics={"requests_per_s": signals.requests_per_s()}, latency=signals.latency()),
            )
        )
        collector = _CollectorCounts(engine, kv, stream)
        registry.register(collector)
        stack.callback(registry.unregister, collector)
        yield sources
