"""bench/kernel_health.py's building blocks: its request schedule and tables on made-up runs, and, for real (root,
`ip`, `nft`), an emulated engine in its own namespace on both its ports and the two loss rules, each dropping
only the client's side of the server port. The bench itself (agents, brain, minutes of load) is not run here."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("kernel_health")


def test_the_schedule_is_the_same_for_every_variant_and_each_prompt_distinct(bench: ModuleType) -> None:
    requests = bench.schedule(20.0, 3.0, 64, seed=7)
    assert requests == bench.schedule(20.0, 3.0, 64, seed=7)
    assert [at for at, _ in requests] == [i / 20.0 for i in range(60)]
    assert len({prompt.split()[1] for _, prompt in requests}) == 60  # distinct from the first words on
    assert all(len(prompt) >= 64 * 4 for _, prompt in requests)


def _run(bench: ModuleType, variant: str, lossy_latency_ms: float, lossy_every: int) -> object:
    """20 s: warm-up to 5 s, loss 5-15 s; a request every 0.1 s, every `lossy_every`th to node-1, which answers
    in `lossy_latency_ms` during the loss (the others in 100 ms); node-1's weight 0.5 after 10 s."""
    run = bench.Run(variant, 1, "node-1", loss_start_s=5.0, loss_end_s=15.0)
    for i in range(200):
        sent = i / 10
        lossy = i % lossy_every == 0
        latency = lossy_latency_ms if lossy and 5.0 <= sent < 15.0 else 100.0
        run.results.append(bench.Result(sent, sent + latency / 1000, "node-1" if lossy else "node-2"))
    for i in range(40):
        weight = 0.5 if i / 2 > 10.0 and variant == "full" else 1.0
        alarms = ("tcp_retransmits_per_conn",) if variant == "full" and i / 2 >= 6.0 else ()
        stalls = {"node-1": 60.0} if variant == "full" and i / 2 >= 8.0 else {}
        own = {"node-1": 40.0 if i / 2 < 12.0 else 25.0} if variant == "full" and i / 2 >= 7.0 else {}
        sample = bench.Sample(i / 2, {"node-1": weight, "node-2": 1.0}, stalls, 0.6, alarms, i // 2, own)
        run.samples.append(sample)
    return run


def test_the_tables_show_the_loss_window_the_ratios_and_the_timeline(bench: ModuleType) -> None:
    full, bare = _run(bench, "full", 400.0, 4), _run(bench, "no-health", 400.0, 2)
    rows = bench.table([full, bare], 300.0)
    assert rows[0].startswith("| brain | round | requests | errors | p50 ms | p99 ms | max ms | mean ms | over 300 ms")
    # 100 requests in the window; node-1 got 25 of them (50 without health: the median halfway), each in 400 ms;
    # 0.5 at its lowest; a 60 ms stall published from 8 s; the router's own stall 40 ms at most
    full_row = "| full | 1 | 100 | 0 | 100 | 400 | 400 | 175 | 25 (25) | 25.0% | 0.50 / 0.50 | 60 | 40 | 0.60 ("
    assert rows[2].startswith(full_row)
    bare_row = "| no-health | 1 | 100 | 0 | 250 | 400 | 400 | 250 | 50 (50) | 50.0% | 1.00 / 1.00 | 0 | 0 |"
    assert rows[3].startswith(bare_row)
    ratios = bench.ratios([full, bare], 300.0)
    assert ratios[2] == "| full / no-health | 0.40 | 1.00 | 1.00 | 0.70 | 0.50 | 0.50 |"
    assert bench.timeline(full) == (
        "full round 1: node-1 weight at the loss start | every 5 s after 1.00 | 1.00 0.50; its share 24% 26%"
    )


def _require_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip(f"namespaces and nftables need root; running as uid {os.geteuid()}")
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed (iproute2, nftables)")


def _answers(address: str, port: int) -> bool:
    """Whether a new connection to the port gets an HTTP answer within half a second."""
    try:
        with urllib.request.urlopen(f"http://{address}:{port}/health", timeout=0.5) as response:
            return response.status == 200
    except OSError:
        return False


def test_the_engine_serves_in_its_namespace_and_each_loss_rule_drops_only_the_clients_side(
    bench: ModuleType, tmp_path: Path
) -> None:
    """With every packet dropped, new connections to the server port fail while the metrics port (the agent's)
    still answers; once the rule is removed the server port answers again. Both directions."""
    _require_tools()
    with contextlib.ExitStack() as stack:
        (node,) = bench.start_engines(stack, 1, "a100", 1.0, tmp_path)
        address = node.ns.address
        body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 2}
        request = urllib.request.Request(
            f"http://{address}:{bench.PORT}/v1/chat/completions", json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 2
        with urllib.request.urlopen(f"http://{address}:{bench.METRICS_PORT}/metrics", timeout=5) as response:
            assert b"vllm:e2e_request_latency_seconds_count" in response.read()
        for direction in bench.DIRECTIONS:
            loss = bench.Loss(node, 100.0, direction)
            loss.apply()
            try:
                assert not _answers(address, bench.PORT), direction
                assert _answers(address, bench.METRICS_PORT), direction
            finally:
                loss.remove()
            assert loss.dropped is not None and loss.dropped > 0, direction
            assert _answers(address, bench.PORT), direction
            with pytest.raises(RuntimeError):  # the table is gone
                loss.run(["nft", "list", "table", "inet", loss.name])
        with socket.create_connection((address, bench.PORT), timeout=2):
            pass
