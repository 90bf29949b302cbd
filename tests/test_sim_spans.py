"""The emulated engine's OTLP spans, received by the agent's real OTLP receiver on loopback."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from prismlb.agent._otlp_receiver import EPHEMERAL_PORT, OtlpReceiver
from prismlb.agent._signals import SpanSignals
from prismlb.otel._conventions import ATTR_GEN_AI_TTFT_S, ATTR_SLICE, ATTR_STAGE
from prismlb.otel._spans import request_span_name
from prismlb.sim import EmulatedEngine
from prismlb.sim._engine import MODEL_NAME

from .conftest import free_port, wait_for


class Received:
    """What the receiver delivered: every span with its resource attributes; also fed to the agent's signals."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Span]] = []
        self.signals = SpanSignals()
        self._lock = threading.Lock()

    def __call__(self, request: ExportTraceServiceRequest) -> None:
        self.signals.on_traces(request)
        with self._lock:
            for rs in request.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((resource, span) for span in ss.spans)

    def wait(self, count: int, timeout_s: float = 10.0) -> list[tuple[dict[str, Any], Span]]:
        def arrived() -> bool:
            with self._lock:
                return len(self.spans) >= count

        assert wait_for(arrived, timeout_s), f"the receiver got {len(self.spans)} spans, expected {count}"
        with self._lock:
            return list(self.spans)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def attrs(span: Span) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in span.attributes}


@pytest.fixture
def receiver() -> Iterator[tuple[OtlpReceiver, Received]]:
    received = Received()
    rx = OtlpReceiver(received, lambda _m: None, grpc_port=EPHEMERAL_PORT, http_port=EPHEMERAL_PORT)
    rx.start()
    yield rx, received
    rx.shutdown()


def stream(
    url: str, text: str, max_tokens: int, signature: str | None, parts: list[dict[str, Any]] | None = None
) -> tuple[float, dict[str, Any], int]:
    """(wall seconds to the first chunk, the final usage, the client's local port) of a streamed request."""
    content: Any = [{"type": "text", "text": text}, *parts] if parts else text
    messages = [{"role": "user", "content": content}]
    payload = {"model": "m", "messages": messages, "max_tokens": max_tokens, "stream": True}
    headers = {"X-Modality-Signature": signature} if signature else {}
    first: float | None = None
    usage: dict[str, Any] = {}
    with httpx.Client(timeout=20) as client:
        start = time.monotonic()
        with client.stream("POST", url + "/v1/chat/completions", json=payload, headers=headers) as r:
            assert r.status_code == 200
            network_stream = r.extensions["network_stream"]
            port = network_stream.get_extra_info("client_addr")[1]
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if first is None:
                    first = time.monotonic() - start
                if line != "data: [DONE]":
                    usage = json.loads(line[6:]).get("usage") or usage
    assert first is not None
    return first, usage, port


def by_name(spans: list[tuple[dict[str, Any], Span]]) -> dict[str, Span]:
    return {span.name: span for _, span in spans}


REQUEST_SPAN = request_span_name("chat", MODEL_NAME)
"""The emulated engine's request span: the GenAI name `{operation} {model}`."""


def ttft_ms(span: Span) -> float:
    return float(attrs(span)[ATTR_GEN_AI_TTFT_S]) * 1000


def test_streamed_request_gives_server_request_and_stage_spans_over_grpc(
    receiver: tuple[OtlpReceiver, Received],
) -> None:
    rx, received = receiver
    endpoint = f"http://127.0.0.1:{rx.grpc_port}"
    with EmulatedEngine("a100", otlp_endpoint=endpoint, time_scale=1.0) as engine:
        assert engine.spans is not None and engine.spans.protocol == "grpc"
        image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        ttft_s, usage, client_port = stream(engine.url, "describe this picture " * 200, 6, "image+text", image)
        spans = received.wait(6)  # server, request, queue, encode, prefill, decode
        engine_port = int(engine.url.rsplit(":", 1)[1])
    named = by_name(spans)
    assert set(named) == {
        "POST /v1/chat/completions",
        REQUEST_SPAN,
        "prism.stage.queue",
        "prism.stage.encode",
        "prism.stage.prefill",
        "prism.stage.decode",
    }
    resource = spans[0][0]
    assert resource["service.name"] == "prism-emulated-engine"
    assert resource["prism.sim.gpu_class"] == "a100"
    assert isinstance(resource["process.pid"], int)

    server, request = named["POST /v1/chat/completions"], named[REQUEST_SPAN]
    assert server.kind == Span.SpanKind.SPAN_KIND_SERVER
    server_attrs = attrs(server)
    assert server_attrs["network.peer.address"] == "127.0.0.1"
    assert server_attrs["network.peer.port"] == client_port  # the 4-tuple the agent joins on
    assert server_attrs["network.local.port"] == engine_port
    assert server_attrs["http.response.status_code"] == 200
    assert not server.parent_span_id

    assert request.kind == Span.SpanKind.SPAN_KIND_INTERNAL
    assert request.parent_span_id == server.span_id and request.trace_id == server.trace_id
    request_attrs = attrs(request)
    assert request_attrs["prism.span"] == "request"
    assert request_attrs["gen_ai.provider.name"] == "vllm"
    assert request_attrs["gen_ai.request.model"] == MODEL_NAME
    assert request_attrs[ATTR_SLICE] == "vlm"
    assert request_attrs["prism.modality.signature"] == "image+text"
    assert request_attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert request_attrs["gen_ai.usage.output_tokens"] == 6
    assert request_attrs["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    # The model's TTFT on an idle A100: the image encoder (30 ms) and the prompt at 10,000 tokens/s ...
    first_ms = ttft_ms(request)
    assert first_ms == pytest.approx(30 + usage["prompt_tokens"] / 10, abs=0.5)
    # ... which is what the client measured, less the HTTP round trip and the engine's wake-up.
    measured_ms = ttft_s * 1000
    assert measured_ms - max(50, 0.3 * measured_ms) <= first_ms <= measured_ms + 5, (first_ms, measured_ms)

    stages = [named[f"prism.stage.{s}"] for s in ("queue", "encode", "prefill", "decode")]
    for stage in stages:
        assert stage.parent_span_id == request.span_id
        assert attrs(stage)[ATTR_SLICE] == "vlm"
        assert attrs(stage)[ATTR_STAGE] == stage.name.rsplit(".", 1)[1]
    assert stages[0].start_time_unix_nano == request.start_time_unix_nano
    for before, after in zip(stages, stages[1:], strict=False):
        assert before.end_time_unix_nano == after.start_time_unix_nano
    assert stages[-1].end_time_unix_nano == request.end_time_unix_nano == server.end_time_unix_nano
    first_token_ns = stages[2].end_time_unix_nano - request.start_time_unix_nano
    assert abs(first_token_ns / 1e6 - first_ms) < 0.01
    assert attrs(stages[1])["prism.sim.media"] == ["image"]

    latency = received.signals.latency()  # the agent reads them as the worker library's spans
    assert set(latency) == {"vlm"}
    assert latency["vlm"].requests == 1
    assert latency["vlm"].ttft_p50_ms == pytest.approx(first_ms)


def test_spans_over_http_in_model_time_with_prefix_hits(
    receiver: tuple[OtlpReceiver, Received], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    rx, received = receiver
    scale = 0.5
    text = "a shared system prompt for every turn " * 60
    with EmulatedEngine("l40s", otlp_endpoint=f"http://127.0.0.1:{rx.http_port}", time_scale=scale) as engine:
        assert engine.spans is not None and engine.spans.protocol == "http/protobuf"
        first = stream(engine.url, text, 3, None)
        second = stream(engine.url, text + "and a follow-up question", 3, "text")
        spans = received.wait(10)  # five per text request (no encode stage)
    assert rx.requests["http"] >= 1
    requests = sorted((span for _, span in spans if span.name == REQUEST_SPAN), key=lambda s: s.start_time_unix_nano)
    assert len(requests) == 2
    for (ttft_s, usage, _), span in zip((first, second), requests, strict=True):
        span_attrs = attrs(span)
        assert span_attrs[ATTR_SLICE] == "llm"
        assert span_attrs["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        uncached = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        assert ttft_ms(span) == pytest.approx(uncached / 6, abs=0.5)  # an L40S prefills 6,000 tokens/s
        model_ms = ttft_s * 1000 / scale  # spans are in model time: wall / time_scale
        assert model_ms - max(100, 0.3 * model_ms) <= ttft_ms(span) <= model_ms + 10, (span_attrs, model_ms)
    assert "prism.modality.signature" not in attrs(requests[0])
    assert attrs(requests[1])["gen_ai.usage.cache_read.input_tokens"] > 0
    assert not any(span.name == "prism.stage.encode" for _, span in spans)


def test_an_unreachable_agent_neither_blocks_requests_nor_the_close() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    engine = EmulatedEngine("h100", otlp_endpoint=dead, time_scale=0.1)
    engine.start()
    try:
        ttft_s, usage, _ = stream(engine.url, "hello " * 40, 4, None)
        assert usage["completion_tokens"] == 4
    finally:
        started = time.monotonic()
        engine.close()
    assert time.monotonic() - started < 10
    assert engine.spans is not None and engine.spans.emitted == 1


def test_no_spans_without_an_endpoint() -> None:
    with EmulatedEngine("a100", time_scale=0.1) as engine:
        assert engine.spans is None
        stream(engine.url, "hello " * 40, 2, None)
