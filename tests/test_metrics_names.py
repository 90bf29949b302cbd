"""Prometheus naming on every service's real /metrics, read back with prometheus_client's own text parser: base
units, `_total` counters, one family per quantity, HELP everywhere, the brain's families under its prefix, and the
brain's /metrics reachable from other hosts by default."""

from __future__ import annotations

import argparse
import ipaddress
import re
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import msgspec
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from prismlb.brain import add_parser as add_brain_parser
from prismlb.brain import resolve_config
from prismlb.router import Request, Router
from prismlb.service import MS_TO_S, NODE_FAMILIES, serve_metrics
from prismlb.wire import BrainAddress, NodeMetrics

from .conftest import free_port, prism, wait_for

NODE = "node-a"
NOT_BASE_UNIT = re.compile(
    r"_(ms|us|ns|milliseconds|microseconds|minutes|hours|kb|mb|gb|kib|mib|gib|percent)(_total)?$"
)
"""Suffixes of units Prometheus wants in their base unit (seconds, bytes, ratios) instead."""


@dataclass
class Services:
    brain_metrics: int
    agent_metrics: int
    address: BrainAddress


def scrape(host: str, port: int) -> list[Metric]:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        return list(text_string_to_metric_families(response.read().decode()))


def scrape_when(host: str, port: int, family: str, timeout_s: float) -> list[Metric]:
    """The first scrape that has a sample of `family`, polling while the service starts."""
    scraped: list[Metric] = []

    def has_family() -> bool:
        nonlocal scraped
        try:
            scraped = scrape(host, port)
        except OSError:
            return False
        return any(f.name == family and f.samples for f in scraped)

    wait_for(has_family, timeout_s, f"{family} on {host}:{port}/metrics")
    return scraped


def by_name(families: Sequence[Metric]) -> dict[str, Metric]:
    return {family.name: family for family in families}


def value(families: Sequence[Metric], sample: str, **labels: str) -> float | None:
    for family in families:
        for point in family.samples:
            if point.name == sample and all(point.labels.get(k) == v for k, v in labels.items()):
                return point.value
    return None


def problems(families: Sequence[Metric]) -> list[str]:
    """Every way `families` break Prometheus' naming conventions, one line each."""
    found: list[str] = []
    for family in families:
        name = family.name
        if not family.documentation:
            found.append(f"{name}: no HELP text")
        if NOT_BASE_UNIT.search(name):
            found.append(f"{name}: not in a base unit")
        if family.type == "counter":
            found += [
                f"{p.name}: a counter's sample must end in _total" for p in family.samples if p.name != name + "_total"
            ]
        elif name.endswith("_total"):
            found.append(f"{name}: a {family.type} named like a counter")
        if "guardian" in name and not name.startswith("prism_brain_"):
            found.append(f"{name}: the brain's guardian outside the brain's prefix")
        for point in family.samples:
            # a label naming the quantity mixes several in one family (a count of invalid values by field does not)
            if "metric" in point.labels or (family.type == "gauge" and "field" in point.labels):
                found.append(f"{name}: a label names the quantity, so the family mixes several")
            if name.endswith("_ratio") and not 0.0 <= point.value <= 1.0:
                found.append(f"{name}: ratio {point.value} outside [0, 1]")
    return sorted(set(found))


def _brain_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prism")
    add_brain_parser(parser.add_subparsers(required=True))
    return parser.parse_args(["brain", *argv])


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    """A real brain (bind address left to its default) and a real agent reporting to it, as subprocesses."""
    logs = tmp_path_factory.mktemp("metrics")
    ingest = f"tcp://127.0.0.1:{free_port()}"
    address = BrainAddress(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    found = Services(free_port(), free_port(), address)
    brain = prism(
        [
            "brain",
            *("--ingest", ingest, "--updates", address.updates, "--snapshot", address.snapshot),
            *("--metrics-port", str(found.brain_metrics), "--admin-port", "0", "--state-dir", str(logs / "state")),
        ],
        logs / "brain.log",
    )
    agent = prism(
        [
            "agent",
            *("--node-id", NODE, "--brain", ingest, "--period", "0.2", "--endpoint", "http://127.0.0.1:9001"),
            *("--metrics-port", str(found.agent_metrics), "--otlp-grpc-port", "0", "--otlp-http-port", "0"),
        ],
        logs / "agent.log",
    )
    yield found
    for proc in (agent, brain):
        proc.kill()
        proc.wait()


def test_the_agents_metrics_follow_the_conventions(services: Services) -> None:
    families = scrape_when("127.0.0.1", services.agent_metrics, "prism_agent_node_mem_total_bytes", 60)
    assert problems(families) == []
    names = by_name(families)
    assert {"prism_agent_ttft_seconds", "prism_agent_e2e_latency_seconds"} <= set(names)
    assert {"prism_agent_gpu_mem_used_bytes", "prism_agent_gpu_util_ratio"} <= set(names)
    assert (value(families, "prism_agent_node_mem_total_bytes") or 0) > 0
    assert names["prism_agent_vectors_sent"].type == "counter"


def test_the_brains_metrics_follow_the_conventions(services: Services) -> None:
    families = scrape_when("127.0.0.1", services.brain_metrics, "prism_brain_node_health", 60)
    assert problems(families) == []
    names = by_name(families)
    assert (value(families, "prism_brain_node_mem_total_bytes", node=NODE) or 0) > 0
    assert names["prism_brain_predictor_trained_steps"].type == "counter", "it only grows"
    assert names["prism_brain_table_entries_clamped"].type == "counter", "it only grows"
    assert {"prism_brain_guardian_state", "prism_brain_guardian_transitions"} <= set(names)
    assert value(families, "prism_brain_node_stall_seconds", node=NODE) == 0.0  # loopback loses nothing
    assert value(families, "prism_brain_node_admit_wait_seconds", node=NODE) == 0.0  # an idle engine has room


def test_the_brains_metrics_answer_beyond_loopback_by_default(services: Services) -> None:
    scrape_when("127.0.0.1", services.brain_metrics, "prism_brain_nodes", 60)
    # 127.0.0.2 is this host too, but a socket bound to 127.0.0.1 refuses it: only a wildcard bind answers
    assert value(scrape("127.0.0.2", services.brain_metrics), "prism_brain_nodes") is not None
    assert not ipaddress.ip_address(resolve_config(_brain_args(), {}).metrics_addr).is_loopback
    assert resolve_config(_brain_args("--metrics-addr", "127.0.0.1"), {}).metrics_addr == "127.0.0.1"
    assert resolve_config(_brain_args(), {"PRISM_BRAIN_METRICS_ADDR": "::1"}).metrics_addr == "::1"


def test_a_routers_metrics_follow_the_conventions(services: Services) -> None:
    registry = CollectorRegistry()
    port = free_port()
    server = serve_metrics(port, registry, "127.0.0.1")
    assert server is not None
    try:
        with Router.connect(services.address, registry=registry) as router:
            wait_for(lambda: router.table is not None, 60, "a table from the brain")
            with router.request(Request(key="k")):
                pass
            families = scrape("127.0.0.1", port)
    finally:
        server.close()
    assert problems(families) == []
    assert value(families, "prism_router_requests_total", outcome="ok") == 1


def test_the_checks_catch_the_old_names() -> None:
    """The conventions check itself, on a scrape in the old style: each old name is reported."""
    old = (
        "# HELP prism_agent_latency_ms Observed request latency per slice\n"
        "# TYPE prism_agent_latency_ms gauge\n"
        'prism_agent_latency_ms{slice="llm",kind="ttft",quantile="p99"} 875.0\n'
        "# HELP prism_brain_node_metric Latest value the node reported\n"
        "# TYPE prism_brain_node_metric gauge\n"
        'prism_brain_node_metric{node="a",metric="mem_used_bytes"} 1e9\n'
        "# HELP prism_agent_gpu Per-GPU state\n"
        "# TYPE prism_agent_gpu gauge\n"
        'prism_agent_gpu{gpu="0",field="util_ratio"} 0.5\n'
        "# TYPE prism_guardian_state gauge\n"
        'prism_guardian_state{state="normal"} 1.0\n'
        "# HELP prism_brain_load_ratio Load\n"
        "# TYPE prism_brain_load_ratio gauge\n"
        "prism_brain_load_ratio 1.5\n"
    )
    assert problems(list(text_string_to_metric_families(old))) == [
        "prism_agent_gpu: a label names the quantity, so the family mixes several",
        "prism_agent_latency_ms: not in a base unit",
        "prism_brain_load_ratio: ratio 1.5 outside [0, 1]",
        "prism_brain_node_metric: a label names the quantity, so the family mixes several",
        "prism_guardian_state: no HELP text",
        "prism_guardian_state: the brain's guardian outside the brain's prefix",
    ]


def test_every_node_measurement_has_one_family_in_its_base_unit() -> None:
    fields = {field.name: field for field in msgspec.structs.fields(NodeMetrics)}
    assert [spec.field for spec in NODE_FAMILIES] == list(fields), "every NodeMetrics field, in order, once"
    assert len({spec.name for spec in NODE_FAMILIES}) == len(NODE_FAMILIES)
    for spec in NODE_FAMILIES:
        assert spec.help, spec.field
        assert (spec.scale == MS_TO_S) == spec.field.endswith("_ms") == spec.name.endswith("_seconds"), spec
        assert spec.counter == spec.field.endswith("_total"), spec
