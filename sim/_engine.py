"""Emulated inference engine: an OpenAI-compatible HTTP server whose timing follows a per-GPU-class model.

This is an emulator, not an inference engine: it generates placeholder tokens. It speaks the interfaces Prism
reads from a real vLLM V1 server: `/v1/chat/completions` (streaming SSE or JSON), `/metrics` (vLLM V1 names)
and optionally KV events over ZeroMQ (vLLM's frames). It also answers what other routers need from a vLLM
worker, in vLLM's shapes, so they can be run against it (`bench/live_routers.py`): `GET /health` (the SGLang
gateway registers no worker without it), `POST /tokenize` and `POST /v1/chat/completions/render` (the vLLM
router's cache-aware policies tokenize each request on the workers), and `max_completion_tokens` beside
`max_tokens`. The model is described in `docs/sim.md`.

Optionally it admits requests through a batching window, as a server embedding `prismlb.otel.AdaptiveBatchWindow`
would (docs/batch-window.md): requests gather until the window has passed, then go to the model together.

With a session snapshot store (`prismlb.otel.SnapshotStore`, shared by the engines of both model versions) it
takes part in a hot model-version switch (docs/version-switch.md). A request with `X-Session-Token` is answered
with `X-Context-Signature`, the hash of the session's context (its prompt's KV blocks), and once the response
is done, before its last chunk, the engine writes the session's snapshot. A request that carries a signature is
one the routers may have moved here (the routers send the signature the session last sent, which may be an
earlier turn's): when the store holds the session's snapshot, written by another engine, the engine loads the
longest run of its blocks the prompt starts with (chained block hashes: equal ones are the same tokens, so the
same KV) instead of recomputing them, after the time the store took to read it.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from prismlb.otel import (
    AdaptiveBatchWindow,
    BatchWindowSettings,
    BreakerState,
    SessionSnapshot,
    SnapshotStore,
    context_hash,
)
from prismlb.router import CONTEXT_HEADER, SESSION_HEADER
from prismlb.semantics import parse_signature
from prismlb.service import NoDelayHandler, kind_counter, reply_bytes, reply_json

from ._model import KV_BLOCK_TOKENS, PROFILES, EngineModel, Event, GpuClass, Job, Modality
from ._spans import EngineSpans

BLOCK_SIZE_TOKENS = KV_BLOCK_TOKENS
CHARS_PER_TOKEN = 4
MODEL_NAME = "prism-emulated-8b"
MAX_MODEL_LEN = 131_072
"""The context length `/tokenize` reports (an 8B Llama-class model's)."""
MAX_BODY_BYTES = 16 * 1024 * 1024

_PART_MODALITY: dict[str, Modality] = {
    "image_url": "image",
    "input_audio": "audio",
    "video": "video",
    "video_url": "video",
}
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_COMPUTED_BUCKETS = tuple(b for e in range(7) for b in (10**e, 2 * 10**e, 5 * 10**e) if b <= MAX_MODEL_LEN)
"""vLLM's 1-2-5 buckets up to the context length, for the computed-tokens histogram."""
_SNAPSHOT_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.012, 0.016, 0.025, 0.05, 0.1, 0.25)
"""Snapshot write and context load seconds; 8 ms and 12 ms are bounds, so the share under each target is exact."""
CONTEXT_OUTCOMES = ("loaded", "cached", "own", "missing", "stale", "no_room")
"""What became of a request that carried a context signature: its context loaded from the store; already in this
engine's cache; written by this engine (its own cache has it, or lost it to eviction); no snapshot of the session
in the store; a snapshot whose first block the prompt does not start with; no room in the cache."""


# vLLM's KV event encoding (vllm/distributed/kv_events.py): array-like batch, tagged-map events.
class _KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    """Always sent, null without a LoRA, as vLLM does: the vLLM router rejects a batch whose BlockStored lacks it."""


class _BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


@dataclass(eq=False)
class _Batch:
    """Requests handed to the model together: when (model seconds), and how many first tokens are still due;
    the last one ends the batch's run time, which the adaptive window's breaker judges."""

    handed_s: float
    pending: int


@dataclass(eq=False)
class _Stream:
    """One request between the HTTP handler and the model: the model's job and its token ids; `out` gets
    the job at its first token and again when it is finished."""

    job: Job
    tokens: list[int]
    out: queue.Queue[Job] = field(default_factory=queue.Queue)
    batch: _Batch | None = None
    session: str | None = None
    context: str | None = None
    """The signature of the session's context after this request (`context_hash`), which its snapshot holds."""


def prompt_tokens(text: str) -> list[int]:
    """Emulated tokenizer: one token per 4 characters, its id a CRC32 of those characters."""
    data = [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]
    return [zlib.crc32(chunk.encode()) & 0x7FFF_FFFF for chunk in data]


def block_hashes(tokens: list[int]) -> list[int]:
    """Hashes of the prompt's full 16-token blocks, each chained on its parent's (as vLLM's prefix cache)."""
    hashes: list[int] = []
    parent = b""
    for start in range(0, len(tokens) - BLOCK_SIZE_TOKENS + 1, BLOCK_SIZE_TOKENS):
        block = tokens[start : start + BLOCK_SIZE_TOKENS]
        digest = hashlib.sha256(parent + b"".join(t.to_bytes(4, "big") for t in block)).digest()
        parent = digest
        hashes.append(int.from_bytes(digest[:8], "big") >> 1)
    return hashes


class _Metrics:
    """vLLM V1 Prometheus metrics on a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch.", labels, registry=self.registry
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting.", labels, registry=self.registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", labels, registry=self.registry)
        self.queries = Counter("vllm:prefix_cache_queries", "Prompt tokens queried.", labels, registry=self.registry)
        self.hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found cached.", labels, registry=self.registry)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "TTFT.", labels, buckets=_TTFT_BUCKETS, registry=self.registry
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "E2E latency.", labels, buckets=_E2E_BUCKETS, registry=self.registry
        )
        self.prefill = Histogram(
            "vllm:request_prefill_time_seconds",
            "Seconds from admission to first token, observed when the request finishes (as vLLM does).",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.computed = Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens computed in prefill (cached ones left out), observed when the request finishes.",
            labels,
            buckets=_COMPUTED_BUCKETS,
            registry=self.registry,
        )
        self.values = (MODEL_NAME, "0")
        metrics = (
            self.running,
            self.waiting,
            self.kv_usage,
            self.queries,
            self.hits,
            self.ttft,
            self.e2e,
            self.prefill,
            self.computed,
        )
        for metric in metrics:
            metric.labels(*self.values)  # published from the start, at zero


class _SessionMetrics(Collector):
    """The session snapshots' metrics (Prism's names): write and load times, what became of each request that
    carried a context signature, and the store's own counts, read from it at each scrape."""

    def __init__(self, registry: CollectorRegistry, store: SnapshotStore) -> None:
        self._store = store
        self.writes = Histogram(
            "prism_engine_snapshot_write_seconds",
            "Seconds to write a session's snapshot to the store after its response.",
            buckets=_SNAPSHOT_BUCKETS,
            registry=registry,
        )
        self.loads = Histogram(
            "prism_engine_context_load_seconds",
            "Seconds to load a moved session's context: reading its snapshot, then caching its blocks.",
            buckets=_SNAPSHOT_BUCKETS,
            registry=registry,
        )
        self.outcomes = Counter(
            "prism_engine_context_requests",
            "Requests that carried a context signature, by what became of their context.",
            ["outcome"],
            registry=registry,
        )
        self.write_failures = Counter(
            "prism_engine_snapshot_write_failures", "Snapshots the store could not take.", registry=registry
        )
        for outcome in CONTEXT_OUTCOMES:
            self.outcomes.labels(outcome)
        registry.register(self)

    def collect(self) -> Iterable[Metric]:
        yield kind_counter(
            "prism_engine_snapshot_store_errors",
            "The snapshot store's failures by kind (session id out of bounds, write, read, corrupt file, sweep).",
            self._store.rejects.counts(),
        )
        yield CounterMetricFamily(
            "prism_engine_snapshot_store_evicted",
            "Snapshots this engine's store removed for its count or age bound.",
            value=self._store.evicted,
        )


class _Server(ThreadingHTTPServer):
    """The engine's HTTP server, with a listen backlog of a production server's order: socketserver's default of
    5 resets connections that arrive in a burst while the accepting thread waits for a busy core."""

    daemon_threads = True
    request_queue_size = 1024


class _WindowMetrics(Collector):
    """The batching window's metrics, read from the engine and its window at each scrape (Prism's names, in
    Prometheus conventions: seconds, `_total` counters, the breaker's state as one 0/1 series per state)."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        engine, window = self._engine, self._engine.window
        yield GaugeMetricFamily(
            "prism_engine_batch_window_seconds",
            "Model seconds the engine gathers requests before handing them to the model (0: each on arrival).",
            value=engine.batch_window_s(),
        )
        yield CounterMetricFamily("prism_engine_batches", "Batches handed to the model.", value=engine.batches)
        if window is None:
            return
        yield CounterMetricFamily(
            "prism_engine_batch_overruns",
            "Batches whose run time reached the overrun threshold.",
            value=window.overruns,
        )
        current = window.state
        state = GaugeMetricFamily(
            "prism_engine_batch_breaker_state",
            "1 for the batch breaker's current state, 0 for the others.",
            labels=["state"],
        )
        for s in BreakerState:
            state.add_metric([s.value], float(s is current))
        yield state
        counts = window.transition_counts()
        transitions = CounterMetricFamily(
            "prism_engine_batch_breaker_transitions",
            "Batch breaker transitions by state left and entered.",
            labels=["from", "to"],
        )
        for source in BreakerState:
            for target in BreakerState:
                if source is not target:
                    transitions.add_metric([source.value, target.value], counts.get(f"{source}->{target}", 0))
        yield transitions


class EmulatedEngine:
    """An emulated vLLM-like engine on `url`; `start()` serves, `close()` stops.

    Its timing is `EngineModel` (the cluster replay's model too) run against the wall clock: model seconds
    are wall seconds divided by `time_scale`. `clock` is that wall clock (monotonic seconds); a test passes its
    own and calls `step()` where `start()` would run it against the clock.

    `batch_window`: None hands each request to the model as it arrives; a number of model seconds is a fixed
    window; `BatchWindowSettings` make an `AdaptiveBatchWindow` on the engine's model clock (`window`). A
    window opens with the first request that finds none gathering and, once passed, hands every request
    gathered to the model at once. The adaptive window observes each request's wait (arrival to admission)
    and each batch's run time (hand-over to its last first token); while its breaker is open the window is 0.

    `model_version` names the version this engine serves (in its answers' `X-Emulated-Model-Version` header and
    its snapshots); `snapshots` is the session snapshot store it shares with the other version's engines (see
    the module docstring), None for none.
    """

    def __init__(
        self,
        gpu_class: GpuClass = "a100",
        host: str = "127.0.0.1",
        port: int = 0,
        kv_events_endpoint: str | None = None,
        time_scale: float = 1.0,
        otlp_endpoint: str | None = None,
        batch_window: BatchWindowSettings | float | None = None,
        clock: Callable[[], float] = time.monotonic,
        model_version: str = "v1",
        snapshots: SnapshotStore | None = None,
    ) -> None:
        if gpu_class not in PROFILES:
            raise ValueError(f"gpu_class must be one of {sorted(PROFILES)}, not {gpu_class!r}")
        if not time_scale > 0:
            raise ValueError(f"time_scale must be positive, not {time_scale}")
        if not 0 < len(model_version) <= 256:
            raise ValueError(f"model_version must be 1 to 256 characters, not {model_version!r}")
        self.gpu_class = gpu_class
        self.model_version = model_version
        self.snapshots = snapshots
        """The session snapshot store shared with the other version's engines (None: no snapshots)."""
        self.profile = PROFILES[gpu_class]
        self.time_scale = time_scale
        self._clock = clock
        self.metrics = _Metrics()
        self.model = EngineModel(self.profile)
        self.window: AdaptiveBatchWindow | None = None
        """The adaptive window when `batch_window` gave its settings."""
        self._fixed_window_s = 0.0
        if isinstance(batch_window, BatchWindowSettings):
            self.window = AdaptiveBatchWindow(batch_window, clock=self.now_s)
        elif batch_window is not None:
            if not (math.isfinite(batch_window) and batch_window >= 0):
                raise ValueError(f"a fixed batch window must be a finite number of seconds >= 0, not {batch_window}")
            self._fixed_window_s = float(batch_window)
        self._gathering: list[_Stream] = []
        self._deadline = math.inf
        """When the gathering batch is handed to the model (model seconds; inf: none gathering)."""
        self.batches = 0
        """Batches handed to the model."""
        if batch_window is not None:
            self.metrics.registry.register(_WindowMetrics(self))
        self._sessions = _SessionMetrics(self.metrics.registry, snapshots) if snapshots is not None else None
        self._cond = threading.Condition()
        self._stopping = False
        self._kv_seq = 0
        self.spans: EngineSpans | None = None
        """OTLP spans of finished requests to `otlp_endpoint` (the local agent), see `_spans.py`."""
        if otlp_endpoint is not None:
            self.spans = EngineSpans(
                otlp_endpoint, gpu_class=gpu_class, profile=self.profile, time_scale=time_scale, model=MODEL_NAME
            )
        self._pub: zmq.Socket | None = None
        if kv_events_endpoint is not None:
            self._pub = zmq.Context.instance().socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(kv_events_endpoint)
        self._server = _Server((host, port), _handler(self))
        self._threads = [
            threading.Thread(target=self._server.serve_forever, name="emulated-engine-http", daemon=True),
            threading.Thread(target=self._drive, name="emulated-engine-model", daemon=True),
        ]

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> EmulatedEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Stop serving and driving; also for an engine never started (driven by `step()`)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._threads[0].ident is not None:  # shutdown() waits for serve_forever, so only once it ran
            self._server.shutdown()
        self._server.server_close()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
        if self._pub is not None:
            self._pub.close(linger=0)
        if self.spans is not None:
            self.spans.close()

    def now_s(self) -> float:
        """Emulated time: the clock's (wall) time divided by `time_scale`."""
        return self._clock() / self.time_scale

    def batch_window_s(self, now: float | None = None) -> float:
        """Model seconds a batch opened now would gather: the adaptive window's, the fixed one, or 0."""
        return self.window.window_s(now) if self.window is not None else self._fixed_window_s

    def submit(
        self,
        text: str,
        parts: Mapping[str, int],
        max_tokens: int,
        session: str | None = None,
        signature: str | None = None,
    ) -> _Stream:
        """Queue a request (gathered into the open batch when the engine has a window); raises ValueError when
        its prompt can never fit the KV cache.

        With a snapshot store, `session` (the request's `X-Session-Token`) gets the signature of its context
        (`_Stream.context`) and a snapshot once answered (`snapshot`); `signature` (its `X-Context-Signature`)
        marks a session the routers may have moved here, whose context is loaded when another engine computed it
        (`_context`), the store read done before the request is queued."""
        tokens = prompt_tokens(text)
        job = Job(tuple(block_hashes(tokens)), len(tokens), max_tokens, self.profile.media_s(parts), 0.0)
        if not self.model.fits(job):
            raise ValueError(f"prompt and output exceed the KV cache ({self.model.capacity_blocks} blocks)")
        stream = _Stream(job, tokens)
        job.tag = stream
        started = time.perf_counter()
        outcome: str | None = None
        context: Job | None = None
        if self.snapshots is not None and session:
            if job.blocks:
                stream.session = session
                stream.context = context_hash(session, job.blocks, job.prompt_tokens + job.output_tokens)
            if signature:
                outcome, context = self._context(session, stream)
        with self._cond:
            now = self.now_s()
            job.arrival_s = now
            self._due(now)
            if context is not None:
                if all(self.model.cached(block) for block in context.blocks):
                    outcome = "cached"
                else:
                    outcome = "loaded" if self.model.load_context(context) else "no_room"
            self._gathering.append(stream)
            if len(self._gathering) == 1:
                self._deadline = now + self.batch_window_s(now)
            if self._deadline <= now:
                self._hand_over(now)
            else:
                self._gauges()
            self._cond.notify()
        if outcome is not None and self._sessions is not None:
            self._sessions.outcomes.labels(outcome).inc()
            if outcome == "loaded":
                self._sessions.loads.observe(time.perf_counter() - started)
        return stream

    def _context(self, session: str, stream: _Stream) -> tuple[str, Job | None]:
        """What the store holds for a request carrying a context signature (store I/O: no lock held): the
        outcome so far (`CONTEXT_OUTCOMES`), and the context to load, the prompt's leading blocks the session's
        snapshot holds (None: nothing to load). Only a snapshot another engine wrote is loaded: this engine's
        own context is in its cache, or was evicted from it as any other. The signature only says that the
        session has a context somewhere: the routers send the one the session last sent, maybe a turn behind
        the snapshot, whose blocks decide what is loaded."""
        assert self.snapshots is not None
        snapshot = self.snapshots.load(session)
        if snapshot is None:
            return "missing", None
        if snapshot.engine == self.url:
            return "own", None
        blocks = stream.job.blocks
        common = 0
        for ours, theirs in zip(blocks, snapshot.blocks, strict=False):
            if ours != theirs:
                break
            common += 1
        if not common:
            return "stale", None
        context = Job(blocks[:common], common * BLOCK_SIZE_TOKENS, 0, 0.0, 0.0)
        context.tag = _Stream(context, stream.tokens)  # its KV events carry the prompt's tokens, as an admission's
        return "loaded", context

    def snapshot(self, stream: _Stream) -> None:
        """Write the session's snapshot once its request is answered, before the response's last chunk, so that
        the session's next request finds it wherever it goes; the write's time is observed, a failure counted."""
        if self.snapshots is None or stream.session is None or stream.context is None:
            return
        job = stream.job
        snapshot = SessionSnapshot(
            session=stream.session,
            context_hash=stream.context,
            last_active_unix_s=time.time(),
            token_offset=job.prompt_tokens + job.output_tokens,
            blocks=job.blocks,
            model_version=self.model_version,
            engine=self.url,
        )
        started = time.perf_counter()
        saved = self.snapshots.save(snapshot)
        elapsed = time.perf_counter() - started
        assert self._sessions is not None
        if saved:
            self._sessions.writes.observe(elapsed)
        else:
            self._sessions.write_failures.inc()

    def step(self) -> float:
        """Process what is due at the clock's time: the model's events, then the gathered batch if its window
        has passed. The model time of the next thing due (inf: nothing)."""
        with self._cond:
            self._due(self.now_s())
            self._publish()
            return min(self.model.next_event_s(), self._deadline)

    def _drive(self) -> None:
        """Run the model against the wall clock: wake at its next due event, the end of the gathering window or
        a new submission."""
        with self._cond:
            while not self._stopping:
                due = self.step()
                self._cond.wait(None if due == math.inf else max(0.0, (due - self.now_s()) * self.time_scale))

    def _due(self, now: float) -> None:
        """The model's events due by `now`, then the gathered batch if its window has passed (lock held)."""
        self._handle(self.model.advance(now))
        if self._deadline <= now:
            self._hand_over(now)

    def _hand_over(self, now: float) -> None:
        """Every gathered request to the model, as one batch (lock held); `submit` checked that each fits."""
        gathered, self._gathering = self._gathering, []
        self._deadline = math.inf
        batch = _Batch(now, len(gathered))
        self.batches += 1
        for stream in gathered:
            stream.batch = batch
            self._handle(self.model.submit(stream.job, now))

    def _handle(self, events: list[Event]) -> None:
        """Metrics, the window's reports and stream notifications for the model's events (lock held)."""
        metrics, values = self.metrics, self.metrics.values
        for kind, job, t in events:
            stream = job.tag
            assert isinstance(stream, _Stream)
            if kind == "admitted":
                metrics.queries.labels(*values).inc(job.prompt_tokens)
                metrics.hits.labels(*values).inc(job.cached_tokens)
                if self.window is not None:
                    self.window.observe(t - job.arrival_s, t)
            elif kind == "first_token":
                metrics.ttft.labels(*values).observe(t - job.arrival_s)
                stream.out.put(job)
                batch = stream.batch
                assert batch is not None
                batch.pending -= 1
                if not batch.pending and self.window is not None:
                    self.window.record_batch(t - batch.handed_s, t)
            else:
                metrics.e2e.labels(*values).observe(t - job.arrival_s)
                assert job.admitted_s is not None and job.first_token_s is not None
                metrics.prefill.labels(*values).observe(job.first_token_s - job.admitted_s)
                metrics.computed.labels(*values).observe(job.prompt_tokens - job.cached_tokens)
                stream.out.put(job)
        self._gauges()
        if events:
            self._cond.notify()

    def _gauges(self) -> None:
        """The scheduler gauges; waiting counts the requests gathering for a batch too (lock held)."""
        metrics, values = self.metrics, self.metrics.values
        metrics.running.labels(*values).set(self.model.running)
        metrics.waiting.labels(*values).set(len(self.model.waiting) + len(self._gathering))
        metrics.kv_usage.labels(*values).set(self.model.kv_usage)

    def _publish(self) -> None:
        """Send the model's cache changes as one KV event batch in vLLM's frames (driver thread, lock held)."""
        stored, removed = self.model.stored, self.model.removed
        if self._pub is None or not (stored or removed):
            stored.clear()
            removed.clear()
            return
        events: list[Any] = []
        if removed:
            events.append(_BlockRemoved(list(removed), "GPU"))
        for job, new in stored:
            stream = job.tag
            assert isinstance(stream, _Stream)
            hit = len(job.blocks) - len(new)
            parent = job.blocks[hit - 1] if hit else None
            tokens = stream.tokens[hit * BLOCK_SIZE_TOKENS : len(job.blocks) * BLOCK_SIZE_TOKENS]
            events.append(_BlockStored(list(new), parent, tokens, BLOCK_SIZE_TOKENS, None, "GPU", None))
        stored.clear()
        removed.clear()
        payload = msgspec.msgpack.encode(_KVEventBatch(time.time(), events))
        self._pub.send_multipart([b"", self._kv_seq.to_bytes(8, "big"), payload])
        self._kv_seq += 1

    def stream_tokens(self, stream: _Stream) -> Iterator[int]:
        """Yield 1 per output token at the model's pace: the first at the first token, the last at the end."""
        job = stream.out.get()
        yield 1
        count = job.output_tokens
        first, finish = job.first_token_s, job.finish_s
        assert first is not None and finish is not None
        for i in range(1, count):
            delay = (first + (finish - first) * i / (count - 1) - self.now_s()) * self.time_scale
            if delay > 0:
                time.sleep(delay)
            yield 1
        stream.out.get()


def _content(messages: Any) -> tuple[str, Mapping[str, int]]:
    """The prompt text of OpenAI chat messages and the count of media parts by modality."""
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    texts: list[str] = []
    parts: dict[str, int] = {}
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif isinstance(kind, str) and kind in _PART_MODALITY:
                    modality = _PART_MODALITY[kind]
                    parts[modality] = parts.get(modality, 0) + 1
                else:
                    raise ValueError(f"unsupported content part {kind!r}")
        elif content is not None:
            raise ValueError("message content must be a string or a list of parts")
    return "\n".join(texts), parts


def request_tokens(request: Mapping[str, Any]) -> list[int]:
    """The prompt token ids the engine computes for an OpenAI request body (chat `messages`, or a completion
    `prompt` as text): the ids its KV events carry. A caller that tokenizes as the engine does (here, with the
    emulated tokenizer; on a real cluster, the model's tokenizer and chat template) gives its router block hashes
    that match the engines' cached blocks (`prismlb.router.PrismTransport(tokenize=...)`). Raises ValueError
    for a body without a prompt."""
    if "messages" in request:
        text, _ = _content(request["messages"])
    elif isinstance(request.get("prompt"), str):
        text = request["prompt"]
    else:
        raise ValueError("either prompt (a string) or messages is required")
    return prompt_tokens(text)


def _max_tokens(request: Mapping[str, Any]) -> int:
    """The output length asked for: `max_completion_tokens` (OpenAI's current name, which the SGLang gateway
    sends) before `max_tokens`, as vLLM reads them; 16 when neither is set."""
    value = request.get("max_completion_tokens")
    if value is None:
        value = request.get("max_tokens")
    max_tokens = int(value or 16)
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    return max_tokens


def _usage(stream: _Stream) -> dict[str, Any]:
    job = stream.job
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.output_tokens,
        "total_tokens": job.prompt_tokens + job.output_tokens,
        "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
    }


def _handler(engine: EmulatedEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(NoDelayHandler):
        protocol_version = "HTTP/1.1"
        server_version = "PrismEmulatedEngine/1"

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the emulator does not log each request."""

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/health":
                reply_bytes(self, 200, b"")
                return
            if path != "/metrics":
                reply_json(self, 404, {"error": {"message": "not found"}})
                return
            reply_bytes(self, 200, generate_latest(engine.metrics.registry), CONTENT_TYPE_LATEST)

        def do_POST(self) -> None:
            # The body is read whatever the path: a reply before it would leave its bytes on a keep-alive
            # connection, to be parsed as the next request.
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                reply_json(self, 413, {"error": {"message": "body too large"}})
                return
            raw = self.rfile.read(length)
            path = self.path.split("?")[0]
            if path == "/v1/chat/completions":
                self._chat(raw)
            elif path == "/tokenize":
                self._tokenize(raw)
            elif path == "/v1/chat/completions/render":
                self._render(raw)
            else:
                reply_json(self, 404, {"error": {"message": "not found"}})

        def _tokenize(self, raw: bytes) -> None:
            """vLLM's `/tokenize`: a `prompt` or chat `messages` to the emulated tokenizer's ids."""
            try:
                tokens = request_tokens(json.loads(raw))
            except (ValueError, AttributeError, TypeError) as exc:
                reply_json(self, 400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
                return
            answer = {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens, "token_strs": None}
            reply_json(self, 200, answer)

        def _render(self, raw: bytes) -> None:
            """vLLM's `/v1/chat/completions/render`: the chat request as the generate request it becomes, its
            prompt as token ids (the same ids the KV events carry), nothing run."""
            try:
                request = json.loads(raw)
                text, _ = _content(request.get("messages"))
                max_tokens = _max_tokens(request)
            except (ValueError, AttributeError, TypeError) as exc:
                reply_json(self, 400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
                return
            reply_json(
                self,
                200,
                {
                    "request_id": f"chatcmpl-{uuid.uuid4().hex}",
                    "token_ids": prompt_tokens(text),
                    "features": None,
                    "sampling_params": {"max_tokens": max_tokens},
                    "model": request.get("model") or MODEL_NAME,
                    "stream": bool(request.get("stream")),
                    "stream_options": request.get("stream_options"),
                    "cache_salt": None,
                    "priority": 0,
                    "kv_transfer_params": None,
                },
            )

        def _chat(self, raw: bytes) -> None:
            try:
                request = json.loads(raw)
                text, parts = _content(request.get("messages"))
                session, signature = self.headers.get(SESSION_HEADER), self.headers.get(CONTEXT_HEADER)
                seq = engine.submit(text, parts, _max_tokens(request), session, signature)
            except (ValueError, AttributeError, TypeError) as exc:
                reply_json(self, 400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
                return
            modality, _ = parse_signature(self.headers.get("X-Modality-Signature"))
            rid = f"chatcmpl-emulated-{uuid.uuid4().hex}"
            created = int(time.time())
            headers = {"X-Emulated-Slice": modality.value, "X-Emulated-Model-Version": engine.model_version}
            if seq.context is not None:
                headers[CONTEXT_HEADER] = seq.context
            if request.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                for _ in engine.stream_tokens(seq):
                    chunk = {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": MODEL_NAME,
                        "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}],
                    }
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                engine.snapshot(seq)
                final = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": MODEL_NAME,
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                    "usage": _usage(seq),
                }
                self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
                self.close_connection = True
                self._spans_done(seq, parts)
                return
            for _ in engine.stream_tokens(seq):
                pass
            engine.snapshot(seq)
            reply_json(
                self,
                200,
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": MODEL_NAME,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "tok " * seq.job.output_tokens},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": _usage(seq),
                },
                headers,
            )
            self._spans_done(seq, parts)

        def _spans_done(self, seq: _Stream, parts: Mapping[str, int]) -> None:
            """The finished request's OTLP spans, when the engine exports them."""
            if engine.spans is not None:
                engine.spans.request_done(
                    seq.job,
                    signature=self.headers.get("X-Modality-Signature"),
                    peer=self.client_address,
                    local=self.connection.getsockname(),
                    media=parts,
                )

    return Handler
