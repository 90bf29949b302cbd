"""The agent with (real-format) vLLM metrics endpoints and KV-event publishers, one per DP rank: what reaches the
vector and the KV stream, and the settings that point the agent at them."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from prismlb.agent import resolve_config
from prismlb.router import block_hashes
from prismlb.semantics import bloom_contains, health
from prismlb.wire import MAX_VECTOR_BYTES, ConfigError, KvBlocks, NodeVector, decode

from .conftest import free_port, reporting_agent, wait_for
from .test_engine import MetricsServer, fixture
from .test_engine_formats import VllmMetrics
from .test_kv_events import Engine, array_stored, free_port_pair, stored


def test_engine_and_kv_events_reach_the_node_vector(ctx: zmq.Context) -> None:
    metrics = MetricsServer()
    metrics.queue(fixture("vllm_metrics_1.txt"))
    metrics.queue(fixture("vllm_metrics_2.txt"))
    kv_endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = Engine(ctx, kv_endpoint)
    registry = CollectorRegistry()
    settings = {"node_id": "vllm-node", "engine_url": metrics.url, "kv_events": kv_endpoint}
    try:
        with reporting_agent(ctx, registry, **settings) as (_, pull):
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
            judged = health(m)  # as the brain judges the vector
            assert "kv_cache_miss_ratio" in judged.alarms, "0.4 is over the design's 18% alarm"
            assert judged.score < 1.0
            assert last.latency["engine"].ttft_p99_ms == pytest.approx(875.0)
            assert last.kv is not None and bloom_contains(last.kv, 12) and not bloom_contains(last.kv, 99)
            assert len(msgspec.msgpack.encode(last)) < MAX_VECTOR_BYTES
            assert registry.get_sample_value("prism_agent_kv_blocks") == 3
            assert registry.get_sample_value("prism_agent_node_kv_cache_miss_ratio") == pytest.approx(0.4)
            assert registry.get_sample_value(
                "prism_agent_ttft_seconds", {"slice": "engine", "quantile": "0.99"}
            ) == pytest.approx(0.875)
            assert registry.get_sample_value("prism_agent_alarm", {"dimension": "kv_cache_miss_ratio"}) is None
            assert registry.get_sample_value("prism_agent_source_failures_total", {"source": "engine"}) == 0
    finally:
        engine.close()
        metrics.close()


def test_kv_dp_ranks_from_flag_env_and_file_checked_against_the_endpoints(tmp_path: Path) -> None:
    assert resolve_config(argparse.Namespace(), {}).kv_dp_ranks == 1
    path = tmp_path / "agent.toml"
    path.write_text('kv_events = "tcp://127.0.0.1:5557"\nkv_replay = "tcp://127.0.0.1:5657"\nkv_dp_ranks = 4\n')
    assert resolve_config(argparse.Namespace(config=str(path)), {}).kv_dp_ranks == 4
    env = {"PRISM_KV_DP_RANKS": "2"}
    assert resolve_config(argparse.Namespace(config=str(path)), env).kv_dp_ranks == 2
    assert resolve_config(argparse.Namespace(config=str(path), kv_dp_ranks="8"), env).kv_dp_ranks == 8
    for args, env, message in (
        (argparse.Namespace(kv_dp_ranks="0"), {}, "--kv-dp-ranks: KV-event DP ranks must be 1 to 64, got 0"),
        (argparse.Namespace(), {"PRISM_KV_DP_RANKS": "two"}, "PRISM_KV_DP_RANKS: KV-event DP ranks 'two'"),
        (argparse.Namespace(kv_dp_ranks="2"), {}, "--kv-dp-ranks given without --kv-events"),
        (argparse.Namespace(kv_events="ipc:///run/kv", kv_dp_ranks="2"), {}, "must be tcp://HOST:PORT"),
        (argparse.Namespace(kv_events="tcp://127.0.0.1:65535", kv_dp_ranks="2"), {}, "port 65536, past 65535"),
    ):
        with pytest.raises(ConfigError, match=message):
            resolve_config(args, env)
    # One rank needs no port after the endpoint's, so any endpoint will do.
    assert resolve_config(argparse.Namespace(kv_events="ipc:///run/kv"), {}).kv_dp_ranks == 1


def test_every_dp_rank_and_vllm_0_8_metrics_reach_the_brain(ctx: zmq.Context) -> None:
    metrics = MetricsServer()
    vllm = VllmMetrics(old=True, new=False)
    vllm.engine(0, running=3, usage=[0.3], queried=[100], hit=[0])
    vllm.engine(1, running=2, usage=[0.5], queried=[100], hit=[0])
    metrics.queue(vllm.text())
    port = free_port_pair()
    ranks = [Engine(ctx, f"tcp://127.0.0.1:{port + r}", rank=r) for r in range(2)]
    settings = {
        "node_id": "vllm-dp-node",
        "engine_url": metrics.url,
        "kv_events": f"tcp://127.0.0.1:{port}",
        "kv_dp_ranks": 2,
    }
    try:
        with reporting_agent(ctx, **settings) as (_, pull):
            for engine in ranks:
                engine.wait_subscriber()
            ranks[0].publish(array_stored([11, 12], first_token=0))
            ranks[1].publish(array_stored([21], first_token=500))
            expected = set(block_hashes(list(range(32)), 16) + block_hashes(list(range(500, 516)), 16))
            prism: set[int] = set()
            vectors: list[NodeVector] = []

            def received() -> bool:
                while pull.poll(0):
                    message = decode(pull.recv_multipart(), (NodeVector, KvBlocks), MAX_VECTOR_BYTES)
                    if isinstance(message, KvBlocks):
                        if message.reset:
                            prism.clear()
                        prism.difference_update(message.removed)
                        prism.update(message.stored)
                    else:
                        vectors.append(message)
                kv = vectors[-1].kv if vectors else None
                return prism == expected and kv is not None and kv.blocks == 3

            wait_for(received, what="both ranks' blocks in the vector and the KV stream")
            last = vectors[-1]
            assert last.kv is not None and all(bloom_contains(last.kv, block) for block in (11, 12, 21))
            assert last.metrics.requests_running == 5
            assert last.metrics.kv_cache_usage_ratio == pytest.approx(0.4), "vllm:gpu_cache_usage_perc, both engines"
    finally:
        for engine in ranks:
            engine.close()
        metrics.close()
