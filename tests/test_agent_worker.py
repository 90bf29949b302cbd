"""An inference server using prismlb.otel exports to the agent; what reaches the node vector."""

from __future__ import annotations

import time

import pytest
import zmq

from prismlb.otel import setup
from prismlb.semantics import health
from prismlb.wire import MAX_VECTOR_BYTES, NodeVector, decode

from .conftest import free_port, reporting_agent, wait_for
from .test_otel import _segment

MIB = 1 << 20


def test_worker_spans_and_allocator_metrics_reach_the_vector(ctx: zmq.Context) -> None:
    http_port = free_port()
    # Free blocks of 8 and 4 MiB around allocations: α = 8/12, fragmentation 1/3 (under the 45% alarm).
    snapshot = [_segment(0, [(8 * MIB, "inactive"), (16 * MIB, "active_allocated"), (4 * MIB, "inactive")])]
    # A 2 s period: the agent's first tick, where every source reads first (the CPU-preprocessing P95 then only
    # every 10 s), comes after the worker's spans and metrics, so one of the first vectors carries them all.
    with reporting_agent(ctx, node_id="worker-node", otlp_http_port=http_port, period_s=2.0) as (agent, pull):
        wait_for(
            lambda: agent.trace_path is not None and agent.trace_path.receiver is not None,
            what="the agent's OTLP receiver",
        )
        telemetry = setup(
            "worker",
            endpoint=f"http://127.0.0.1:{http_port}",
            protocol="http/protobuf",
            export_interval_s=0.5,
            snapshot_provider=lambda: snapshot,
        )
        with telemetry:
            for i in range(40):
                with telemetry.request("image+text") as request:
                    with request.stage("image_decode"):
                        time.sleep(0.002 if i % 10 else 0.03)
                    with request.stage("prefill"):
                        time.sleep(0.001)
                    request.mark_first_token()
            telemetry.force_flush()
            deadline = time.monotonic() + 20
            last: NodeVector | None = None
            while time.monotonic() < deadline:
                if pull.poll(500):
                    last = decode(pull.recv_multipart(), (NodeVector,), MAX_VECTOR_BYTES)
                    m = last.metrics
                    if m.cpu_preproc_p95_ms is not None and m.gpu_mem_frag_ratio is not None and "vlm" in last.latency:
                        break
        assert last is not None
        assert last.latency["vlm"].requests == 40
        assert last.latency["vlm"].ttft_p50_ms is not None and last.latency["vlm"].ttft_p50_ms >= 3.0
        assert last.metrics.requests_per_s == pytest.approx(4.0)  # 40 requests in the 10 s window
        assert 20.0 <= last.metrics.cpu_preproc_p95_ms <= 200.0, "P95 of image decode, not of prefill"  # type: ignore[operator]
        assert last.metrics.gpu_mem_frag_ratio == pytest.approx(1 / 3)
        # the worker's figures raise no alarm; the host's CPU and memory are the machine's running the test
        alarms = health(last.metrics).alarms  # as the brain judges the vector
        assert set(alarms) <= {"cpu_util_ratio", "mem_util_ratio"}, alarms
