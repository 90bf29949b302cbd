"""Gradient-aware offload: the monitor on a real torch model's backward, the scheduler's split and its input
checks, the token bucket and the emulated link on a simulated clock (one short wall-clock run), the bench's
quick run as a subprocess, and the GPU check's offload part skipping on a host without CUDA."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from prismlb import otel
from prismlb.wire import ConfigError, InvalidFieldError, NonFiniteError, RejectCounter

from .conftest import load_bench

REPO = Path(__file__).resolve().parent.parent
LOG = logging.getLogger("test_offload")


class TwoHeads(nn.Module):
    """Embedding → trunk → two heads, so that one head's loss can be scaled on its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(16, 8)
        self.trunk = nn.Linear(8, 8)
        self.head_a = nn.Linear(8, 4)
        self.head_b = nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tanh(self.trunk(self.embed(tokens)))
        return self.head_a(x), self.head_b(x)


TOKENS = torch.tensor([[1, 5, 9, 2], [7, 7, 3, 0]])
TARGETS = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0])


def backward(model: TwoHeads, scale_b: float = 1.0) -> None:
    a, b = model(TOKENS)
    loss_a = nn.functional.cross_entropy(a.reshape(-1, 4), TARGETS)
    loss_b = nn.functional.cross_entropy(b.reshape(-1, 4), TARGETS)
    (loss_a + scale_b * loss_b).backward()


def density(module: nn.Module) -> float:
    grads = [p.grad for p in module.parameters(recurse=False)]
    return sum(float(g.abs().sum()) for g in grads) / sum(g.numel() for g in grads)


# --- the monitor --------------------------------------------------------------------------------------------


def test_the_monitor_measures_each_layers_l1_density_in_backward_order() -> None:
    model = TwoHeads()
    with otel.GradientMonitor(model) as monitor:
        assert monitor.layers == ("embed", "trunk", "head_a", "head_b")
        backward(model)
        layers = {layer.name: layer for layer in monitor.step()}
        assert set(layers) == set(monitor.layers)
        for name, module in model.named_children():
            assert layers[name].density == pytest.approx(density(module), rel=1e-6)
            numel = sum(p.numel() for p in module.parameters())
            assert (layers[name].numel, layers[name].grad_bytes) == (numel, 4 * numel)
            assert layers[name].change_rate is None  # one density so far
        order = {name: layer.ready_order for name, layer in layers.items()}
        assert sorted(order.values()) == [0, 1, 2, 3]
        assert max(order["head_a"], order["head_b"]) < order["trunk"] < order["embed"]
        assert monitor.change_rates() == {}
        assert monitor.steps == 1


def test_scaling_one_heads_loss_step_to_step_makes_its_change_rate_lead() -> None:
    model = TwoHeads()  # no optimizer: the same input gives the same gradients, but for the scale
    with otel.GradientMonitor(model, alpha=0.5) as monitor:
        for step in range(8):
            backward(model, scale_b=4.0 if step % 2 else 1.0)
            monitor.step()
            model.zero_grad(set_to_none=True)
        rates = monitor.change_rates()
    # head_b's density alternates ×4: |4d − d| / 4d = 0.75 every step; head_a's never changes
    assert rates["head_b"] == pytest.approx(0.75, rel=1e-5)
    assert rates["head_a"] == pytest.approx(0.0, abs=1e-6)
    assert 0.0 < rates["trunk"] < 0.75 and 0.0 < rates["embed"] < 0.75
    assert max(rates, key=rates.__getitem__) == "head_b"
    assert otel.BandwidthScheduler(1e9).urgent_layers(rates)[0] == "head_b"


def test_the_monitor_measures_the_accumulated_gradient_of_several_backwards() -> None:
    model = TwoHeads()
    with otel.GradientMonitor(model) as monitor:
        backward(model)
        backward(model, scale_b=3.0)
        layers = {layer.name: layer for layer in monitor.step()}
    assert layers["head_b"].density == pytest.approx(density(model.head_b), rel=1e-6)
    assert layers["trunk"].density == pytest.approx(density(model.trunk), rel=1e-6)


def test_a_non_finite_gradient_is_counted_and_the_layer_keeps_its_rate() -> None:
    model = TwoHeads()
    rejects = RejectCounter("gradient monitor", LOG)
    monitor = otel.GradientMonitor(model, rejects=rejects)
    for scale in (1.0, 2.0):
        backward(model, scale_b=scale)
        monitor.step()
        model.zero_grad(set_to_none=True)
    before = monitor.change_rates()["head_b"]
    handle = model.head_b.weight.register_hook(lambda grad: grad * math.nan)
    backward(model, scale_b=5.0)
    measured = [layer.name for layer in monitor.step()]
    handle.remove()
    assert "head_b" not in measured and len(measured) == 3
    assert rejects.counts() == {"non_finite": 1}
    assert monitor.change_rates()["head_b"] == before
    monitor.close()


def test_close_removes_the_hooks_and_tied_weights_count_once() -> None:
    model = TwoHeads()
    monitor = otel.GradientMonitor(model)
    monitor.close()
    monitor.close()
    backward(model)
    assert monitor.step() == ()
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    with otel.GradientMonitor(tied) as monitor:
        assert monitor.layers == ("0",)


def test_the_monitor_refuses_bad_settings() -> None:
    for alpha in (0.0, 1.5, math.nan):
        with pytest.raises(ConfigError, match="alpha"):
            otel.GradientMonitor(TwoHeads(), alpha=alpha)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        otel.GradientMonitor(frozen)


# --- the scheduler ------------------------------------------------------------------------------------------

RATES = {"embed": 0.9, "head": 0.8, "b0": 0.2, "b1": 0.1, "b2": 0.1, "b3": 0.05, "b4": 0.0, "norm": 0.3}
PENDING = {"embed": 4_000_000, "head": 1_000_000, "b0": 2_000_000, "b1": 2_000_000, "b2": 2_000_000}
PENDING |= {"b3": 2_000_000, "b4": 2_000_000, "norm": 2_000}


def test_the_fast_layers_share_at_least_60_percent_by_bytes_and_the_rest_by_change_rate() -> None:
    scheduler = otel.BandwidthScheduler(10e9)
    assert scheduler.urgent_layers(RATES) == ("embed", "head")  # ≥ half the fastest, within the top quarter
    plan = scheduler.plan(PENDING, RATES)
    assert plan.urgent == ("embed", "head")
    assert plan.urgent_share == pytest.approx(otel.URGENT_SHARE) and otel.URGENT_SHARE >= 0.6
    assert sum(plan.rates.values()) == pytest.approx(10e9)
    assert plan.rates["embed"] == pytest.approx(4 * plan.rates["head"])  # urgent: by pending bytes
    assert plan.rates["b0"] == pytest.approx(2 * plan.rates["b1"])  # background: by change rate
    assert plan.rates["norm"] == pytest.approx(1.5 * plan.rates["b0"])
    assert plan.rates["b4"] == pytest.approx(0.05 * plan.rates["norm"])  # the floor: 5% of the fastest's weight
    assert list(plan.rates) == sorted(PENDING)


def test_a_class_with_nothing_pending_leaves_the_whole_link_to_the_other() -> None:
    scheduler = otel.BandwidthScheduler(1e9)
    only_urgent = scheduler.plan({"embed": 10, "head": 30, "b0": 0}, RATES)
    assert only_urgent.rates == {"embed": pytest.approx(0.25e9), "head": pytest.approx(0.75e9)}
    assert only_urgent.urgent_share == pytest.approx(1.0)
    only_background = scheduler.plan({"b0": 10, "b1": 10}, RATES)
    assert only_background.urgent == () and only_background.rates["b0"] == pytest.approx(2 / 3 * 1e9)
    unknown = scheduler.plan({"x": 5, "y": 5}, {})
    assert unknown.rates == {"x": 0.5e9, "y": 0.5e9} and unknown.urgent == ()
    assert scheduler.plan({}, RATES).rates == {}


def test_plans_are_deterministic_whatever_the_input_order() -> None:
    scheduler = otel.BandwidthScheduler(1e9)
    forward = scheduler.plan(PENDING, RATES)
    backward_order = scheduler.plan(dict(reversed(PENDING.items())), dict(reversed(RATES.items())))
    assert list(forward.rates.items()) == list(backward_order.rates.items())
    assert forward.classes == backward_order.classes
    ties = {"a": 0.5, "b": 0.5, "c": 0.5, "d": 0.5}
    assert scheduler.urgent_layers(ties) == ("a",)  # a quarter of four layers, ties by name


def test_bad_input_gets_a_clear_error_and_is_counted() -> None:
    rejects = RejectCounter("bandwidth scheduler", LOG)
    scheduler = otel.BandwidthScheduler(1e9, rejects=rejects)
    cases = [
        ({"a": math.nan}, {}, NonFiniteError, "pending bytes of layer 'a' must be finite"),
        ({"a": -1}, {}, InvalidFieldError, "pending bytes of layer 'a' must not be negative"),
        ({"a": "10"}, {}, InvalidFieldError, "must be a number, got str"),
        ({"a": True}, {}, InvalidFieldError, "must be a number, got bool"),
        ({"a": 10}, {"a": math.inf}, NonFiniteError, "change rate of layer 'a' must be finite"),
        ({"a": 10}, {"a": -0.1}, InvalidFieldError, "change rate of layer 'a' must not be negative"),
        ({"": 10}, {}, InvalidFieldError, "non-empty string"),
        ([("a", 10)], {}, InvalidFieldError, "must be a mapping, got list"),
    ]
    for pending, rates, error, message in cases:
        with pytest.raises(error, match=message):
            scheduler.plan(pending, rates)  # type: ignore[arg-type]
    assert rejects.counts() == {"non_finite": 2, "invalid_field": 6}
    assert scheduler.plan({"a": 10}, {"a": 0.5}).rates == {"a": 1e9}  # still serving


def test_bad_settings_are_refused() -> None:
    for capacity in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="capacity"):
            otel.BandwidthScheduler(capacity)
    with pytest.raises(ConfigError, match="urgent_share"):
        otel.BandwidthScheduler(1e9, urgent_share=1.2)
    with pytest.raises(ConfigError, match="background_floor"):
        otel.BandwidthScheduler(1e9, background_floor=-0.1)


def test_the_rate_classes_map_to_queue_pair_rate_limits_in_kbps() -> None:
    assert dict(otel.QP_RATE_MBPS) == {"urgent": 800.0, "background": 300.0}
    plan = otel.BandwidthScheduler(1e9).plan(PENDING, RATES)
    limits = otel.qp_rate_limits(plan)
    assert limits["embed"] == limits["head"] == 800_000
    assert {limits[name] for name in PENDING if name not in ("embed", "head")} == {300_000}
    assert otel.qp_rate_limits(plan, {"urgent": 2000.0, "background": 500.5})["b0"] == 500_500
    with pytest.raises(ConfigError, match="background QP rate"):
        otel.qp_rate_limits(plan, {"urgent": 800.0})


# --- the token bucket and the emulated link -----------------------------------------------------------------


def test_the_token_bucket_respects_its_rate_on_a_simulated_clock() -> None:
    clock = otel.SimulatedClock()
    bucket = otel.TokenBucket(1e6, burst=4096)
    sent, log = 0, []
    while sent < 200_000:
        clock.wait_until(bucket.ready_at(1000, clock.now()))
        bucket.take(1000, clock.now())
        sent += 1000
        log.append((clock.now(), sent))
    assert all(total <= 4096 + 1e6 * at + 1e-6 for at, total in log)  # never ahead of burst + rate × time
    assert log[-1][0] == pytest.approx((200_000 - 4096) / 1e6, rel=1e-3)  # and never behind it either
    bucket.set_rate(0.0, clock.now())
    assert bucket.ready_at(1000, clock.now()) == math.inf
    bucket.set_rate(2e6, clock.now())
    assert bucket.ready_at(1000, clock.now()) == pytest.approx(clock.now() + 1000 / 2e6, rel=1e-6)
    with pytest.raises(ConfigError, match="before the bucket had them"):
        bucket.take(1000, clock.now())
    with pytest.raises(ConfigError, match="can never pass"):
        bucket.ready_at(5000, clock.now())


def test_one_transfer_goes_at_the_links_capacity() -> None:
    link = otel.EmulatedLink(1e9, chunk_bytes=4096)
    run = link.run([otel.Transfer("a", 1_000_000)], otel.fifo(1e9, ["a"]))
    assert run.completed_s["a"] == pytest.approx(1e-3, rel=1e-6)
    assert run.utilisation == pytest.approx(1.0, rel=1e-6)
    assert (run.bytes_moved, run.chunks) == (1_000_000, math.ceil(1_000_000 / 4096))


def test_the_link_executes_the_gradient_aware_plan_and_the_static_ones() -> None:
    transfers = [otel.Transfer("slow", 700_000), otel.Transfer("fast", 300_000)]
    rates = {"fast": 1.0, "slow": 0.1}
    link = otel.EmulatedLink(1e9, chunk_bytes=1000)
    aware = link.run(transfers, otel.BandwidthScheduler(1e9).policy(rates))
    # fast at 60% until done (0.5 ms), then slow alone: 0.2 MB moved by then, 0.5 MB at the full link
    assert aware.completed_s["fast"] == pytest.approx(0.5e-3, rel=0.01)
    assert aware.completed_s["slow"] == pytest.approx(1.0e-3, rel=0.01)
    assert aware.utilisation == pytest.approx(1.0, rel=0.01)
    equal = link.run(transfers, otel.static_equal_share(1e9, 2))  # 50% each, kept after fast is done
    assert equal.completed_s["fast"] == pytest.approx(0.6e-3, rel=0.01)
    assert equal.completed_s["slow"] == pytest.approx(1.4e-3, rel=0.01)
    assert equal.utilisation == pytest.approx(1 / 1.4, rel=0.01)
    in_order = link.run(transfers, otel.fifo(1e9, ["slow", "fast"]))
    assert in_order.completed_s["slow"] == pytest.approx(0.7e-3, rel=0.01)
    assert in_order.completed_s["fast"] == pytest.approx(1.0e-3, rel=0.01)
    assert in_order.completed_by(["fast", "slow"]) == in_order.completed_s["fast"]


def test_released_transfers_wait_for_their_time_and_a_starved_one_is_an_error() -> None:
    link = otel.EmulatedLink(1e6, chunk_bytes=100)
    run = link.run(
        [otel.Transfer("late", 1000, release_s=0.5), otel.Transfer("empty", 0, release_s=0.1)], otel.fifo(1e6, [])
    )
    # the transfer's own bucket starts empty at its release: 1000 bytes at 1 MB/s from 0.5 s on
    assert run.completed_s == {"empty": pytest.approx(0.1), "late": pytest.approx(0.501, rel=1e-6)}
    assert run.first_release_s == pytest.approx(0.1) and run.elapsed_s == pytest.approx(0.401, rel=1e-6)
    with pytest.raises(ConfigError, match="no bandwidth to the pending transfers of a"):
        link.run([otel.Transfer("a", 10)], lambda left: {})


def test_the_link_refuses_bad_transfers_and_counts_them() -> None:
    rejects = RejectCounter("emulated link", LOG)
    link = otel.EmulatedLink(1e6, rejects=rejects)
    policy = otel.fifo(1e6, [])
    with pytest.raises(InvalidFieldError, match="two transfers"):
        link.run([otel.Transfer("a", 1), otel.Transfer("a", 2)], policy)
    with pytest.raises(NonFiniteError, match="bytes of layer 'a' must be finite"):
        link.run([otel.Transfer("a", math.nan)], policy)  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError, match="must be an integer"):
        link.run([otel.Transfer("a", 1.5)], policy)  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError, match="release time of layer 'a' must not be negative"):
        link.run([otel.Transfer("a", 1, release_s=-1.0)], policy)
    with pytest.raises(NonFiniteError, match="rate of layer 'a'"):
        link.run([otel.Transfer("a", 1)], lambda left: {"a": math.nan})
    assert rejects.counts() == {"invalid_field": 3, "non_finite": 2}
    with pytest.raises(ConfigError, match="chunk_bytes"):
        otel.EmulatedLink(1e6, chunk_bytes=0)


def test_on_the_wall_clock_the_link_moves_real_bytes_no_faster_than_its_rate() -> None:
    source = bytes(range(256)) * 8
    target = bytearray(len(source))
    calls: list[tuple[str, int, int]] = []

    def send(transfer: otel.Transfer, offset: int, nbytes: int) -> None:
        calls.append((transfer.layer, offset, nbytes))
        target[offset : offset + nbytes] = source[offset : offset + nbytes]

    link = otel.EmulatedLink(1e6, chunk_bytes=512, clock=otel.WallClock())
    run = link.run([otel.Transfer("g", len(source))], otel.fifo(1e6, ["g"]), send)
    assert bytes(target) == source
    assert calls == [("g", offset, 512) for offset in range(0, 2048, 512)]
    assert run.completed_s["g"] >= 2048 / 1e6 - 1e-9  # a lower bound: the bucket's rate, not a speed limit


# --- the bench and the GPU check ----------------------------------------------------------------------------


def test_the_quick_bench_prints_the_table_with_the_design_figures_beside() -> None:
    done = subprocess.run(
        [sys.executable, "bench/offload.py", "--quick"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "emulated link (token bucket, simulated time): 31.5 GB/s, 4096 B chunks"
    assert any(line.startswith("urgent layers (steps urgent / measured steps): ") for line in lines)
    rows = {line.split(" | ")[0].lstrip("| "): line.strip("|").split(" | ") for line in lines if line.startswith("| ")}
    assert set(rows) >= {"schedule", "static equal share", "static FIFO", "gradient-aware", "link utilisation"}
    assert rows["gradient sync, urgent layers"][1:3] == ["42.3 → 18.7 ms", "0.44"]
    assert rows["link utilisation"][1:3] == ["51% → 79%", "1.55"]
    equal, first_in, aware = (rows[name] for name in ("static equal share", "static FIFO", "gradient-aware"))
    utilisation = {name: float(rows[name][3].rstrip("%")) for name in ("static equal share", "gradient-aware")}
    assert utilisation["gradient-aware"] > utilisation["static equal share"]  # work-conserving vs fixed shares
    assert float(aware[1]) < float(equal[1]) and float(aware[1]) < float(first_in[1])  # urgent layers first
    assert float(aware[2]) == pytest.approx(float(first_in[2]), rel=0.05)  # both keep the link busy


def test_the_gpu_checks_offload_part_skips_cleanly_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA; bench/gpu_check.py runs the offload check for real")
    gpu_check = load_bench("gpu_check")
    gpu_check.offload_check()
    assert capsys.readouterr().out == "\noffload check skipped: torch sees no CUDA device\n"
