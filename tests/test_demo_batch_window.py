"""`prism demo --batch-window`: the flag reaching every engine process's command line, and the summary's batch
window lines built from a real emulated engine's `/metrics` after the demo's own load generator drove its adaptive
window's breaker open and closed again. The engines are started by the demo's cluster (its `spawn` and
`free_port`), without brain or agents: no whole demo runs here."""

from __future__ import annotations

import asyncio
import io
import re
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prismlb.cli import build_parser, main
from prismlb.demo import BATCH_WINDOWS, Cluster, Demo, DemoRequest, read_window
from prismlb.demo._cli import options
from prismlb.demo._run import Options, cluster_for, run
from prismlb.demo._view import summary
from prismlb.otel import BatchWindowSettings
from prismlb.semantics import quantile
from tests._helpers_http import QuietHandler
from tests.conftest import wait_for

TIME_SCALE = 0.1
"""Wall seconds per model second: the breaker's 5 model seconds open pass in half a wall second."""
BIG_TOKENS = 8000
"""A prompt whose prefill alone (0.4 s on an H100) is an overrun (300 ms or more)."""
CHARS_PER_TOKEN = 4


def started(cluster: Cluster) -> None:
    """Start the cluster's engines only (no brain, no agents) and wait until each serves."""
    cluster.start(prism=False)
    for node in cluster.nodes:
        log = cluster.logs / f"engine-{node.node_id}.log"
        wait_for(lambda log=log: "engine on" in log.read_text(), what=f"engine {node.node_id} to serve")


def engine_flag(cluster: Cluster) -> list[str]:
    """Each engine process's `--batch-window` value, read from its command line."""
    values = []
    for node in cluster.nodes:
        assert node.engine is not None
        cmdline = psutil.Process(node.engine.pid).cmdline()
        values.append(cmdline[cmdline.index("--batch-window") + 1])
    return values


def test_the_default_is_the_adaptive_window_and_a_bad_choice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert options(build_parser().parse_args(["demo"])).batch_window == "adaptive"
    assert BATCH_WINDOWS == ("adaptive", "fixed", "none")
    with pytest.raises(SystemExit) as refused:
        main(["demo", "--batch-window", "off"])
    assert refused.value.code == 2
    assert "invalid choice: 'off'" in capsys.readouterr().err
    out = io.StringIO()
    assert run(Options(batch_window="sometimes"), out) == 2
    assert out.getvalue() == "prism demo: batch window must be one of adaptive, fixed, none, not 'sometimes'\n"


@pytest.mark.parametrize(("choice", "flag"), [("fixed", "fixed"), ("none", "off")])
def test_the_flag_reaches_every_engines_command_line(choice: str, flag: str, tmp_path: Path) -> None:
    chosen = options(build_parser().parse_args(["demo", "--batch-window", choice, "--nodes", "l40s"]))
    cluster = cluster_for(chosen, 1.0, tmp_path)
    try:
        started(cluster)
        assert engine_flag(cluster) == [flag]
        reports = [read_window(httpx.get(f"{n.url}/metrics", timeout=5).text) for n in cluster.nodes]
    finally:
        cluster.close()
    if choice == "none":
        assert reports == [None]
    else:
        (report,) = reports
        assert report is not None
        assert report.window_s == BatchWindowSettings().max_window_s  # the fixed window is the adaptive maximum
        assert report.state is None and report.overruns is None and report.batches == 0


def request(index: int, at_s: float, tokens: int) -> DemoRequest:
    """A request whose first block is its own (no prefix-cache hit from another), of `tokens` emulated tokens."""
    text = f"demo batch window request {index:04d} ".ljust(tokens * CHARS_PER_TOKEN, "w")
    return DemoRequest(index, at_s, text, 2, f"key-{index}")


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_the_summary_shows_the_engines_window_breaker_transitions_and_the_ttft_p99(tmp_path: Path) -> None:
    """Three prompts that each overrun open the breaker (3 in a row); 5 model seconds (0.5 s) later it is half-open,
    and the short last request's batch is the trial that closes it. The replay is the demo's own load generator."""
    chosen = options(build_parser().parse_args(["demo", "--nodes", "h100"]))
    cluster = cluster_for(chosen, TIME_SCALE, tmp_path)
    requests = [request(0, 0.0, BIG_TOKENS), request(1, 0.3, BIG_TOKENS), request(2, 0.6, BIG_TOKENS)]
    requests.append(request(3, 1.5, 100))
    out = io.StringIO()
    node = cluster.nodes[0]
    try:
        started(cluster)
        assert engine_flag(cluster) == ["adaptive"]
        demo = Demo(cluster, None, requests, 1.5, None, out, False, time.monotonic() + 60)
        demo.start = time.monotonic()
        asyncio.run(demo.run(httpx.AsyncClient(base_url=node.url, timeout=30)))
        asyncio.run(demo.collect_engines())
        raw = samples(httpx.get(f"{node.url}/metrics", timeout=5).text)
    finally:
        cluster.close()
    assert [r.error for r in demo.results] == [None] * 4, out.getvalue()
    transitions = {
        f"{labels['from']}->{labels['to']}": int(v)
        for labels, v in raw["prism_engine_batch_breaker_transitions_total"]
        if v
    }
    assert transitions == {"closed->open": 1, "open->half_open": 1, "half_open->closed": 1}
    batches = int(raw["prism_engine_batches_total"][0][1])
    overruns = int(raw["prism_engine_batch_overruns_total"][0][1])
    assert (batches, overruns) == (4, 3)
    # The live view's events named each change of the breaker as the scrapes saw it, the last with every one.
    events = [line for line in out.getvalue().splitlines() if "h100-1 batch breaker now" in line]
    assert events and events[-1].endswith("closed->open 1, open->half_open 1, half_open->closed 1"), out.getvalue()

    lines = summary(demo, 3.0, TIME_SCALE, 0.6)
    headline = next(line for line in lines if "batch window adaptive:" in line)
    p99 = re.search(r"TTFT p99 (\d+) ms over 4 answered requests", headline)
    ttfts = [r.ttft_ms for r in demo.results if r.ttft_ms is not None]
    assert p99 and p99.group(1) == f"{quantile(ttfts, 0.99):.0f}", headline
    assert headline.endswith("breaker transitions, all engines: closed->open 1, open->half_open 1, half_open->closed 1")
    header = next(i for i, line in enumerate(lines) if "window now" in line)
    row = lines[header + 1]
    shown = re.search(r"^   h100-1\s+(\d+) ms\s+closed\s+(\d+)\s+(\d+)  (.*)$", row)
    assert shown, row
    report = demo.stats[node.node_id].window
    assert report is not None and int(shown.group(1)) == round(report.window_s * 1e3)
    settings = BatchWindowSettings()
    assert settings.min_window_s <= report.window_s <= settings.max_window_s  # closed again, grown from the floor
    assert (int(shown.group(2)), int(shown.group(3))) == (batches, overruns)
    assert shown.group(4) == "closed->open 1, open->half_open 1, half_open->closed 1"


class _Garbage(QuietHandler):
    """An engine whose `/metrics` is not a Prometheus exposition."""

    def do_GET(self) -> None:
        self.reply(200, b"<html>metrics moved</html>\n")


def test_a_metrics_page_that_is_not_an_exposition_is_counted_and_shown(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid metric name"):
        read_window("<html>metrics moved</html>\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cluster = Cluster(["h100"], 1.0, tmp_path, ebpf=False, batch_window="adaptive")
        cluster.nodes[0].engine_port = server.server_address[1]
        demo = Demo(cluster, None, [request(0, 0.0, 10)], 5.0, None, io.StringIO(), False, time.monotonic() + 10)
        asyncio.run(demo.collect_engines())
        asyncio.run(demo.collect_engines())
    finally:
        server.shutdown()
        server.server_close()
    assert demo.stats["h100-1"].unreadable_metrics == 2 and demo.stats["h100-1"].window is None
    lines = summary(demo, 1.0, 1.0, 0.6)
    assert "   batch window adaptive: TTFT p99 - over 0 answered requests" in lines
    assert "   h100-1            -  no /metrics read  (2 /metrics reads unreadable)" in lines
