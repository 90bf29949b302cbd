"""Engine collector: scrapes a vLLM (V1) or SGLang Prometheus endpoint, the engine detected from metric names.

Gauges are read as they are; the prefix-cache miss ratio, the prefill speed and the latency quantiles come
from the change of counters and histogram buckets since the previous successful scrape, so they describe the
window between two scrapes. Series are combined over their label sets: counts and histogram buckets are summed,
ratio gauges averaged (each engine has its own KV pool). The labels that tell data-parallel replicas apart, each
with its own requests and KV pool, are kept, so replicas add up: vLLM's `engine` (one engine core per DP rank)
and SGLang's `dp_rank`. The labels of the ranks inside one replica are not: SGLang's schedulers of one replica
hold the same requests, and publish them once per TP, PP or MoE expert-parallel rank (every attention-TP rank 0
with DP attention, every scheduler with `--enable-metrics-for-all-schedulers`); series that differ only in
`tp_rank`/`pp_rank`/`moe_ep_rank` are one series, read from the lowest ranks. A series whose counter or bucket
went down was restarted: its change is skipped for that window. A metric the engine does not publish is None,
never 0. vLLM before 0.9.2 names the KV usage and prefix-cache counters `vllm:gpu_cache_usage_perc` and
`vllm:gpu_prefix_cache_queries/hits`; both generations are read, the current names when an engine publishes both
(0.9.2 to 0.11 does, the old ones marked deprecated).
A value outside its bound (`_bounds.py`: 2e12 running requests, a usage of -3, NaN, a TTFT of 1e200 ms) is
dropped and counted in `invalid`, and the other fields of the sample are kept.
"""

from __future__ import annotations

import bisect
import dataclasses
import http.client
import itertools
import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from prismlb.wire import ModalityLatency, RejectCounter

from ._bounds import LATENCY_MS, RATIO, REQUESTS, Bound, InvalidValues

_log = logging.getLogger("prism.agent.engine")

MAX_BODY_BYTES = 32 * 1024 * 1024
_QUANTILES = (0.50, 0.95, 0.99)

_Labels = frozenset[tuple[str, str]]
_Series = dict[_Labels, float]
_RawQuantiles = tuple[float, float, float, float]  # requests, p50, p95, p99 in ms, before their bounds
MIN_PREFILL_REQUESTS = 16
"""The requests a speed is measured over at the least (`_SpeedWindow`, counted by the prefill times observed, or
by their first tokens where the prefix-cache counters stand in for the computed tokens): a scrape's
window with a few requests reads the ratio of two small numbers, and where a media encoder's time dominates a
handful of uncached tokens (an audio clip after a cached prompt) it reads a speed thirty times below the engine's.
Counted in requests, not seconds, so that an engine which prefills fast (or a time-compressed emulation of one)
measures as often as its traffic allows."""
_RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
"""Labels of the ranks inside one replica, which publish the same series (see the module's docstring)."""


@dataclass(frozen=True)
class _EngineNames:
    """Where one engine publishes what the agent reads (sample names as exposed, counters with `_total`)."""

    kind: str
    prefix: str
    kv_usage: tuple[str, ...]
    """The KV-usage gauge's names, the current one first: the first the engine publishes is read."""
    running: str
    waiting: str
    cache_counters: tuple[tuple[str, str], ...]
    """(queries, hits) counters of the prefix cache, the current names first: the first pair published is read."""
    ttft: str
    e2e: str
    queue: str
    prefill_time: str | None
    """A histogram of each request's prefill seconds (None: the engine publishes none)."""
    prefill_stages: frozenset[str] | None = None
    """Where `prefill_time` times several stages of a request under a `stage` label: the stages whose seconds add up
    to its prefill (None: every series is prefill)."""
    computed_tokens: str | None = None
    """A histogram of each request's prompt tokens computed in prefill (cached ones left out), observed with
    `prefill_time` for the same requests; None: the engine publishes none, and the prefix-cache counters stand in."""


_VLLM = _EngineNames(
    kind="vllm",
    prefix="vllm:",
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    cache_counters=(
        ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
        ("vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"),
    ),
    ttft="vllm:time_to_first_token_seconds",
    e2e="vllm:e2e_request_latency_seconds",
    queue="vllm:request_queue_time_seconds",
    prefill_time="vllm:request_prefill_time_seconds",
    computed_tokens="vllm:request_prefill_kv_computed_tokens",
)
# vLLM observes a request's prefill time and its computed tokens together, when the request finishes; its
# prefix-cache counters count the tokens when it is scheduled. A window that pairs the counters with the prefill
# time pairs different requests (by a reply's length apart), so the histogram of computed tokens is read where an
# engine publishes it, and the counters (first tokens counting towards the window) only where it does not.
# SGLang's `sglang:cache_hit_rate` gauge holds the last prefill batch's rate and is set to 0 by every decode
# log, so the miss ratio comes from its per-request token counters instead (cached / prompt tokens). Its
# per-stage histogram's `prefill_forward` stage runs from a request's first forward pass to its first token,
# every chunk of a long prompt included; `chunked_prefill` times those chunks again, inside it, so it is not
# added. (SGLang releases before its request time stats were rewritten timed each stage from the end of the one
# before, and `prefill_forward` held only a chunked prompt's last chunk: there the speed of prompts longer than
# `--chunked-prefill-size` reads high.)
_SGLANG = _EngineNames(
    kind="sglang",
    prefix="sglang:",
    kv_usage=("sglang:token_usage",),
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    cache_counters=(("sglang:prompt_tokens_total", "sglang:cached_tokens_total"),),
    ttft="sglang:time_to_first_token_seconds",
    e2e="sglang:e2e_request_latency_seconds",
    queue="sglang:queue_time_seconds",
    prefill_time="sglang:per_stage_req_latency_seconds",
    prefill_stages=frozenset({"prefill_forward"}),
)
_ENGINES = (_VLLM, _SGLANG)


@dataclass(frozen=True)
class LatencyQuantiles:
    """Quantiles of the observations a histogram gained between two scrapes."""

    requests: int
    p50_ms: float
    p95_ms: float
    p99_ms: float


@dataclass(frozen=True)
class EngineSample:
    """One scrape; every field is None when not measured (failed scrape, metric absent, nothing new)."""

    kind: str | None = None
    kv_cache_usage_ratio: float | None = None
    kv_cache_miss_ratio: float | None = None
    prefill_tokens_per_s: float | None = None
    """Prompt tokens computed (the computed-tokens histogram, else queried less found cached) over the seconds
    requests spent in prefill, both gained since the scrape that ended the last measure, once `MIN_PREFILL_REQUESTS`
    were counted (None before): the engine's prefill speed. Requests prefilled in the same steps share those seconds,
    so a busy engine reads slower than it computes; all engines of a fleet read alike."""
    requests_running: int | None = None
    requests_waiting: int | None = None
    requests_per_s: float | None = None
    """Requests finished per second since the previous scrape (the end-to-end histogram's count gained over the
    time between the scrapes): the node's request rate where no request spans reach the agent."""
    ttft: LatencyQuantiles | None = None
    e2e: LatencyQuantiles | None = None
    queue: LatencyQuantiles | None = None

    def latency(self) -> ModalityLatency | None:
        """TTFT and end-to-end quantiles as the wire's per-slice latency; `requests` counts finished requests."""
        if self.ttft is None and self.e2e is None:
            return None
        ttft, e2e = self.ttft, self.e2e
        return ModalityLatency(
            requests=e2e.requests if e2e is not None else 0,
            ttft_p50_ms=ttft.p50_ms if ttft is not None else None,
            ttft_p95_ms=ttft.p95_ms if ttft is not None else None,
            ttft_p99_ms=ttft.p99_ms if ttft is not None else None,
            e2e_p50_ms=e2e.p50_ms if e2e is not None else None,
            e2e_p95_ms=e2e.p95_ms if e2e is not None else None,
            e2e_p99_ms=e2e.p99_ms if e2e is not None else None,
        )


class _ScrapeError(Exception):
    """A scrape that gave nothing usable; `kind` names why."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class EngineCollector:
    """Scrapes one engine's `/metrics` per `sample()`; `kind` is "vllm" or "sglang" once detected, else None.
    `clock` (monotonic seconds) times the scrapes for the request rate; injectable for tests."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 2.0,
        invalid: InvalidValues | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"engine metrics URL must be http:// or https://, not {url!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.kind: str | None = None
        self.failures = RejectCounter(f"engine scrape of {url} failed", _log)
        self.invalid = invalid if invalid is not None else InvalidValues()
        self._clock = clock
        self._previous: dict[str, _Series] | None = None
        self._previous_at = 0.0
        self._speed = _SpeedWindow()

    def sample(self) -> EngineSample:
        """Scrape now; a failed scrape is counted by kind and gives an all-absent sample."""
        try:
            samples = _parse(self._fetch())
            names = self._detect(samples)
        except _ScrapeError as exc:
            self.failures.count(exc.kind, exc)
            return EngineSample()
        now = self._clock()
        previous, self._previous = self._previous, samples
        elapsed_s, self._previous_at = now - self._previous_at, now
        sample = _read(names, samples, previous, self.invalid, self._speed)
        if sample.e2e is None or elapsed_s <= 0:
            return sample
        rate = self.invalid.check("engine", "requests_per_s", sample.e2e.requests / elapsed_s, REQUESTS)
        return dataclasses.replace(sample, requests_per_s=rate)

    def _fetch(self) -> str:
        request = urllib.request.Request(self.url, headers={"Accept": "text/plain"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body: bytes = response.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise _ScrapeError("http_status", f"HTTP {exc.code}") from None
        except TimeoutError:
            raise _ScrapeError("timeout", f"no answer within {self.timeout_s:g} s") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise _ScrapeError("timeout", f"no answer within {self.timeout_s:g} s") from None
            if isinstance(exc.reason, ConnectionRefusedError):
                raise _ScrapeError("refused", "connection refused") from None
            raise _ScrapeError("unreachable", str(exc.reason)) from None
        except http.client.HTTPException as exc:
            raise _ScrapeError("http_protocol", f"bad HTTP response: {exc!r}") from None
        except OSError as exc:
            raise _ScrapeError("unreachable", str(exc)) from None
        if len(body) > MAX_BODY_BYTES:
            raise _ScrapeError("too_large", f"body over {MAX_BODY_BYTES} bytes")
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _ScrapeError("malformed", f"not UTF-8: {exc}") from None

    def _detect(self, samples: dict[str, _Series]) -> _EngineNames:
        names = next((e for e in _ENGINES if any(name.startswith(e.prefix) for name in samples)), None)
        if names is None:
            raise _ScrapeError("unknown_engine", "no vllm: or sglang: metrics")
        if names.kind != self.kind:
            _log.info("engine at %s detected: %s", self.url, names.kind)
            self.kind = names.kind
            self._previous = None
            self._speed = _SpeedWindow()
        return names


def _parse(text: str) -> dict[str, _Series]:
    """Prometheus text exposition → sample name → value by label set, the ranks of a replica collapsed. Non-finite
    values are kept, so that the bounds count a NaN in a metric the agent reads (and ignore one in any other)."""
    samples: dict[str, _Series] = {}
    ranks: dict[tuple[str, _Labels], tuple[int, ...]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = frozenset((k, v) for k, v in sample.labels.items() if k not in _RANK_LABELS)
                rank = tuple(_rank(sample.labels.get(label, "0")) for label in _RANK_LABELS)
                if ranks.get((sample.name, labels), rank) < rank:
                    continue
                ranks[(sample.name, labels)] = rank
                samples.setdefault(sample.name, {})[labels] = sample.value
    except (ValueError, IndexError, KeyError) as exc:
        raise _ScrapeError("malformed", f"not Prometheus text: {exc}") from None
    return samples


def _rank(value: str) -> int:
    """A rank label's order; a value that is not a number sorts last."""
    return int(value) if value.isdigit() else 1 << 30


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus `histogram_quantile` over cumulative (upper bound, count) buckets sorted by bound, +Inf last.

    Linear interpolation inside the bucket holding rank `q * total` (the first bucket starts at 0); a rank in
    the +Inf bucket gives the highest finite bound. None without observations.
    """
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return None
    counts = list(itertools.accumulate((count for _, count in buckets), max))
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    b = bisect.bisect_left(counts, rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end, count = 0.0, buckets[b][0], counts[b]
    if b > 0:
        start = buckets[b - 1][0]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    return start + (end - start) * (rank / count)


class _SpeedWindow:
    """The scrape the engine's prefill speed is measured from: each measure spans at least `MIN_PREFILL_REQUESTS`
    requests (those whose prefill times it adds up, or first tokens where the prefix-cache counters stand in for
    the computed tokens), over as many scrapes as that takes, and the scrape that ends one starts the next."""

    def __init__(self) -> None:
        self._base: dict[str, _Series] | None = None

    def measure(self, names: _EngineNames, samples: dict[str, _Series], invalid: InvalidValues) -> float | None:
        """The speed since the window's first scrape once it spans `MIN_PREFILL_REQUESTS` requests, else None (also
        without a prefill histogram, or when no prompt token was computed since). An engine whose prefill seconds
        went down since restarted: its window starts again, as it does when a prefill series appears (an engine
        publishes a labelled series from its first observation, SGLang each stage's), which a window can only
        measure from a scrape that has it."""
        if names.prefill_time is None:
            return None
        if self._base is None:
            self._base = samples
            return None
        now, before = _prefill_seconds(names, samples), _prefill_seconds(names, self._base)
        if sum(now.values()) < sum(before.values()) or not now.keys() <= before.keys():
            self._base = samples
            return None
        computed = f"{names.computed_tokens}_sum"
        paired = names.computed_tokens is not None and computed in samples and computed in self._base
        counted = f"{names.prefill_time}_count" if paired else f"{names.ttft}_count"
        if _gained(samples, self._base, counted) < MIN_PREFILL_REQUESTS:
            return None
        seconds = _series_gained(now, before)
        if seconds <= 0:
            return None
        if paired:
            tokens = _gained(samples, self._base, computed)
        else:
            cache = _cache_deltas(samples, self._base, *_cache_counters(names, samples))
            tokens = None if cache is None else cache[0] - cache[1]
        self._base = samples
        if tokens is None:
            return None
        return invalid.check("engine", "prefill_tokens_per_s", tokens / seconds, REQUESTS)


def _prefill_seconds(names: _EngineNames, samples: dict[str, _Series]) -> _Series:
    """The prefill histogram's `_sum` series: those of its prefill stages where it times every stage."""
    series = samples.get(f"{names.prefill_time}_sum", {})
    if names.prefill_stages is None:
        return series
    return {labels: v for labels, v in series.items() if dict(labels).get("stage") in names.prefill_stages}


def _read(
    names: _EngineNames,
    samples: dict[str, _Series],
    previous: dict[str, _Series] | None,
    invalid: InvalidValues,
    speed: _SpeedWindow,
) -> EngineSample:
    def fit(field: str, value: float | None, bound: Bound) -> float | None:
        return None if value is None else invalid.check("engine", field, value, bound)

    def latency(field: str, raw: _RawQuantiles | None) -> LatencyQuantiles | None:
        """The quantiles, or None (counted once) when the count or any quantile is outside its bound."""
        if raw is None:
            return None
        requests, p50, p95, p99 = raw
        if REQUESTS.fit(requests) is None or any(LATENCY_MS.fit(v) is None for v in (p50, p95, p99)):
            invalid.count("engine", field, raw)
            return None
        return LatencyQuantiles(requests=round(requests), p50_ms=p50, p95_ms=p95, p99_ms=p99)

    running = fit("requests_running", _sum(samples.get(names.running)), REQUESTS)
    waiting = fit("requests_waiting", _sum(samples.get(names.waiting)), REQUESTS)
    miss = None
    ttft = e2e = queue = None
    if previous is not None:
        cache = _cache_deltas(samples, previous, *_cache_counters(names, samples))
        if cache is not None:
            queried, hit = cache
            miss = fit("kv_cache_miss_ratio", 1.0 - hit / queried, RATIO)
        ttft = latency("ttft_ms", _quantiles(samples, previous, names.ttft))
        e2e = latency("e2e_ms", _quantiles(samples, previous, names.e2e))
        queue = latency("queue_ms", _quantiles(samples, previous, names.queue))
    return EngineSample(
        kind=names.kind,
        kv_cache_usage_ratio=fit("kv_cache_usage_ratio", _mean(_first(samples, names.kv_usage)), RATIO),
        kv_cache_miss_ratio=miss,
        prefill_tokens_per_s=speed.measure(names, samples, invalid),
        requests_running=None if running is None else round(running),
        requests_waiting=None if waiting is None else round(waiting),
        ttft=ttft,
        e2e=e2e,
        queue=queue,
    )


def _first(samples: dict[str, _Series], names: Sequence[str]) -> _Series | None:
    """The series of the first of `names` the engine publishes."""
    return next((samples[name] for name in names if name in samples), None)


def _mean(series: _Series | None) -> float | None:
    return sum(series.values()) / len(series) if series else None


def _sum(series: _Series | None) -> float | None:
    return sum(series.values()) if series else None


def _cache_counters(names: _EngineNames, samples: dict[str, _Series]) -> tuple[str, str]:
    """The (queries, hits) counter names of the prefix cache this engine publishes: the first pair present."""
    return next((c for c in names.cache_counters if c[0] in samples), names.cache_counters[0])


def _cache_deltas(
    samples: dict[str, _Series], previous: dict[str, _Series], queries_name: str, hits_name: str
) -> tuple[float, float] | None:
    """(Δqueries, Δhits) in prompt tokens, each over its series present in both scrapes that did not restart; None if
    no queries. Each counter is summed over its own series: their labels need not match (SGLang's cached tokens carry
    a `cache_source`, device, host or storage, which its prompt tokens do not). Not clamped: more hits than
    queries, or a NaN counter, gives a miss ratio the ratio's bound drops and counts."""
    queried = _gained(samples, previous, queries_name)
    if not queried > 0:
        return None
    return queried, _gained(samples, previous, hits_name)


def _gained(samples: dict[str, _Series], previous: dict[str, _Series], name: str) -> float:
    """What a counter (or a histogram's `_sum`) gained over the series present in both scrapes that did not
    restart."""
    return _series_gained(samples.get(name, {}), previous.get(name, {}))


def _series_gained(now: _Series, before: _Series) -> float:
    """What the series present in both gained, those that went down (restarted) left out."""
    return sum(v1 - v0 for labels, v1 in now.items() if (v0 := before.get(labels)) is not None and v1 >= v0)


def _quantiles(samples: dict[str, _Series], previous: dict[str, _Series], name: str) -> _RawQuantiles | None:
    """Observations the histogram gained since the previous scrape, and their p50/p95/p99 in ms."""
    now, before = _bucket_series(samples.get(f"{name}_bucket")), _bucket_series(previous.get(f"{name}_bucket"))
    gained: dict[float, float] = {}
    for labels, buckets in now.items():
        old = before.get(labels)
        if old is None:
            continue
        delta = {le: count - old[le] for le, count in buckets.items() if le in old}
        if any(d < 0 for d in delta.values()):
            continue
        for le, d in delta.items():
            gained[le] = gained.get(le, 0.0) + d
    merged = sorted(gained.items())
    p50, p95, p99 = (histogram_quantile(q, merged) for q in _QUANTILES)
    if p50 is None or p95 is None or p99 is None:
        return None
    return merged[-1][1], 1000.0 * p50, 1000.0 * p95, 1000.0 * p99


def _bucket_series(series: _Series | None) -> dict[_Labels, dict[float, float]]:
    """`_bucket` samples grouped by label set without `le`: upper bound → cumulative count."""
    grouped: dict[_Labels, dict[float, float]] = {}
    for labels, count in (series or {}).items():
        le = dict(labels).get("le")
        if le is None:
            continue
        try:
            bound = float(le)
        except ValueError:
            continue
        grouped.setdefault(frozenset(item for item in labels if item[0] != "le"), {})[bound] = count
    return grouped
