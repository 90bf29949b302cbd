"""`prism demo`: the workload it builds from the trace, the key-move accounting, and a reduced run end to end."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from prismlb.cli import main
from prismlb.demo import (
    BLOCK_CHARS,
    TOKEN_SCALE,
    load_requests,
    moved_keys,
    prefix_cache_bound,
)
from prismlb.router import Router
from prismlb.semantics import Slice
from prismlb.sim import MOONCAKE_TRACE, block_hashes, prompt_tokens, traces_dir
from prismlb.wire import RoutingTable, SliceTable, TableNode

needs_trace = pytest.mark.skipif(
    not (traces_dir() / MOONCAKE_TRACE).is_file(), reason=f"no Mooncake trace at {traces_dir()}"
)


def table(version: int, weights: dict[str, float]) -> RoutingTable:
    nodes = [
        TableNode(node_id=n, endpoint=f"http://127.0.0.1:{9000 + i}", weight=w)
        for i, (n, w) in enumerate(sorted(weights.items()))
    ]
    return RoutingTable(epoch=1, version=version, issued_unix_s=0.0, slices=[SliceTable(name=Slice.LLM, nodes=nodes)])


@needs_trace
def test_requests_keep_the_traces_prefix_sharing_at_a_sixteenth_of_the_size() -> None:
    requests = load_requests(200)
    assert len(requests) == 200
    assert requests[0].at_s == 0 and all(a.at_s <= b.at_s for a, b in zip(requests, requests[1:], strict=False))
    by_block: dict[int, str] = {}
    for r in requests:
        assert 32 * (len(r.blocks) - 1) < len(r.text) // 4 <= 32 * len(r.blocks)
        for i, block in enumerate(r.blocks):
            text = r.text[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS]
            if len(text) == BLOCK_CHARS:
                assert by_block.setdefault(block, text) == text, "equal hash_ids must give equal text"
    # Every Mooncake request starts with block 0: the engine's first two 16-token blocks are shared by all.
    first, second = requests[0], requests[1]
    shared = block_hashes(prompt_tokens(first.text))[:2]
    assert block_hashes(prompt_tokens(second.text))[:2] == shared
    # Requests whose first four trace blocks are equal share the affinity key; others do not.
    for a in requests:
        for b in requests:
            if len(a.blocks) >= 4 and len(b.blocks) >= 4:
                assert (a.key == b.key) == (a.blocks[:4] == b.blocks[:4])
    assert max(r.max_tokens for r in requests) <= max(2, round(2000 / TOKEN_SCALE))
    assert 0 < prefix_cache_bound(requests) < 0.5


def test_only_the_victims_keys_move_when_it_leaves_the_ring() -> None:
    keys = [f"{i:016x}" for i in range(4000)]
    before = table(1, {"a": 0.5, "b": 0.5, "c": 0.5, "d": 0.5})
    report = moved_keys(before, table(2, {"a": 0.5, "b": 0.5, "c": 0.5}), keys, "d")
    assert report.keys == 4000
    assert report.moved == report.from_victim > 600
    assert report.unexplained == 0 and report.by_weight == 0
    # A weight change at the same time moves keys to or from that node only.
    report = moved_keys(before, table(3, {"a": 0.5, "b": 0.5, "c": 0.25}), keys, "d")
    assert report.reweighted == ("c",)
    assert report.by_weight > 0 and report.unexplained == 0
    assert report.moved == report.from_victim + report.by_weight
    assert Router.from_table(before).route(keys[0]).node_id in "abcd"


def _summary_numbers(out: str) -> tuple[int, int, int, int]:
    match = re.search(r"requests: (\d+) answered, (\d+) errors \((\d+) around the kill, other errors: (\d+)\)", out)
    assert match, out
    return tuple(int(g) for g in match.groups())  # type: ignore[return-value]


@needs_trace
def test_a_reduced_demo_runs_end_to_end() -> None:
    """12 s of replay: the kill at 6 s is out of the table about 3 s later (3 silent agent periods), well before
    the last request at 12 s and the replies after it."""
    result = subprocess.run(
        [sys.executable, "-m", "prismlb.cli", "demo", "--requests", "60", "--duration", "12", "--no-ebpf", "--plain"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "cluster up in" in out
    assert "killed a100-3 (engine and agent" in out
    answered, errors, at_kill, other = _summary_numbers(out)
    assert answered + errors == 60, out
    assert other == 0 and errors == at_kill, out
    assert answered >= 50, out
    assert "0 not sent and 0 unfinished" in out
    tables = re.search(r"brain: routing tables (\d+)\.(\d+) to (\d+)\.(\d+) \((\d+) distinct", out)
    assert tables and int(tables.group(5)) >= 2, out
    hit = re.search(r"prefix-cache hit rate: ([\d.]+)% of (\d+) prompt tokens", out)
    assert hit and float(hit.group(1)) > 0, out
    assert re.search(r"kill: a100-3 at .* out of the table at .* without a weight change: 0", out), out
    asked = re.search(r"router: (\d+) round trips to the engines' /tokenize for a request's token ids", out)
    assert asked and int(asked.group(1)) >= 30, out  # the engines' KV events reach the router: it asks for ids
    for node in ("h100-1", "a100-2", "l40s-4"):
        spans = re.search(rf"agent {node}: (\d+) spans received over OTLP, (\d+) KV events", out)
        assert spans and int(spans.group(1)) > 0 and int(spans.group(2)) > 0, out
    assert "logs kept" not in out


@pytest.mark.skipif(not (traces_dir() / "azure").is_dir(), reason=f"no Azure traces at {traces_dir()}")
def test_a_trace_without_prefixes_gives_prompts_that_share_nothing() -> None:
    requests = load_requests(300, "azure-conv")
    assert len(requests) == 300 and requests[0].at_s == 0
    blocks = [b for r in requests for b in r.blocks]
    assert len(blocks) == len(set(blocks)), "each prompt its own blocks"
    assert prefix_cache_bound(requests) == 0.0
    assert len({r.text[:BLOCK_CHARS] for r in requests}) == 300
    with pytest.raises(ValueError, match=r"mm has \d+ requests with media; the live engines take text alone"):
        load_requests(100, "mm")


def test_a_workload_family_or_a_trace_file_gives_requests_as_a_shared_trace_does(tmp_path: Path) -> None:
    requests = load_requests(400, "tenants:2")
    assert len(requests) == 400 and requests[0].at_s == 0
    assert 0.0 < prefix_cache_bound(requests) < 1.0, "a tenant's system prompt is shared, questions are not"
    first = {r.text[:BLOCK_CHARS] for r in requests}
    assert 1 < len(first) < 400, "tenants share their first block of text"
    trace = tmp_path / "mine.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 32, "hash_ids": [7, 8]},
        {"timestamp": 250, "input_length": 1536, "output_length": 16, "hash_ids": [7, 8, 9]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    mine = load_requests(10, trace)
    assert [r.blocks for r in mine] == [(7, 8), (7, 8, 9)]
    assert mine[1].text.startswith(mine[0].text), "the second prompt continues the first"
    assert [r.max_tokens for r in mine] == [2, 2]
    with pytest.raises(ValueError, match="unknown workload family 'nonesuch'"):
        load_requests(1, "nonesuch")


@needs_trace
def test_ctrl_c_stops_every_process_of_the_demo() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "prismlb.cli", "demo", "--requests", "400", "--duration", "30", "--no-ebpf", "--plain"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As from a terminal: a suite started in the background by a shell without job control inherits SIGINT
        # ignored, and the demo would inherit that too.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    children: list[psutil.Process] = []
    seen: list[str] = []
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        seen.append(line)
        if "replaying" in line:
            children = psutil.Process(proc.pid).children(recursive=True)
            break
        assert time.monotonic() < deadline, "the demo did not start replaying"
    assert len(children) >= 9, "".join(seen)[-3000:]  # brain, 4 engines, 4 agents
    for line in proc.stdout:  # until a status line shows requests in flight: the interrupt comes mid-replay
        seen.append(line)
        busy = re.search(r" in flight (\d+) ", line)
        if busy and int(busy.group(1)) > 0:
            break
        assert time.monotonic() < deadline, "no request went out"
    proc.send_signal(signal.SIGINT)
    rest = proc.stdout.read()
    assert proc.wait(timeout=30) == 130, rest
    assert "interrupted; stopping every process" in rest
    assert "== summary" in rest
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"still running: {alive}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--duration", "500"], "--duration must be within 5..90 seconds, got 500"),
        (["--duration", "1"], "--duration must be within 5..90 seconds, got 1"),
        (["--requests", "1"], "--requests must be at least 2"),
        (["--load", "3"], "--load must be in (0, 2]"),
    ],
)
def test_out_of_range_options_are_usage_errors_not_clamped(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *args]) == 2
    assert capsys.readouterr().err == f"prism demo: {message}\n"
