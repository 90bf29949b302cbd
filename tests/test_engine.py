"""Engine collector against vLLM and SGLang exposition text served over real HTTP.

The fixtures in tests/data were printed by prometheus_client with vLLM's and SGLang's own metric definitions
(names, help, labels, buckets): vLLM with two engines (DP=2), SGLang with every scheduler publishing
(`--enable-metrics-for-all-schedulers`, TP=2). The expected values below are worked out by hand from the
bucket and counter changes between fixtures.
"""

from __future__ import annotations

import http.server
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prismlb.agent._engine import (
    MIN_PREFILL_REQUESTS,
    EngineCollector,
    EngineSample,
    LatencyQuantiles,
    histogram_quantile,
)

from ._helpers_http import QuietHandler
from .conftest import free_port

DATA = Path(__file__).parent / "data"


def fixture(name: str) -> bytes:
    return (DATA / name).read_bytes()


class MetricsServer:
    """A local HTTP server answering each GET with the next queued (status, body, delay), the last repeated."""

    def __init__(self) -> None:
        self.responses: list[tuple[int, bytes, float]] = []
        served = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                status, body, delay = served.responses.pop(0) if len(served.responses) > 1 else served.responses[0]
                time.sleep(delay)
                self.reply(status, body, "text/plain; version=0.0.4; charset=utf-8")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def queue(self, body: bytes, status: int = 200, delay_s: float = 0.0) -> None:
        self.responses.append((status, body, delay_s))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    s = MetricsServer()
    yield s
    s.close()


def scraping(server: MetricsServer, *bodies: bytes, clock: Callable[[], float] = time.monotonic) -> EngineCollector:
    """A collector of `server`, which answers its scrapes with `bodies` in order (the last repeated)."""
    for body in bodies:
        server.queue(body)
    return EngineCollector(server.url, clock=clock)


def assert_quantiles(got: LatencyQuantiles | None, requests: int, p50: float, p95: float, p99: float) -> None:
    assert got is not None
    assert got.requests == requests
    assert (got.p50_ms, got.p95_ms, got.p99_ms) == pytest.approx((p50, p95, p99), abs=1e-6)


def gauges(kind: str, usage: float, running: int, waiting: int) -> EngineSample:
    """A sample of only what a scrape reads at once (the first scrape's: no earlier one to take deltas from)."""
    return EngineSample(
        kind=kind, kv_cache_usage_ratio=pytest.approx(usage), requests_running=running, requests_waiting=waiting
    )


def gauges_of(got: EngineSample) -> EngineSample:
    """`got` less what it measured since the previous scrape, to compare with `gauges(...)`."""
    return EngineSample(
        kind=got.kind,
        kv_cache_usage_ratio=got.kv_cache_usage_ratio,
        requests_running=got.requests_running,
        requests_waiting=got.requests_waiting,
    )


def test_vllm_gauges_miss_ratio_and_quantiles_from_deltas(server: MetricsServer) -> None:
    collector = scraping(server, fixture("vllm_metrics_1.txt"), fixture("vllm_metrics_2.txt"))

    first = collector.sample()
    # Gauges are read at once: running 3+2, waiting 0+1, KV usage mean(0.12, 0.08); no deltas yet.
    assert first == gauges("vllm", 0.10, running=5, waiting=1)

    second = collector.sample()
    assert gauges_of(second) == gauges("vllm", 0.40, running=12, waiting=6)
    # queries: engine 0 1000 -> 3000, engine 1 500 -> 1500 (+3000); hits 400 -> 1900, 100 -> 400 (+1800).
    assert second.kv_cache_miss_ratio == pytest.approx(1 - 1800 / 3000)
    # TTFT, 100 new observations; cumulative per bucket: <=0.02: 10, 0.04: 30, 0.06: 50, 0.08: 60, 0.1: 80,
    # 0.25: 90, 0.5: 96, 0.75: 98, 1.0: 100.
    #   p50, rank 50 -> (0.04, 0.06]: 0.04 + 0.02 * (50 - 30) / 20 = 0.060 s
    #   p95, rank 95 -> (0.25, 0.5]:  0.25 + 0.25 * (95 - 90) / 6  = 0.458333 s
    #   p99, rank 99 -> (0.75, 1.0]:  0.75 + 0.25 * (99 - 98) / 2  = 0.875 s
    assert_quantiles(second.ttft, 100, 60.0, 250 + 250 * 5 / 6, 875.0)
    # e2e, 40 new: <=0.8: 4, 1.0: 12, 1.5: 24, 2.0: 32, 2.5: 36, 5.0: 38, 10.0: 40.
    #   p50, rank 20 -> (1.0, 1.5]: 1.0 + 0.5 * 8 / 12 ; p95, rank 38 -> (2.5, 5.0]: 5.0
    #   p99, rank 39.6 -> (5, 10]: 5 + 5 * 1.6 / 2 = 9.0
    assert_quantiles(second.e2e, 40, 1000 + 500 * 8 / 12, 5000.0, 9000.0)
    # queue, 40 new: <=0.3: 30, 0.5: 36, 0.8: 40.
    #   p50, rank 20 -> [0, 0.3]: 0.3 * 20 / 30 = 0.2 ; p95, rank 38 -> 0.5 + 0.3 * 2 / 4 ; p99 -> 0.5 + 0.3 * 3.6 / 4
    assert_quantiles(second.queue, 40, 200.0, 650.0, 770.0)


def test_the_request_rate_is_the_finished_requests_over_the_time_between_scrapes(server: MetricsServer) -> None:
    now = [100.0]
    names = ("vllm_metrics_1.txt", "vllm_metrics_2.txt", "vllm_metrics_3_restart.txt")
    collector = scraping(server, *(fixture(name) for name in names), clock=lambda: now[0])
    assert collector.sample().requests_per_s is None  # no earlier scrape to count from
    now[0] += 5.0
    assert collector.sample().requests_per_s == pytest.approx(40 / 5.0)  # the e2e histogram gained 40
    now[0] += 5.0
    assert collector.sample().requests_per_s is None  # nothing gained that a restart did not undo: not measured


def test_vllm_counter_reset_skips_the_restarted_series(server: MetricsServer) -> None:
    names = ("vllm_metrics_1.txt", "vllm_metrics_2.txt", "vllm_metrics_3_restart.txt")
    collector = scraping(server, *(fixture(name) for name in names))
    collector.sample()
    collector.sample()

    third = collector.sample()
    # Engine 1 restarted (queries 1500 -> 200): skipped. Engine 0: queries +1000, hits +250.
    assert third.kv_cache_miss_ratio == pytest.approx(0.75)
    # Engine 0 gained no observations and engine 1's histograms went down: no latency this window.
    assert third.ttft is None and third.e2e is None and third.queue is None
    assert third.latency() is None
    assert gauges_of(third) == gauges("vllm", 0.11, running=2, waiting=0)


def test_sglang_detected_replicas_read_once_and_miss_from_token_counters(server: MetricsServer) -> None:
    collector = scraping(server, fixture("sglang_metrics_1.txt"), fixture("sglang_metrics_2.txt"))
    first = collector.sample()
    assert first == gauges("sglang", 0.30, running=4, waiting=1)
    second = collector.sample()
    assert collector.kind == "sglang"
    # Both TP ranks publish the scheduler gauges (5 running each): one scheduler, not 10 requests.
    assert gauges_of(second) == gauges("sglang", 0.42, running=5, waiting=3)
    # sglang:cache_hit_rate reads 0.0 (set by the last decode log); the counters say prompt +4000, cached +1000.
    assert second.kv_cache_miss_ratio == pytest.approx(0.75)
    # TTFT, 20 new: <=0.2: 4, 0.4: 12, 0.6: 16, 0.8: 18, 1: 20.
    #   p50, rank 10 -> 0.2 + 0.2 * 6 / 8 = 0.35 ; p95, rank 19 -> 0.8 + 0.2 / 2 ; p99, rank 19.8 -> 0.8 + 0.2 * 0.9
    assert_quantiles(second.ttft, 20, 350.0, 900.0, 980.0)
    # e2e, 20 new: <=2: 10, 4: 18, 6: 20 -> p50 2.0 (end of (1, 2]), p95 4 + 2 * 1 / 2, p99 4 + 2 * 1.8 / 2.
    assert_quantiles(second.e2e, 20, 2000.0, 5000.0, 5800.0)
    # queue (one TP rank's histogram), 20 new: <=0.0: 10, 0.1: 16, 0.2: 20 -> p50 in the le=0 bucket is 0;
    # p95 0.1 + 0.1 * 3 / 4; p99 0.1 + 0.1 * 3.8 / 4.
    assert_quantiles(second.queue, 20, 0.0, 175.0, 195.0)
    latency = second.latency()
    assert latency is not None
    assert latency.requests == 20 and latency.ttft_p95_ms == pytest.approx(900.0)
    assert latency.e2e_p99_ms == pytest.approx(5800.0)


def test_detection_is_logged_once(server: MetricsServer, caplog: pytest.LogCaptureFixture) -> None:
    collector = scraping(server, fixture("vllm_metrics_1.txt"))
    assert collector.kind is None
    with caplog.at_level(logging.INFO, logger="prism.agent.engine"):
        collector.sample()
        collector.sample()
    assert collector.kind == "vllm"
    assert [r.getMessage() for r in caplog.records if "detected" in r.getMessage()] == [
        f"engine at {server.url} detected: vllm"
    ]


def test_absent_metrics_are_none_not_zero(server: MetricsServer) -> None:
    collector = scraping(
        server,
        b"# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        b"# TYPE vllm:kv_cache_usage_perc gauge\n"
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n',
    )
    collector.sample()
    assert collector.sample() == EngineSample(kind="vllm", kv_cache_usage_ratio=0.25)


@pytest.mark.parametrize(
    ("status", "body", "delay_s", "kind"),
    [
        (200, b"<html><body>Not Found</body></html>\n", 0.0, "malformed"),
        (200, b"\xff\xfe not utf-8", 0.0, "malformed"),
        (500, b"Internal Server Error", 0.0, "http_status"),
        (200, b"# TYPE python_info gauge\npython_info 1.0\n", 0.0, "unknown_engine"),
        (200, b"", 0.0, "unknown_engine"),
        (200, b"", 0.5, "timeout"),
    ],
)
def test_failed_scrape_is_all_absent_counted_and_logged_once(
    server: MetricsServer, caplog: pytest.LogCaptureFixture, status: int, body: bytes, delay_s: float, kind: str
) -> None:
    server.queue(body, status, delay_s)
    collector = EngineCollector(server.url, timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="prism.agent.engine"):
        assert collector.sample() == EngineSample()
        assert collector.sample() == EngineSample()
    assert collector.failures.counts() == {kind: 2}
    assert len([r for r in caplog.records if f"({kind})" in r.getMessage()]) == 1


def test_connection_refused() -> None:
    collector = EngineCollector(f"http://127.0.0.1:{free_port()}/metrics")
    assert collector.sample() == EngineSample()
    assert collector.kind is None
    assert collector.failures.counts() == {"refused": 1}


def test_deltas_span_a_failed_scrape(server: MetricsServer) -> None:
    server.queue(fixture("vllm_metrics_1.txt"))
    server.queue(b"<html>restarting</html>", 503)
    server.queue(fixture("vllm_metrics_2.txt"))
    collector = EngineCollector(server.url)
    collector.sample()
    assert collector.sample() == EngineSample()
    assert collector.sample().kv_cache_miss_ratio == pytest.approx(0.4)
    assert collector.failures.counts() == {"http_status": 1}


def test_rejects_a_non_http_url() -> None:
    with pytest.raises(ValueError):
        EngineCollector("tcp://127.0.0.1:8000")


def test_histogram_quantile_follows_prometheus() -> None:
    inf = math.inf
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(1.0, 3.0)]) is None  # no +Inf bucket
    assert histogram_quantile(0.5, [(1.0, 0.0), (inf, 0.0)]) is None  # no observations
    assert histogram_quantile(0.5, [(1.0, 2.0), (2.0, 4.0), (inf, 4.0)]) == 1.0
    assert histogram_quantile(0.99, [(1.0, 0.0), (2.0, 1.0), (inf, 10.0)]) == 2.0  # rank in +Inf: highest bound
    assert histogram_quantile(0.25, [(0.0, 5.0), (1.0, 10.0), (inf, 10.0)]) == 0.0  # le=0 bucket
    assert histogram_quantile(0.5, [(1.0, 0.0), (3.0, 4.0), (inf, 4.0)]) == 2.0
    # Non-monotonic counts (a scrape racing an observation) are made monotonic first, as Prometheus does.
    assert histogram_quantile(0.5, [(1.0, 4.0), (2.0, 3.0), (inf, 4.0)]) == 0.5


def vllm_text(
    queries: tuple[float, float],
    hits: tuple[float, float],
    prefill_s: tuple[float, float],
    first_tokens: tuple[float, float] = (0.0, 0.0),
    *,
    finished: tuple[float, float] = (1.0, 1.0),
    computed: tuple[float, float] | None = None,
) -> bytes:
    """Two engines' prefix-cache counters, prefill-time histograms (`finished` requests observed) and first tokens
    (the TTFT histogram's count), in vLLM's names; with `computed`, the computed-tokens histogram's sums as well,
    observed with the prefill times."""
    lines = ["# TYPE vllm:prefix_cache_queries counter", "# TYPE vllm:prefix_cache_hits counter"]
    lines += ["# TYPE vllm:request_prefill_time_seconds histogram", "# TYPE vllm:time_to_first_token_seconds histogram"]
    for engine in (0, 1):
        labels = f'engine="{engine}",model_name="m"'
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {first_tokens[engine]}')
        lines.append(f"vllm:time_to_first_token_seconds_count{{{labels}}} {first_tokens[engine]}")
        lines.append(f"vllm:time_to_first_token_seconds_sum{{{labels}}} {first_tokens[engine]}")
    for engine in (0, 1):
        labels = f'engine="{engine}",model_name="m"'
        lines.append(f"vllm:prefix_cache_queries_total{{{labels}}} {queries[engine]}")
        lines.append(f"vllm:prefix_cache_hits_total{{{labels}}} {hits[engine]}")
        lines.append(f'vllm:request_prefill_time_seconds_bucket{{{labels},le="+Inf"}} {finished[engine]}')
        lines.append(f"vllm:request_prefill_time_seconds_count{{{labels}}} {finished[engine]}")
        lines.append(f"vllm:request_prefill_time_seconds_sum{{{labels}}} {prefill_s[engine]}")
        if computed is not None:
            name = "vllm:request_prefill_kv_computed_tokens"
            lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {finished[engine]}')
            lines.append(f"{name}_count{{{labels}}} {finished[engine]}")
            lines.append(f"{name}_sum{{{labels}}} {computed[engine]}")
    return ("\n".join(lines) + "\n").encode()


def test_vllm_prefill_speed_pairs_the_computed_tokens_and_prefill_times_of_the_same_finished_requests(
    server: MetricsServer,
) -> None:
    collector = scraping(
        server,
        vllm_text((1000, 0), (0, 0), (1.0, 0.0), (10, 0), finished=(5, 0), computed=(900, 0)),
        # 30 first tokens, 7000 prompt tokens scheduled uncached, but only 7 requests finished: too few to tell
        vllm_text((9000, 0), (1000, 0), (2.0, 0.0), (40, 0), finished=(12, 0), computed=(2900, 0)),
        vllm_text((9000, 0), (1000, 0), (3.0, 0.0), (40, 0), finished=(25, 0), computed=(4900, 0)),
    )
    assert collector.sample().prefill_tokens_per_s is None  # the window starts
    assert collector.sample().prefill_tokens_per_s is None
    # 20 requests finished since the first scrape: 4000 tokens computed in their 2 s of prefill (the counters'
    # 7000 tokens, counted when scheduled, belong partly to requests still decoding).
    assert collector.sample().prefill_tokens_per_s == pytest.approx(4000 / 2.0)


def test_vllm_prefill_speed_is_computed_tokens_over_prefill_seconds_of_enough_requests(server: MetricsServer) -> None:
    assert MIN_PREFILL_REQUESTS == 16
    collector = scraping(
        server,
        vllm_text((1000, 500), (400, 100), (1.0, 0.5), (10, 10)),
        vllm_text((3000, 1500), (1900, 400), (1.2, 0.6), (14, 14)),
        vllm_text((5000, 2500), (2900, 900), (1.8, 0.9), (18, 18)),
        vllm_text((6000, 200), (3150, 50), (3.0, 0.1), (34, 1)),  # engine 1 restarted: its deltas are skipped
        vllm_text((100, 100), (50, 50), (0.1, 0.1), (1, 1)),  # both restarted: the window starts again
        vllm_text((2100, 1100), (550, 550), (1.1, 0.6), (11, 11)),
    )
    assert collector.sample().prefill_tokens_per_s is None  # the window starts
    assert collector.sample().prefill_tokens_per_s is None  # 8 first tokens: too few to tell
    # since the first scrape: queries +6000, hits +3300: 2700 tokens computed in 0.8 + 0.4 s of prefill.
    assert collector.sample().prefill_tokens_per_s == pytest.approx(2700 / 1.2)
    # engine 0 alone since the third scrape: (1000 - 250) tokens in 1.2 s.
    assert collector.sample().prefill_tokens_per_s == pytest.approx(750 / 1.2)
    assert collector.sample().prefill_tokens_per_s is None
    # since the restart: queries +3000, hits +1000 in 1.0 + 0.5 s.
    assert collector.sample().prefill_tokens_per_s == pytest.approx(2000 / 1.5)


def test_sglang_without_its_per_stage_histogram_gives_no_speed(server: MetricsServer) -> None:
    collector = scraping(server, fixture("sglang_metrics_1.txt"), fixture("sglang_metrics_2.txt"))
    collector.sample()
    second = collector.sample()
    assert second.kv_cache_miss_ratio is not None and second.prefill_tokens_per_s is None


def sglang_text(
    prompt: float, cached: float | dict[str, float], first_tokens: float, stages_s: dict[str, float]
) -> bytes:
    """One SGLang server's token counters and first tokens (the tokenizer's series) and its per-stage histogram's
    sums, published by both TP ranks of its scheduler. `cached` by `cache_source`, as SGLang publishes it since its
    hierarchical cache, or as one series."""
    model = 'model_name="m"'
    lines = ["# TYPE sglang:prompt_tokens counter", "# TYPE sglang:cached_tokens counter"]
    lines += ["# TYPE sglang:time_to_first_token_seconds histogram"]
    lines += ["# TYPE sglang:per_stage_req_latency_seconds histogram"]
    lines.append(f'sglang:prompt_tokens_total{{{model},engine_type="unified"}} {prompt}')
    for source, tokens in cached.items() if isinstance(cached, dict) else [(None, cached)]:
        labels = model if source is None else f'{model},cache_source="{source}"'
        lines.append(f"sglang:cached_tokens_total{{{labels}}} {tokens}")
    lines.append(f'sglang:time_to_first_token_seconds_bucket{{{model},le="+Inf"}} {first_tokens}')
    lines.append(f"sglang:time_to_first_token_seconds_count{{{model}}} {first_tokens}")
    lines.append(f"sglang:time_to_first_token_seconds_sum{{{model}}} {first_tokens}")
    for stage, seconds in stages_s.items():
        for rank in (0, 1):
            labels = f'{model},stage="{stage}",tp_rank="{rank}"'
            lines.append(f'sglang:per_stage_req_latency_seconds_bucket{{{labels},le="+Inf"}} 1.0')
            lines.append(f"sglang:per_stage_req_latency_seconds_count{{{labels}}} 1.0")
            lines.append(f"sglang:per_stage_req_latency_seconds_sum{{{labels}}} {seconds}")
    return ("\n".join(lines) + "\n").encode()


def test_sglang_cached_tokens_by_source_add_up_whatever_their_labels(server: MetricsServer) -> None:
    stages = {"prefill_forward": 0.0}
    collector = scraping(
        server,
        sglang_text(1000, {"device": 100}, 0, stages),
        sglang_text(5000, {"device": 1100, "host": 400}, 20, {"prefill_forward": 0.5}),
        sglang_text(9000, {"device": 2100, "host": 900}, 40, {"prefill_forward": 1.5}),
    )
    collector.sample()
    # +4000 prompt tokens, +1000 cached on the GPU (the host's series is new: its tokens start the next window)
    second = collector.sample()
    assert second.kv_cache_miss_ratio == pytest.approx(3000 / 4000)
    assert second.prefill_tokens_per_s == pytest.approx(3000 / 0.5)
    # +4000 prompt tokens, +1000 cached on the GPU and +500 in host memory: 2500 computed in 1 s
    third = collector.sample()
    assert third.kv_cache_miss_ratio == pytest.approx(2500 / 4000)
    assert third.prefill_tokens_per_s == pytest.approx(2500 / 1.0)


def test_sglang_prefill_speed_is_computed_tokens_over_its_prefill_forward_stage(server: MetricsServer) -> None:
    def stages(forward: float | None, decode: float, chunked: float = 0.0) -> dict[str, float]:
        first = {} if forward is None else {"prefill_forward": forward}
        waiting = {"request_process": 0.01, "prefill_waiting": 9}
        return {**waiting, **first, "chunked_prefill": chunked, "decode_forward": decode}

    collector = scraping(
        server,
        sglang_text(0, 0, 0, stages(None, 0.0)),  # just started: no prompt has reached its first token yet
        sglang_text(1000, 200, 4, stages(0.5, 30.0, chunked=0.3)),  # the prefill stage's series appears
        sglang_text(9000, 3200, 26, stages(1.5, 90.0, chunked=0.9)),
        sglang_text(500, 100, 2, stages(0.2, 1.0)),  # restarted: the window starts again
        sglang_text(2500, 600, 22, stages(0.6, 9.0, chunked=0.1)),
    )
    assert collector.sample().prefill_tokens_per_s is None  # the window starts
    assert collector.sample().prefill_tokens_per_s is None  # and starts again with the prefill stage's series
    # 22 first tokens since: 8000 prompt tokens, 3000 cached, over 1.0 s of `prefill_forward`, which spans a long
    # prompt's chunks (`chunked_prefill` times them again, inside it; the waiting and decode stages are not
    # prefill; both TP ranks publish the same series, read once).
    assert collector.sample().prefill_tokens_per_s == pytest.approx(5000 / 1.0)
    assert collector.sample().prefill_tokens_per_s is None
    assert collector.sample().prefill_tokens_per_s == pytest.approx((2000 - 500) / 0.4)
