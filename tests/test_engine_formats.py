"""Engine collector against the exposition of engine set-ups the fixtures of test_engine.py do not cover: SGLang
with MoE expert parallelism (with and without DP attention) and vLLM's older metric names, over real HTTP.

The text is what prometheus_client prints for metrics declared as the engines declare them (names, label names,
counters' `_total`); SGLang's scheduler processes each publish their series with their own rank labels, and the
engine's /metrics serves them all together, as one registry holding every label set prints them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from prismlb.agent._engine import EngineCollector

from .test_engine import MetricsServer

SGLANG_MODEL = "deepseek-ai/DeepSeek-V3"
# SGLang's queue-time buckets (`sglang:queue_time_seconds`).
SGLANG_QUEUE_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    s = MetricsServer()
    yield s
    s.close()


class SglangSchedulers:
    """The scheduler metrics of one SGLang server: a label set per scheduler that publishes (`labels` as its
    Scheduler builds them: model_name, engine_type, tp_rank, pp_rank, moe_ep_rank, and dp_rank under DP)."""

    def __init__(self, schedulers: list[dict[str, str]]) -> None:
        self.registry = CollectorRegistry()
        names = list(schedulers[0])
        registry = self.registry
        self.running = Gauge("sglang:num_running_reqs", "The number of running requests.", names, registry=registry)
        self.queued = Gauge("sglang:num_queue_reqs", "The number of requests in the queue.", names, registry=registry)
        self.usage = Gauge("sglang:token_usage", "The token usage.", names, registry=registry)
        self.queue_time = Histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            names,
            buckets=SGLANG_QUEUE_BUCKETS,
            registry=registry,
        )
        self.schedulers = schedulers

    def report(self, replica: dict[str, str], running: int, queued: int, usage: float, waited_s: list[float]) -> None:
        """Every scheduler of the replica (the schedulers whose labels include `replica`) logs the same state,
        as the ranks of one replica do."""
        for labels in self.schedulers:
            if replica.items() <= labels.items():
                self.running.labels(**labels).set(running)
                self.queued.labels(**labels).set(queued)
                self.usage.labels(**labels).set(usage)
                histogram = self.queue_time.labels(**labels)
                for seconds in waited_s:
                    histogram.observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def scheduler(tp_rank: int, moe_ep_rank: int, dp_rank: int | None = None) -> dict[str, str]:
    labels = {"model_name": SGLANG_MODEL, "engine_type": "unified", "tp_rank": str(tp_rank), "pp_rank": "0"}
    labels["moe_ep_rank"] = str(moe_ep_rank)
    if dp_rank is not None:
        labels["dp_rank"] = str(dp_rank)
    return labels


def test_sglang_expert_parallel_ranks_of_one_replica_are_counted_once(server: MetricsServer) -> None:
    # TP 2, EP 2, `--enable-metrics-for-all-schedulers`: both schedulers publish, with tp_rank and moe_ep_rank 0, 1.
    engine = SglangSchedulers([scheduler(0, 0), scheduler(1, 1)])
    engine.report({}, running=3, queued=0, usage=0.1, waited_s=[])
    server.queue(engine.text())
    engine.report({}, running=4, queued=2, usage=0.25, waited_s=[0.05, 0.05, 0.15])
    server.queue(engine.text())
    collector = EngineCollector(server.url)
    assert collector.sample().requests_running == 3
    second = collector.sample()
    assert (second.requests_running, second.requests_waiting) == (4, 2)
    assert second.kv_cache_usage_ratio == pytest.approx(0.25)
    # Three requests queued in the replica, each logged by both ranks: 3, not 6.
    assert second.queue is not None and second.queue.requests == 3


def test_sglang_dp_attention_replicas_are_summed_their_ep_ranks_not(server: MetricsServer) -> None:
    # TP 4, DP 2 with DP attention, EP 4, every scheduler publishing: replica 0 is TP ranks 0-1, replica 1 TP 2-3.
    engine = SglangSchedulers([scheduler(tp, tp, dp_rank=tp // 2) for tp in range(4)])
    engine.report({"dp_rank": "0"}, running=4, queued=1, usage=0.2, waited_s=[0.05])
    engine.report({"dp_rank": "1"}, running=3, queued=0, usage=0.4, waited_s=[0.15, 0.15])
    server.queue(engine.text())
    sample = EngineCollector(server.url).sample()
    assert (sample.requests_running, sample.requests_waiting) == (7, 1)
    assert sample.kv_cache_usage_ratio == pytest.approx(0.3), "the mean of the two replicas' pools"


class VllmMetrics:
    """vLLM's scheduler-state and prefix-cache metrics per engine (labels model_name, engine), under the names of
    vLLM before 0.9.2 (`old`), the current ones (`new`), or both, as 0.9.2 to 0.11 publish them."""

    def __init__(self, *, old: bool, new: bool) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.running = Gauge("vllm:num_requests_running", "Running requests.", labels, registry=self.registry)
        self.usage: list[Gauge] = []
        self.counters: list[tuple[Counter, Counter]] = []
        for present, usage, queries, hits in (
            (new, "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"),
            (old, "vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits"),
        ):
            if present:
                self.usage.append(
                    Gauge(usage, "KV-cache usage. 1 means 100 percent usage.", labels, registry=self.registry)
                )
                self.counters.append(
                    (
                        Counter(queries, "Prefix cache queries, in tokens.", labels, registry=self.registry),
                        Counter(hits, "Prefix cache hits, in tokens.", labels, registry=self.registry),
                    )
                )

    def engine(self, index: int, *, running: int, usage: list[float], queried: list[int], hit: list[int]) -> None:
        """Engine `index`'s state; `usage`, `queried` and `hit` per generation of names (new first when both)."""
        labels = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine": str(index)}
        self.running.labels(**labels).set(running)
        for gauge, value in zip(self.usage, usage, strict=True):
            gauge.labels(**labels).set(value)
        for (queries, hits), q, h in zip(self.counters, queried, hit, strict=True):
            queries.labels(**labels).inc(q)
            hits.labels(**labels).inc(h)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def test_vllm_names_before_0_9_2_are_read_and_the_current_ones_preferred(server: MetricsServer) -> None:
    engine = VllmMetrics(old=True, new=False)
    engine.engine(0, running=2, usage=[0.2], queried=[1000], hit=[100])
    engine.engine(1, running=1, usage=[0.4], queried=[500], hit=[0])
    server.queue(engine.text())
    engine.engine(0, running=2, usage=[0.3], queried=[800], hit=[200])
    engine.engine(1, running=1, usage=[0.5], queried=[200], hit=[50])
    server.queue(engine.text())
    collector = EngineCollector(server.url)
    first = collector.sample()
    assert (first.kind, first.requests_running) == ("vllm", 3)
    assert first.kv_cache_usage_ratio == pytest.approx(0.3)
    second = collector.sample()
    assert second.kv_cache_usage_ratio == pytest.approx(0.4)
    # Queried +1000 tokens, hit +250.
    assert second.kv_cache_miss_ratio == pytest.approx(0.75)

    # 0.9.2 to 0.11 publish both. The two never disagree in a real engine; here they do, to show which is read.
    both = VllmMetrics(old=True, new=True)
    both.engine(0, running=1, usage=[0.2, 0.9], queried=[0, 0], hit=[0, 0])
    later = MetricsServer()
    try:
        later.queue(both.text())
        both.engine(0, running=1, usage=[0.3, 0.9], queried=[400, 400], hit=[100, 300])
        later.queue(both.text())
        collector = EngineCollector(later.url)
        assert collector.sample().kv_cache_usage_ratio == pytest.approx(0.2)
        second = collector.sample()
        assert second.kv_cache_usage_ratio == pytest.approx(0.3)
        assert second.kv_cache_miss_ratio == pytest.approx(0.75)
    finally:
        later.close()
