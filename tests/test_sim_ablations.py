"""Each ablation switches off what it claims and nothing runs differently without `--ablations`."""

from __future__ import annotations

import dataclasses

import pytest

from prismlb.brain import Brain, BrainConfig
from prismlb.cli import main
from prismlb.router import Request, Settings
from prismlb.sim._ablations import (
    GRAY_VARIANTS,
    VARIANTS,
    ClassRateBrain,
    EwmaBrain,
    EwmaPredictor,
    FlatWeightsBrain,
    FleetRateBrain,
    NoAdmitWaitBrain,
    NoHealthBrain,
    NoPredictorBrain,
    NoStallBrain,
    format_ablations,
    no_sessions,
    text_callers,
)
from prismlb.sim._cluster import Simulation
from prismlb.sim._eval import PRISM, TEXT_CLUSTER, capacity, policy_factories
from prismlb.sim._families import family_workload
from prismlb.sim._prism import PrismPolicy
from prismlb.sim._slo import Goodput
from prismlb.sim._workload import scale_to_utilisation
from prismlb.wire import ModalityLatency, NodeMetrics, NodeVector, RoutingTable

from ._helpers_vectors import node_vector

CONFIG = BrainConfig(admin_port=0, stale_periods=3.0)


def vector(node_id: str, seq: int, p99_ms: float | None, **metrics: float) -> NodeVector:
    latency = {} if p99_ms is None else {"engine": ModalityLatency(requests=10, ttft_p99_ms=p99_ms)}
    return node_vector(node_id, seq, zone="z1", metrics=NodeMetrics(**metrics), latency=latency)  # type: ignore[arg-type]


def _goodput(trace: str, policy: str, utilisation: float) -> Goodput:
    return Goodput(trace, policy, utilisation, 10 * utilisation, 0.92, 2 * utilisation, 0.5)


def table(brain: Brain, vectors: list[NodeVector]) -> RoutingTable:
    brain.ingest(vectors, 1.0)
    built = brain.cycle(1.0)
    assert built is not None
    return built


def weights(built: RoutingTable) -> dict[str, float]:
    return {n.node_id: n.weight for s in built.slices for n in s.nodes}


def test_every_variant_is_listed_with_a_docstring() -> None:
    assert list(VARIANTS) == [
        "no-hold",
        "no-kv-index",
        "no-kv-index-flat",
        "no-cache-affinity",
        "no-overflow",
        "no-overflow-yield",
        "flat-weights",
        "latency-weights",
        "ewma",
        "node-max-prediction",
        "no-predictor",
        "no-stall",
        "no-client-stall",
        "no-admit-wait",
        "class-rate",
        "fleet-rate",
        "no-sessions",
        "text-callers",
        "4-routers",
        "4-routers-own-turns",
        "4-routers-no-share",
    ]
    assert all(factory.__doc__ for factory in VARIANTS.values())
    assert not set(VARIANTS) & set(policy_factories(16))


ROUTER_VARIANTS: dict[str, dict[str, object]] = {
    "no-hold": {"hold_tokens": 0},
    "no-kv-index": {"prefix_index": False},
    "no-kv-index-flat": {"prefix_index": False},
    "no-cache-affinity": {"cache_affinity": 1.0},
    "no-overflow": {"overflow": 0.0},
    "no-overflow-yield": {"overflow_yields": False},
    "no-client-stall": {"client_stall": False},
    "4-routers-own-turns": {"share_turns": False},
    "4-routers-no-share": {"share_load": False},
}
"""The variants that switch off a router setting, and what they set."""


def test_router_variants_switch_off_their_setting_alone() -> None:
    defaults = Settings()
    for name, changed in ROUTER_VARIANTS.items():
        policy = VARIANTS[name](512)
        assert isinstance(policy, PrismPolicy)
        settings = policy.routers[0].settings
        assert settings == dataclasses.replace(defaults, **changed)  # type: ignore[arg-type]
        policy.close()


def test_flat_weights_publish_every_entry_at_one() -> None:
    vectors = [vector("slow", 1, 4000.0, cpu_util_ratio=0.45), vector("fast", 2, 200.0)]
    assert min(weights(table(Brain(CONFIG), vectors)).values()) < 1.0
    flat = table(FlatWeightsBrain(CONFIG), vectors)
    assert [n.weight for s in flat.slices for n in s.nodes] and all(
        n.weight == 1.0 for s in flat.slices for n in s.nodes
    )
    ring_flat = VARIANTS["no-kv-index-flat"](16)
    assert isinstance(ring_flat, PrismPolicy) and isinstance(ring_flat.brain, FlatWeightsBrain)
    ring_flat.close()


def test_no_health_weighs_every_node_as_healthy_and_keeps_the_real_quality() -> None:
    vectors = [vector("sick", 1, 400.0, cpu_util_ratio=0.45), vector("well", 2, 400.0)]
    full = weights(table(Brain(CONFIG), vectors))
    assert full["sick"] < full["well"]
    brain = NoHealthBrain(CONFIG)
    ablated = weights(table(brain, vectors))
    assert ablated["sick"] == ablated["well"] == full["well"]
    assert brain.registry.nodes["sick"].quality < 1.0 and brain.registry.nodes["sick"].weights


@pytest.mark.parametrize(
    ("ablated_brain", "field", "affected", "published"),
    [
        # half a segment a request: 100 ms
        (NoStallBrain, "stall_ms", {"tcp_retransmits_per_s": 5.0, "requests_per_s": 10.0}, 100.0),
        # 90 running hold 0.99 of the cache, 2 wait: 3 ends at 1.5 a second
        (
            NoAdmitWaitBrain,
            "admit_ms",
            {"kv_cache_usage_ratio": 0.99, "requests_running": 90, "requests_waiting": 2, "requests_per_s": 1.5},
            2000.0,
        ),
    ],
)
def test_a_field_switched_off_is_published_nowhere_and_nothing_else_changes(
    ablated_brain: type[Brain], field: str, affected: dict[str, float], published: float
) -> None:
    calm = dict.fromkeys(affected, 0.0)
    vectors = [vector("affected", 1, 400.0, **affected), vector("calm", 2, 400.0, **calm)]
    full = table(Brain(CONFIG), vectors)
    assert {n.node_id: getattr(n, field) for s in full.slices for n in s.nodes} == {"affected": published, "calm": None}
    ablated = table(ablated_brain(CONFIG), vectors)
    assert all(getattr(n, field) is None for s in ablated.slices for n in s.nodes)
    assert weights(ablated) == weights(full)


def test_class_and_fleet_rate_brains_publish_a_median_speed_and_keep_the_nodes_own() -> None:
    def rated(node_id: str, gpu: str, rate: float | None) -> NodeVector:
        metrics = NodeMetrics(prefill_tokens_per_s=rate)
        return node_vector(node_id, 1, zone="z1", labels={"gpu": gpu}, metrics=metrics)

    vectors = [
        rated("slow", "a100", 2_500.0),  # throttled: a third of its peers' speed
        rated("a", "a100", 10_000.0),
        rated("b", "a100", 10_000.0),
        rated("fresh", "a100", None),
        rated("h", "h100", 20_000.0),
    ]

    def speeds(built: RoutingTable) -> dict[str, float | None]:
        return {n.node_id: n.prefill_tokens_per_s for s in built.slices for n in s.nodes}

    full = table(Brain(CONFIG), vectors)
    # published in steps of 2^(1/8): within 5% of the measure
    assert speeds(full)["slow"] == pytest.approx(2_500.0, rel=0.05)
    assert speeds(full)["a"] == speeds(full)["fresh"] == pytest.approx(10_000.0, rel=0.05)
    brain = ClassRateBrain(CONFIG)
    ablated = speeds(table(brain, vectors))
    assert ablated["slow"] == ablated["a"] == ablated["b"] == ablated["fresh"] == speeds(full)["a"]
    assert ablated["h"] == speeds(full)["h"] == pytest.approx(20_000.0, rel=0.05)
    # the held speeds go back to the brain's real states; their vectors stay the nodes' own
    state = brain.registry.nodes["slow"]
    assert state.prefill_rate == speeds(full)["a"] and state.vector.metrics.prefill_tokens_per_s == 2_500.0
    # one group for the whole fleet: the H100 too at the median of every measure (2,500, 10,000, 10,000, 20,000)
    fleet = speeds(table(FleetRateBrain(CONFIG), vectors))
    assert set(fleet.values()) == {speeds(full)["a"]}


def test_ewma_predictor_follows_the_formula() -> None:
    predictor = EwmaPredictor(alpha=0.5)
    for p99 in (100.0, None, 300.0, 500.0):
        predictor.observe("a", (), {"engine": p99, "av": None if p99 is None else p99 / 10})
    # 100, 100, 0.5·300 + 0.5·100, 0.5·500 + 0.5·200; each series on its own
    assert predictor.predict(["a", "b"]) == {"a": {"engine": 350.0, "av": 35.0}, "b": {}}
    predictor.forget("a")
    assert predictor.predict(["a"]) == {"a": {}}


def test_ewma_brain_predicts_the_ewma_of_the_observed_p99() -> None:
    brain = EwmaBrain(CONFIG)
    for seq, p99 in enumerate((100.0, 300.0, 500.0), 1):
        brain.ingest([vector("a", seq, p99)], float(seq))
        brain.observe_window()
    brain.predict()
    assert set(brain.predictions["a"].values()) == {350.0}  # a first prediction is taken unsmoothed


def test_no_predictor_brain_has_no_predictions_where_the_full_brain_has() -> None:
    full, ablated = Brain(CONFIG), NoPredictorBrain(CONFIG)
    for brain in (full, ablated):
        for seq in range(1, 21):  # more than the predictor's 16-window input sequence
            brain.ingest([vector("a", seq, 100.0 + seq)], float(seq))
            brain.observe_window()
        brain.predict()
    assert full.predictions["a"] and ablated.predictions == {}


def test_prism_and_every_brain_ablation_run_the_librarys_settings() -> None:
    variants = [variant(16) for name, variant in VARIANTS.items() if name not in ROUTER_VARIANTS]
    policies = [policy_factories(16)[PRISM](), *variants]
    try:
        assert all(isinstance(p, PrismPolicy) and p.routers[0].settings == Settings() for p in policies)
        assert [len(p.routers) for p in policies if isinstance(p, PrismPolicy)].count(4) == 1, "4-routers alone"
    finally:
        for policy in policies:
            policy.close()


def test_no_sessions_sends_no_session_to_the_router() -> None:
    workload = family_workload("sessions", 60)
    assert any(r.session for r in workload.requests)
    scaled = scale_to_utilisation(workload, 0.5, capacity(TEXT_CLUSTER)[0])
    remembered = {}
    for name, policy in (("full", policy_factories(workload.block_tokens)["prism"]()), ("ablated", no_sessions(16))):
        assert isinstance(policy, PrismPolicy)
        Simulation(scaled, policy, TEXT_CLUSTER, utilisation=0.5, seed=1).run()
        remembered[name] = len(policy.routers[0]._sessions)
    assert remembered["full"] > 0 and remembered["ablated"] == 0


def test_text_callers_send_blocks_no_engine_event_names() -> None:
    workload = family_workload("tenants", 40)
    scaled = scale_to_utilisation(workload, 0.5, capacity(TEXT_CLUSTER)[0])
    sent: dict[str, list[Request]] = {}
    for name, policy in (
        ("full", policy_factories(workload.block_tokens)["prism"]()),
        ("text", text_callers(workload.block_tokens)),
    ):
        assert isinstance(policy, PrismPolicy)
        sent[name] = [policy._request(r) for r in scaled.requests]
    for full, text in zip(sent["full"], sent["text"], strict=True):
        assert full.engine_blocks and not text.engine_blocks and len(full.blocks) == len(text.blocks)
        assert full.key == text.key and full.cost == text.cost
    engine = {b for r in scaled.requests for b in r.blocks}
    text_blocks = [b for r in sent["text"] for b in r.blocks]
    assert not engine & set(text_blocks) and all(0 <= b < 2**64 for b in text_blocks)
    # Chained as the engine's: two prompts share a text block exactly where they share the engine's.
    pairs = list(zip(sent["full"], sent["text"], strict=True))
    for (f1, t1), (f2, t2) in zip(pairs, pairs[1:]):
        assert [a == b for a, b in zip(f1.blocks, f2.blocks)] == [a == b for a, b in zip(t1.blocks, t2.blocks)]


def test_eval_ablations_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "--ablations", "--traces", "mooncake", "--limit", "60", "--no-report"]
    assert main([*argv, "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("| workload | Prism goodput % |"))
    assert all(f"{name} / Prism" in header for name in VARIANTS)
    row = next(line for line in printed.splitlines() if line.startswith("| mooncake |"))
    cells = row.strip("| ").split(" | ")
    assert float(cells[1]) > 0, "the full Prism passes the SLO at some load"
    ratios = [float(cell.removeprefix("< ")) for cell in cells[2:]]  # "< x": the variant missed even at 10% load
    assert len(ratios) == len(VARIANTS) and all(r > 0 for r in ratios)
    assert "| geometric mean |" in printed and "Goodput:" not in printed
    gray = printed.split("### Under a gray failure", 1)[1]
    gray_header = next(line for line in gray.splitlines() if line.startswith("| workload | Prism goodput % |"))
    assert [cell for cell in gray_header.strip("| ").split(" | ") if cell.endswith(" / Prism")] == [
        f"{name} / Prism" for name in VARIANTS if name in GRAY_VARIANTS
    ]
    assert f"{1 + len(VARIANTS) + 1 + len(GRAY_VARIANTS)} goodput searches" in printed
    with pytest.raises(SystemExit, match="--policies must name prism"):
        main([*argv, "--policies", "least-conn"])


def test_eval_goodput_takes_ablations_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "--goodput", "--traces", "mooncake", "--limit", "60", "--policies", "no-kv-index", "--jobs", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    # searched on the sound cluster and under the gray failure
    assert "| mooncake | no-kv-index |" in printed and "2 goodput searches" in printed
    assert main([*argv, "--no-gray"]) == 0
    assert "1 goodput searches" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown policies"):
        main([*argv[:-4], "--policies", "no-such-thing"])


def test_format_ablations_divides_each_variant_by_the_full_prism() -> None:
    text = format_ablations(
        [
            _goodput("t", "prism", 0.8),
            _goodput("t", "flat-weights", 0.72),
            _goodput("t", "ewma", 1.2),
            _goodput("u", "prism", 0.0),
            _goodput("u", "flat-weights", 0.4),
        ]
    )
    lines = text.splitlines()
    assert lines[0] == "| workload | Prism goodput % | flat-weights / Prism | ewma / Prism |"
    assert lines[2] == "| t | 80.0 | 0.90 | 1.50 |"
    assert lines[3] == "| u | < 10.0 | – | – |", "no ratio over a Prism that never met the SLO"
    assert lines[4] == "| geometric mean |  | 0.90 | 1.50 |"
    floor = format_ablations([_goodput("t", "prism", 0.5), _goodput("t", "ewma", 0.0), _goodput("v", "prism", 0.5)])
    assert floor.splitlines()[2] == "| t | 50.0 | < 0.20 |", "below the search's floor: a bound, not 0"
    assert floor.splitlines()[-1] == "| geometric mean |  | ≤ 0.20 |"
