"""The emulated inference engine over real HTTP and ZeroMQ: streaming, timing model, vLLM metrics and KV events."""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from prismlb.agent._engine import MIN_PREFILL_REQUESTS, EngineCollector
from prismlb.agent._kv_events import KvEventSubscriber
from prismlb.semantics import bloom_contains
from prismlb.sim import EmulatedEngine, block_hashes, prompt_tokens
from prismlb.sim._model import PROFILES

from .conftest import free_port, wait_for

SCALE = 0.2


@pytest.fixture
def engine() -> Iterator[EmulatedEngine]:
    with EmulatedEngine("a100", time_scale=SCALE) as e:
        yield e


def body(
    text: str, max_tokens: int = 4, stream: bool = False, parts: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content: Any = [{"type": "text", "text": text}, *parts] if parts else text
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def ttft(url: str, payload: dict[str, Any]) -> float:
    """Wall seconds from sending a streamed request to its first chunk."""
    start = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json={**payload, "stream": True}, timeout=10) as r:
        first: float | None = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: "):
                first = time.monotonic() - start
    assert first is not None
    return first


def test_streamed_and_plain_completion(engine: EmulatedEngine) -> None:
    url = engine.url + "/v1/chat/completions"
    headers = {"X-Modality-Signature": "image+text"}
    with httpx.stream("POST", url, json=body("hello " * 20, 5, stream=True), headers=headers, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["x-emulated-slice"] == "vlm"
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:5]] == ["tok "] * 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    plain = httpx.post(url, json=body("x" * 400, 3), timeout=10)
    assert plain.status_code == 200
    answer = plain.json()
    assert answer["object"] == "chat.completion"
    assert answer["usage"]["prompt_tokens"] == 100
    assert answer["usage"]["completion_tokens"] == 3
    assert httpx.post(url, json={"messages": "nope"}, timeout=10).status_code == 400


def test_ttft_grows_with_prompt_and_shrinks_on_reused_prefix(engine: EmulatedEngine) -> None:
    short = ttft(engine.url, body("a short prompt", 1))
    long_text = "".join(f"line {i} of a long shared document. " for i in range(4500))  # ~39k tokens, 3.9 s model
    long_cold = ttft(engine.url, body(long_text, 1))
    long_warm = ttft(engine.url, body(long_text + " a new question", 1))
    # wall-clock times: the request's own overhead (tenths of a second on a loaded host) is in each, so the
    # prompt is long enough that its prefill (0.78 s at this time scale) outweighs it
    assert long_cold > short + 0.5
    assert long_warm - short < (long_cold - short) / 3
    warm = httpx.post(engine.url + "/v1/chat/completions", json=body(long_text, 1), timeout=10).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm["usage"]["prompt_tokens"] - 16


def test_image_part_adds_encoder_time() -> None:
    with EmulatedEngine("l40s", time_scale=1.0) as e:
        text = ttft(e.url, body("describe", 1))
        video = {"type": "video", "video": {"url": "file:///v.mp4"}}
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        with_image = ttft(e.url, body("describe again", 1, parts=[image, image, video]))
    assert with_image - text > 0.3  # two images (45 ms each) and a video (350 ms) on an L40S


def requests_running(engine: EmulatedEngine) -> float | None:
    """The engine's running-requests gauge, read from its registry (the collector's own scrapes are the test's)."""
    labels = dict(zip(("model_name", "engine"), engine.metrics.values, strict=True))
    return engine.metrics.registry.get_sample_value("vllm:num_requests_running", labels)


def test_metrics_detected_as_vllm(engine: EmulatedEngine) -> None:
    collector = EngineCollector(engine.url + "/metrics")
    first = collector.sample()
    assert collector.kind == "vllm"
    assert first.requests_running == 0 and first.requests_waiting == 0
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(httpx.post, engine.url + "/v1/chat/completions", json=body(f"q{i}", 200), timeout=30)
            for i in range(4)
        ]
        wait_for(lambda: requests_running(engine) == 4, what="the four requests to run")
        busy = collector.sample()
        assert all(f.result().status_code == 200 for f in futures)
    assert busy.requests_running == 4
    assert busy.kv_cache_usage_ratio is not None and busy.kv_cache_usage_ratio > 0
    after = collector.sample()
    assert after.requests_running == 0
    windows = [s.ttft.requests for s in (busy, after) if s.ttft is not None]
    assert sum(windows) == 4


def test_kv_events_seen_by_subscriber() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with EmulatedEngine("h100", kv_events_endpoint=endpoint, time_scale=SCALE) as e:
        with KvEventSubscriber(endpoint) as subscriber:
            subscriber.start()
            # The SUB socket joins; the subscriber shows no sign of it, and warm-up prompts would move the
            # first batch's sequence number, which is checked below.
            time.sleep(0.3)
            text = "the same system prompt " * 40
            httpx.post(e.url + "/v1/chat/completions", json=body(text, 1), timeout=10)
            wait_for(lambda: subscriber.stats().blocks > 0, 3)
            hashes = block_hashes(prompt_tokens(text))
            stats = subscriber.stats()
            summary = subscriber.summary()
    assert stats.blocks == len(hashes) > 0
    assert stats.last_seq == 0
    assert summary is not None and summary.block_size_tokens == 16
    assert not subscriber.failures.counts()
    assert all(bloom_contains(summary, h) for h in hashes)


def test_concurrent_requests_are_batched(engine: EmulatedEngine) -> None:
    url = engine.url + "/v1/chat/completions"
    start = time.monotonic()
    httpx.post(url, json=body("one", 150), timeout=30)  # ~0.5 s wall: model time dominates HTTP overheads
    single = time.monotonic() - start
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: httpx.post(url, json=body(f"req {i}", 150), timeout=30), range(8)))
    together = time.monotonic() - start
    assert all(a.status_code == 200 for a in answers)
    assert together < 2 * single < 8 * single


# --- what other routers need from a vLLM worker (bench/live_routers.py runs them against the emulator) ---


def test_health_answers_as_vllm_and_unknown_paths_404(engine: EmulatedEngine) -> None:
    health = httpx.get(engine.url + "/health", timeout=10)
    assert health.status_code == 200 and health.content == b""
    for probe in ("/server_info", "/model_info", "/get_server_info", "/get_model_info"):
        assert httpx.get(engine.url + probe, timeout=10).status_code == 404


def test_tokenize_answers_as_vllm(engine: EmulatedEngine) -> None:
    text = "a prompt of some length " * 5
    by_prompt = httpx.post(engine.url + "/tokenize", json={"model": "m", "prompt": text}, timeout=10).json()
    assert by_prompt == {"count": 30, "max_model_len": 131_072, "tokens": prompt_tokens(text), "token_strs": None}
    by_messages = httpx.post(
        engine.url + "/tokenize", json={"messages": [{"role": "user", "content": text}]}, timeout=10
    )
    assert by_messages.json()["tokens"] == prompt_tokens(text)
    assert httpx.post(engine.url + "/tokenize", json={"model": "m"}, timeout=10).status_code == 400


@contextlib.contextmanager
def kv_events(endpoint: str) -> Iterator[zmq.Socket]:
    """A SUB socket on an engine's KV-event `endpoint`, taking every topic, each receive waiting 3 s at most;
    given once its handshake with the engine's PUB has succeeded: its subscription follows at once on that
    connection, well ahead of what a request sent then makes the engine publish."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 3000)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        assert monitor.poll(10_000), "no handshake with the engine's KV-event publisher"
        yield sub
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)


def test_render_gives_the_token_ids_the_kv_events_carry() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    text = "the same system prompt " * 40
    with EmulatedEngine("a100", kv_events_endpoint=endpoint, time_scale=SCALE) as e:
        with kv_events(endpoint) as sub:
            payload = {**body(text, 5, stream=True), "stream_options": {"include_usage": True}}
            rendered = httpx.post(e.url + "/v1/chat/completions/render", json=payload, timeout=10).json()
            httpx.post(e.url + "/v1/chat/completions", json=body(text, 1), timeout=10)
            _, _, frame = sub.recv_multipart()
    assert rendered["token_ids"] == prompt_tokens(text)
    assert rendered["sampling_params"]["max_tokens"] == 5
    assert rendered["model"] == "m" and rendered["stream"] is True and rendered["features"] is None
    assert rendered["request_id"].startswith("chatcmpl-")
    stored = msgspec.msgpack.decode(frame)[1][0]
    assert stored["type"] == "BlockStored"
    assert stored["token_ids"] == rendered["token_ids"][: len(stored["block_hashes"]) * 16]


def test_block_stored_carries_lora_name_and_the_agent_still_accepts_it() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with EmulatedEngine("h100", kv_events_endpoint=endpoint, time_scale=SCALE) as e:
        with kv_events(endpoint) as sub, KvEventSubscriber(endpoint) as subscriber:
            subscriber.start()
            time.sleep(0.3)  # the subscriber's SUB socket joins: it shows no sign of it (`kv_events` waits for its own)
            httpx.post(e.url + "/v1/chat/completions", json=body("a shared prefix " * 30, 1), timeout=10)
            _, _, frame = sub.recv_multipart()
            wait_for(lambda: subscriber.stats().blocks > 0, 3)
            blocks = subscriber.stats().blocks
            failures = subscriber.failures.counts()
    stored = msgspec.msgpack.decode(frame)[1][0]
    assert "lora_name" in stored and stored["lora_name"] is None
    assert blocks == len(stored["block_hashes"]) > 0
    assert not failures


def test_max_completion_tokens_is_read_before_max_tokens(engine: EmulatedEngine) -> None:
    url = engine.url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    newer = httpx.post(url, json={"messages": messages, "max_completion_tokens": 3}, timeout=10).json()
    both = httpx.post(url, json={"messages": messages, "max_completion_tokens": 2, "max_tokens": 7}, timeout=10).json()
    assert newer["usage"]["completion_tokens"] == 3
    assert both["usage"]["completion_tokens"] == 2


def test_404_leaves_a_keep_alive_connection_usable(engine: EmulatedEngine) -> None:
    host, port = engine.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(
            "POST", "/v1/not-served", body=json.dumps(body("x" * 2000)), headers={"Content-Type": "application/json"}
        )
        missing = conn.getresponse()
        missing.read()
        sock = conn.sock
        conn.request(
            "POST", "/tokenize", body=json.dumps({"prompt": "abcdefgh"}), headers={"Content-Type": "application/json"}
        )
        after = conn.getresponse()
        answer = json.loads(after.read())
        assert conn.sock is sock  # the same connection carried both requests
    finally:
        conn.close()
    assert missing.status == 404
    assert after.status == 200 and answer["count"] == 2


def test_prefill_speed_the_agent_reads_is_the_gpu_classs(engine: EmulatedEngine) -> None:
    collector = EngineCollector(engine.url + "/metrics")
    collector.sample()
    # One at a time, one output token: no decode batch shares the prefill steps; as many requests as a speed needs
    # (`MIN_PREFILL_REQUESTS`).
    for i in range(MIN_PREFILL_REQUESTS):
        reply = httpx.post(engine.url + "/v1/chat/completions", json=body(f"prompt {i} " * 300, 1), timeout=30)
        assert reply.status_code == 200
    speed = collector.sample().prefill_tokens_per_s
    assert speed == pytest.approx(PROFILES["a100"].prefill_tokens_per_s, rel=1e-6)
