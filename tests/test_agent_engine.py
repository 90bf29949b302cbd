"""The agent with a (real-format) vLLM metrics endpoint and KV-event publisher: what reaches the vector."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from prismlb.agent import Agent, AgentConfig
from prismlb.wire import MAX_VECTOR_BYTES, KvBlocks, NodeVector, bloom_contains, decode

from .conftest import free_port
from .test_engine import MetricsServer, fixture
from .test_kv_events import Engine, stored


def test_engine_and_kv_events_reach_the_node_vector(ctx: zmq.Context) -> None:
    metrics = MetricsServer()
    metrics.queue(fixture("vllm_metrics_1.txt"))
    metrics.queue(fixture("vllm_metrics_2.txt"))
    kv_endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = Engine(ctx, kv_endpoint)
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    config = AgentConfig(
        node_id="vllm-node",
        brain=f"tcp://127.0.0.1:{port}",
        period_s=0.25,
        ebpf=False,
        otlp_grpc_port=0,
        otlp_http_port=0,
        engine_url=metrics.url,
        kv_events=kv_endpoint,
    )
    stop = threading.Event()
    registry = CollectorRegistry()
    agent = Agent(config, registry)
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        engine.wait_subscriber()
        engine.publish(stored([11, 12, 13]))
        deadline = time.monotonic() + 15
        last: NodeVector | None = None
        while time.monotonic() < deadline:
            if pull.poll(500):
                message = decode(pull.recv_multipart(), (NodeVector, KvBlocks), MAX_VECTOR_BYTES)
                if isinstance(message, KvBlocks):  # the agent's KV stream shares the brain's endpoint
                    continue
                last = message
                if last.metrics.kv_cache_miss_ratio is not None and last.kv is not None and last.kv.blocks == 3:
                    break
        assert last is not None
        m = last.metrics
        assert (m.requests_running, m.requests_waiting) == (12, 6)
        assert m.kv_cache_usage_ratio == pytest.approx(0.4)
        assert m.kv_cache_miss_ratio == pytest.approx(0.4), "miss ratio from counter deltas over the 5 s window"
        assert "kv_cache_miss_ratio" in last.alarms, "0.4 is over the article's 18% alarm"
        assert m.health_score is not None and m.health_score < 1.0
        assert last.latency["engine"].ttft_p99_ms == pytest.approx(875.0)
        assert last.kv is not None and bloom_contains(last.kv, 12) and not bloom_contains(last.kv, 99)
        assert len(msgspec.msgpack.encode(last)) < MAX_VECTOR_BYTES
        assert registry.get_sample_value("prism_agent_kv_blocks") == 3
        assert registry.get_sample_value("prism_agent_node_metric", {"metric": "kv_cache_miss_ratio"}) == pytest.approx(
            0.4
        )
        assert registry.get_sample_value("prism_agent_alarm", {"dimension": "kv_cache_miss_ratio"}) == 1.0
        assert registry.get_sample_value("prism_agent_source_failures_total", {"source": "engine"}) == 0
    finally:
        stop.set()
        thread.join(timeout=10)
        engine.close()
        metrics.close()
        pull.close()
