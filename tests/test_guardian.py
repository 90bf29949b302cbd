"""SLO guardian: every transition on a scripted load, compliant-period counting, real scale-out hooks."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry

from prismlb.brain._control import Control
from prismlb.brain._drift import DriftDetector
from prismlb.brain._guardian import Guardian, GuardianConfig, GuardianState
from prismlb.brain._registry import NodeState
from prismlb.brain._scale_hook import CommandHook, HookError, ScaleEvent, WebhookHook, parse_hook
from prismlb.semantics import health
from prismlb.wire import ConfigError, ModalityLatency, NodeMetrics, NodeVector

from .conftest import wait_for

N, D, S, R = GuardianState.NORMAL, GuardianState.DEGRADE, GuardianState.SCALE_UP, GuardianState.RECOVER
OK = {"p99_ms": 300.0, "error_ratio": 0.001, "qps": 100.0}
SLOW = {"p99_ms": 900.0, "error_ratio": 0.001, "qps": 100.0}
ERRORS = {"p99_ms": 300.0, "error_ratio": 0.02, "qps": 100.0}
SURGE = {"p99_ms": 300.0, "error_ratio": 0.001, "qps": 250.0}
SURGE_AND_SLOW = {"p99_ms": 950.0, "error_ratio": 0.001, "qps": 250.0}
ALL = ("batch", "best_effort")


class Scripted:
    """A guardian checked every 5 s of a fake clock, with its own metrics registry."""

    def __init__(self, **config: object) -> None:
        self.registry = CollectorRegistry()
        settings = {"baseline_qps": 100.0, **config}
        self.guardian = Guardian(GuardianConfig(**settings), self.registry)  # type: ignore[arg-type]
        self.now = 0.0

    def step(self, load: dict[str, float]) -> GuardianState:
        self.now += 5.0
        return self.guardian.check(self.now, load["p99_ms"], load["error_ratio"], load["qps"])

    def transitions(self, source: GuardianState, target: GuardianState) -> float:
        value = self.registry.get_sample_value(
            "prism_brain_guardian_transitions_total", {"from": source.value, "to": target.value}
        )
        return value or 0.0

    def hook(self, result: str) -> float:
        return self.registry.get_sample_value("prism_brain_guardian_scale_hook_calls_total", {"result": result}) or 0.0


@pytest.fixture
def scripted() -> Iterator[Callable[..., Scripted]]:
    made: list[Scripted] = []

    def make(**config: object) -> Scripted:
        made.append(Scripted(**config))
        return made[-1]

    yield make
    for s in made:
        s.guardian.close()


def test_the_guardian_walks_every_transition(scripted: Callable[..., Scripted]) -> None:
    s = scripted()
    script: list[tuple[dict[str, float], GuardianState, tuple[str, ...]]] = [
        (OK, N, ()),
        (SLOW, D, ALL),  # normal -> degrade on P99
        (OK, D, ALL),
        (OK, D, ALL),
        (OK, R, ("best_effort",)),  # third compliant period: batch comes back
        (OK, N, ()),  # recover -> normal
        (SURGE, S, ()),  # normal -> scale-up
        (OK, N, ()),  # scale-up -> normal
        (ERRORS, D, ALL),  # normal -> degrade on the error rate
        (SURGE, S, ALL),  # degrade -> scale-up: shed classes stay shed
        (SLOW, D, ALL),  # scale-up -> degrade
        (OK, D, ALL),
        (OK, D, ALL),
        (OK, R, ("best_effort",)),  # degrade -> recover
        (SLOW, D, ALL),  # recover -> degrade
        (OK, D, ALL),
        (OK, D, ALL),
        (OK, R, ("best_effort",)),
        (SURGE, S, ("best_effort",)),  # recover -> scale-up
        (OK, D, ("best_effort",)),  # scale-up -> degrade: load is back but a class is still shed
        (OK, D, ("best_effort",)),
        (OK, N, ()),  # degrade -> normal: the last class comes back
    ]
    for i, (load, state, shed) in enumerate(script):
        assert s.step(load) is state, f"step {i}"
        assert s.guardian.flags() == (state.value, list(shed)), f"step {i}"
        for other in GuardianState:
            gauge = s.registry.get_sample_value("prism_brain_guardian_state", {"state": other.value})
            assert gauge == (1.0 if other is state else 0.0)
    expected = {
        (N, D): 2, (N, S): 1,
        (D, R): 3, (D, S): 1, (D, N): 1,
        (R, N): 1, (R, D): 1, (R, S): 1,
        (S, N): 1, (S, D): 2,
    }  # fmt: skip
    for source in GuardianState:
        for target in GuardianState:
            assert s.transitions(source, target) == expected.get((source, target), 0), (source, target)
    logged = [(t.source, t.target) for t in s.guardian.transitions]
    assert len(logged) == sum(expected.values()) and set(logged) == set(expected)


def test_compliant_periods_must_be_in_a_row(scripted: Callable[..., Scripted]) -> None:
    s = scripted()
    for load in (SLOW, OK, OK, SLOW, OK, OK, SURGE, OK, OK):
        s.step(load)
        assert s.guardian.state is not R
    assert s.guardian.compliant_streak == 2
    assert s.step(OK) is R and s.guardian.compliant_streak == 3


def test_recovery_restores_one_class_per_period_in_order(scripted: Callable[..., Scripted]) -> None:
    s = scripted(shed_classes=("analytics", "batch", "best_effort"))
    s.step(SLOW)
    assert s.guardian.flags() == ("degrade", ["analytics", "batch", "best_effort"])
    s.step(OK)
    s.step(OK)
    shed_each_period = []
    for _ in range(4):
        s.step(OK)
        shed_each_period.append(s.guardian.flags())
    assert shed_each_period == [
        ("recover", ["batch", "best_effort"]),
        ("recover", ["best_effort"]),
        ("normal", []),
        ("normal", []),
    ]
    # the recover -> recover step is kept and logged but is not a state transition
    assert [(t.source, t.target, t.shed_classes) for t in s.guardian.transitions][-2:] == [
        (R, R, ("best_effort",)),
        (R, N, ()),
    ]
    assert s.transitions(R, R) == 0


def test_without_shed_classes_degrade_still_waits_for_compliance(scripted: Callable[..., Scripted]) -> None:
    s = scripted(shed_classes=())
    assert [s.step(x) for x in (SLOW, OK, OK, OK)] == [D, D, D, N]
    assert s.guardian.flags() == ("normal", [])


def test_absent_measures_trigger_nothing(scripted: Callable[..., Scripted]) -> None:
    s = scripted()
    assert s.guardian.check(5.0, None, None, None) is N
    assert s.guardian.load_factor is None


def test_baseline_qps_is_learned_from_compliant_normal_periods(scripted: Callable[..., Scripted]) -> None:
    s = scripted(baseline_qps=None)
    for _ in range(20):
        assert s.step(OK) is N
    assert s.guardian.baseline_qps == pytest.approx(100.0)
    for _ in range(5):
        assert s.step(SURGE) is S  # 2.5x the learned baseline
    assert s.guardian.baseline_qps == pytest.approx(100.0)  # a surge never enters the baseline
    assert s.step(OK) is N
    for _ in range(200):
        s.step({**OK, "qps": 150.0})
    assert s.guardian.baseline_qps == pytest.approx(150.0, rel=0.02)  # slow growth is followed


def test_command_hook_runs_a_real_process_with_the_event(scripted: Callable[..., Scripted], tmp_path: Path) -> None:
    out = tmp_path / "scaled.jsonl"
    script = (
        "import json, os, sys; "
        "keys = ('PRISM_SCALE_EVENT', 'PRISM_SCALE_LOAD_FACTOR', 'PRISM_GUARDIAN_STATE', 'PRISM_SCALE_REASON'); "
        "open(sys.argv[1], 'a').write(json.dumps({k: os.environ[k] for k in keys}) + '\\n')"
    )
    s = scripted(scale_hook=CommandHook((sys.executable, "-c", script, str(out))))
    assert s.step(SURGE) is S
    assert wait_for(lambda: s.hook("ok") == 1)
    [line] = out.read_text().splitlines()
    call = json.loads(line)
    assert call["PRISM_SCALE_LOAD_FACTOR"] == "2.500"
    assert call["PRISM_GUARDIAN_STATE"] == "scale_up"
    assert "load factor 2.50 > 2.1" in call["PRISM_SCALE_REASON"]
    event = json.loads(call["PRISM_SCALE_EVENT"])
    assert event["qps"] == 250.0 and event["baseline_qps"] == 100.0 and event["at_s"] == 5.0
    # still overloaded: asked again only once rescale_after_s (60 s) has passed
    for _ in range(11):
        s.step(SURGE)
    assert s.hook("ok") == 1
    s.step(SURGE)
    assert wait_for(lambda: s.hook("ok") == 2)
    # a new surge after the load came back asks at once, also while degrading
    s.step(OK)
    s.step(SURGE_AND_SLOW)
    assert wait_for(lambda: s.hook("ok") == 3)
    assert json.loads(out.read_text().splitlines()[-1])["PRISM_GUARDIAN_STATE"] == "degrade"
    assert s.hook("failed") == 0 and s.hook("skipped") == 0


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[dict[str, object]]
    arrived: list[float]
    status: int
    release: threading.Event

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.arrived.append(time.monotonic())
        self.release.wait(10)
        self.bodies.append({"content_type": self.headers["Content-Type"], **json.loads(body)})
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, type[_Receiver]]]:
    class Handler(_Receiver):
        bodies = []
        arrived = []
        status = 204
        release = threading.Event()

    handler = Handler
    handler.release.set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/scale", handler
    handler.release.set()
    server.shutdown()
    server.server_close()


def test_webhook_hook_posts_the_event_to_a_real_server(
    scripted: Callable[..., Scripted], webhook: tuple[str, type[_Receiver]]
) -> None:
    url, handler = webhook
    s = scripted(scale_hook=parse_hook(url, timeout_s=5.0))
    assert s.step(SURGE) is S
    assert wait_for(lambda: s.hook("ok") == 1)
    [body] = handler.bodies
    assert body["content_type"] == "application/json"
    assert body["state"] == "scale_up" and body["load_factor"] == 2.5 and body["qps"] == 250.0


def test_a_slow_hook_never_blocks_checks_and_extra_requests_are_skipped(
    scripted: Callable[..., Scripted], webhook: tuple[str, type[_Receiver]]
) -> None:
    url, handler = webhook
    handler.release.clear()  # the server holds every request until released
    s = scripted(scale_hook=WebhookHook(url, timeout_s=10.0))
    assert s.step(SURGE) is S
    assert wait_for(lambda: len(handler.arrived) == 1)
    # two more overload episodes while the first call hangs: one waits, one is skipped
    for load, state in [(OK, N), (SURGE, S), (OK, N), (SURGE, S), (SLOW, D), (OK, D)]:
        assert s.step(load) is state
    assert s.hook("ok") == 0 and s.hook("skipped") == 1
    handler.release.set()
    assert wait_for(lambda: s.hook("ok") == 2)
    assert len(handler.bodies) == 2 and s.hook("failed") == 0


def test_hook_failures_are_counted_and_checks_go_on(
    scripted: Callable[..., Scripted], webhook: tuple[str, type[_Receiver]], tmp_path: Path
) -> None:
    url, handler = webhook
    handler.status = 500
    marker = tmp_path / "grandchild-survived"
    hooks = [
        WebhookHook(url, timeout_s=5.0),  # HTTP 500
        WebhookHook("http://127.0.0.1:1/scale", timeout_s=5.0),  # connection refused
        CommandHook(("sh", "-c", "echo no capacity >&2; exit 3")),
        CommandHook((str(tmp_path / "missing-command"),)),
        CommandHook(("sh", "-c", f"(sleep 1; touch {marker}) & sleep 30"), timeout_s=0.3),
    ]
    for hook in hooks:
        s = scripted(scale_hook=hook)
        assert s.step(SURGE) is S
        assert s.step(SLOW) is D  # the machine moves on whatever the hook does
        assert wait_for(lambda: s.hook("failed") == 1)
        assert s.hook("ok") == 0
    # The background subshell would touch the marker after 1 s; once no process names the marker it either
    # did (and the group was not killed) or never will.
    assert wait_for(lambda: not _running(str(marker)))
    assert not marker.exists()  # the timed-out command's whole process group was killed


def _running(mark: str) -> bool:
    """Whether a live process's command line mentions `mark` (a zombie's is empty)."""
    return any(mark in arg for proc in psutil.process_iter(["cmdline"]) for arg in proc.info["cmdline"] or ())


def test_hooks_raise_clear_errors() -> None:
    event = ScaleEvent(1.0, "scale_up", "load factor 2.50 > 2.1", 2.5, 250.0, 100.0)
    with pytest.raises(HookError, match="exited with 3: nope"):
        CommandHook(("sh", "-c", "echo nope >&2; exit 3"))(event)
    with pytest.raises(HookError, match="timed out after 0.2 s"):
        CommandHook(("sleep", "5"), timeout_s=0.2)(event)
    with pytest.raises(HookError, match="POST http://127.0.0.1:1/"):
        WebhookHook("http://127.0.0.1:1/")(event)


def test_parse_hook_and_config_validation() -> None:
    assert parse_hook("https://ops.example/scale", 3.0) == WebhookHook("https://ops.example/scale", 3.0)
    assert parse_hook("kubectl scale --replicas=+2 'deploy/vllm'") == CommandHook(
        ("kubectl", "scale", "--replicas=+2", "deploy/vllm")
    )
    with pytest.raises(ConfigError):
        parse_hook("  ")
    for bad in (
        {"shed_classes": ("batch", "batch")},
        {"compliant_periods": 0},
        {"load_factor_limit": 0.0},
        {"baseline_qps": -1.0},
        {"baseline_alpha": 0.0},
    ):
        with pytest.raises(ConfigError):
            GuardianConfig(**bad)


def test_the_control_step_feeds_the_guardian_the_cluster_error_ratio() -> None:
    guardian = Guardian(GuardianConfig(), CollectorRegistry())
    control = Control(DriftDetector(), guardian)

    def state(node: str, requests: int, errors: int) -> NodeState:
        latency = {"llm": ModalityLatency(requests=requests, errors=errors, ttft_p99_ms=100.0)}
        metrics = NodeMetrics(requests_per_s=1.0)
        vector = NodeVector(
            node_id=node,
            host=node,
            endpoint="e",
            seq=1,
            sample_time_unix_s=1.0,
            period_s=1.0,
            metrics=metrics,
            latency=latency,
        )
        return NodeState(vector, 0.0, health(metrics))

    control.step(1.0, {"a": state("a", 1000, 0), "b": state("b", 1000, 2)}, [])
    assert guardian.state is GuardianState.NORMAL  # 0.1% errors, P99 100 ms: compliant
    control.step(2.0, {"a": state("a", 1000, 0), "b": state("b", 1000, 30)}, [])
    assert guardian.state is not GuardianState.NORMAL  # 1.5% errors > 0.5%
    assert any("error rate" in t.reason for t in guardian.transitions)
