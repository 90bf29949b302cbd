"""Per-request TTFT SLOs, attainment and the goodput search of `prism eval --goodput`."""

from __future__ import annotations

import pytest

from prismlb.cli import main
from prismlb.semantics import Slice
from prismlb.sim._eval import MM_CLUSTER, TEXT_CLUSTER, Case, _workload, cluster_for, goodput, run_case
from prismlb.sim._slo import (
    GOODPUT_TARGET,
    SEARCH_HIGH,
    SEARCH_LOW,
    SEARCH_START,
    SEARCH_STEPS,
    Probe,
    attainment,
    pool_classes,
    search,
    slo_s,
    ttft_floors_s,
)
from prismlb.sim._types import SimRequest, Workload


def _request(rid: int, tokens: int, signature: str = "text", media: dict[str, int] | None = None) -> SimRequest:
    return SimRequest(rid, float(rid), tokens, 10, (), signature=signature, media=media or {})


def test_short_text_prompt_gets_the_slice_tau0() -> None:
    # a100: 1000 tokens at 10,000 tokens/s = 0.1 s unloaded; 5 × 0.1 s is under the llm τ0 of 800 ms
    assert slo_s(_request(1, 1000), pool_classes(TEXT_CLUSTER)) == pytest.approx(0.8)


def test_long_text_prompt_gets_the_scaled_unloaded_ttft() -> None:
    # a100: 10,000 tokens = 1.0 s unloaded, × 5
    assert slo_s(_request(1, 10_000), pool_classes(TEXT_CLUSTER)) == pytest.approx(5.0)


def test_media_encoders_count_on_the_slice_pool_class() -> None:
    classes = pool_classes(MM_CLUSTER)
    assert classes[Slice.VLM] == {"h100"} and classes[Slice.AV] == {"l40s"}
    # vlm on h100: 2 images × 15 ms + 20,000 tokens / 20,000 tokens/s = 1.03 s, × 5
    image = _request(1, 20_000, "image+text", {"image": 2})
    assert slo_s(image, classes) == pytest.approx(5 * 1.03)
    # av on l40s: one clip at 70 ms + 3000 tokens / 6000 tokens/s = 0.57 s, × 5
    audio = _request(2, 3000, "audio+text", {"audio": 1})
    assert slo_s(audio, classes) == pytest.approx(5 * 0.57)


def test_a_mixed_pool_takes_its_slowest_class() -> None:
    # no A100 in the multimodal cluster: text may run anywhere, and the L40S (6000 tokens/s) is the slowest
    classes = pool_classes(MM_CLUSTER)
    assert classes[Slice.LLM] == {"h100", "l40s"}
    assert slo_s(_request(1, 6000), classes) == pytest.approx(5.0)


def test_an_empty_pool_takes_its_fallback_classes() -> None:
    # no vector-database host: rag falls back to llm's A100s (τ0 800 ms, and 20,000 tokens = 2 s × 5)
    classes = pool_classes(TEXT_CLUSTER)
    assert classes[Slice.RAG] == {"a100"}
    assert slo_s(_request(1, 20_000, "rag+text"), classes) == pytest.approx(10.0)


def test_attainment_counts_failed_and_unfinished_requests_as_misses() -> None:
    requests = [_request(i, 1000) for i in range(4)]  # SLO 0.8 s each
    workload = Workload("hand", requests, 16, "test")
    assert attainment(workload, {0: 0.5, 1: 0.8, 2: 0.81}, TEXT_CLUSTER) == pytest.approx(0.5)
    assert attainment(workload, {}, TEXT_CLUSTER) == 0.0


def test_a_run_carries_the_ttft_of_each_completed_request() -> None:
    result = run_case(Case("mooncake", "least-conn", 0.8, 1, 30))
    workload, _ = _workload("mooncake", 1, 30)
    assert len(result.ttft_s) == result.completed == len(workload.requests)
    assert all(t > 0 for t in result.ttft_s.values())


def test_the_floor_counts_what_an_infinite_cache_would_hold_on_the_quickest_class() -> None:
    block = 16
    first = SimRequest(0, 0.0, 48, 10, (1, 2, 3))
    same_moment = SimRequest(1, 0.0, 40, 10, (1, 2, 9))  # shares blocks 1, 2 with a request of its moment
    later = SimRequest(2, 1.0, 64, 10, (1, 2, 3, 4))  # 3 of its 4 blocks were seen
    image = SimRequest(3, 2.0, 50, 10, (1, 5), signature="image+text", media={"image": 1}, media_tokens=20)
    floors = ttft_floors_s(Workload("hand", [first, same_moment, later, image], block, "test"), MM_CLUSTER)
    h100 = 20_000.0  # the quickest class of the multimodal cluster
    assert floors[0] == pytest.approx(16 / h100), "blocks 1, 2 from the other request of its moment"
    assert floors[1] == pytest.approx(8 / h100), "40 tokens, 32 of them in blocks 1, 2"
    assert floors[2] == pytest.approx(16 / h100)
    # block 1 cached (16 tokens); block 5 new; media tokens are never cached; one image at 15 ms on an H100
    assert floors[3] == pytest.approx(0.015 + 34 / h100)


@pytest.mark.parametrize("trace", ["tenants:1", "mm"])
def test_no_policy_beats_the_floor_on_any_request(trace: str) -> None:
    workload, _ = _workload(trace, 1, 200)
    floors = ttft_floors_s(workload, cluster_for(trace, workload))
    for policy in ("prism", "least-conn", "sglang"):
        result = run_case(Case(trace, policy, 0.8, 1, 200))
        assert result.ttft_s and all(t >= floors[i] - 1e-9 for i, t in result.ttft_s.items()), policy
        assert result.ttft_p99_floor_ms <= result.slices["all"].ttft_p99_ms


def test_search_brackets_the_edge_of_a_step() -> None:
    probed: list[float] = []

    def measure(probes: list[Probe]) -> list[float]:
        probed.extend(u for _, _, u in probes)
        return [1.0 if u <= 2.5 else 0.5 for _, _, u in probes]

    found = search([("t", "a")], measure)[("t", "a")]
    assert found.above is not None and found.load <= 2.5 < found.above
    assert found.above / found.load == pytest.approx(2 ** (1 / 2**SEARCH_STEPS))
    assert found.attainment == 1.0 and found.above_attainment == 0.5
    # up from the start by doublings (0.8, 1.6, 3.2), then the bisections of [1.6, 3.2]
    assert probed[:3] == pytest.approx([SEARCH_START, 2 * SEARCH_START, 4 * SEARCH_START])
    assert len(probed) == 3 + SEARCH_STEPS and all(1.6 < u < 3.2 for u in probed[3:])
    assert [u for u, _ in found.probes] == sorted(probed)


def test_search_goes_down_by_halving_when_the_start_fails() -> None:
    found = search([("t", "a")], lambda ps: [1.0 if u <= 0.3 else 0.0 for _, _, u in ps])[("t", "a")]
    assert found.load <= 0.3 < found.above and 0.2 <= found.load and found.above <= 0.4


def test_search_reports_the_ends_when_every_or_no_load_passes() -> None:
    found = search([("t", "easy"), ("t", "hard")], lambda ps: [1.0 if p == "easy" else 0.0 for _, p, _ in ps])
    easy, hard = found[("t", "easy")], found[("t", "hard")]
    assert (easy.load, easy.attainment, easy.above) == (pytest.approx(SEARCH_HIGH), 1.0, None)
    assert (hard.load, hard.attainment, hard.above) == (0.0, 0.0, pytest.approx(SEARCH_LOW))
    assert len(easy.probes) == 5 and len(hard.probes) == 4 and SEARCH_LOW == pytest.approx(0.1)


def test_goodput_on_a_small_trace_is_deterministic_and_brackets_the_target() -> None:
    rows = goodput(["mooncake"], ["prism", "least-conn"], seed=1, limit=60)
    assert rows == goodput(["mooncake"], ["prism", "least-conn"], seed=1, limit=60)
    workload, _ = _workload("mooncake", 1, 60)
    nodes = cluster_for("mooncake", workload)
    for row in rows:
        assert row.utilisation > 0 and row.requests_per_s > 0
        at = run_case(Case("mooncake", row.policy, row.utilisation, 1, 60))
        assert attainment(workload, at.ttft_s, nodes) == row.attainment >= GOODPUT_TARGET
        assert row.curve and all(rate > 0 for rate, _ in row.curve)
        if row.above is None:
            assert row.utilisation == pytest.approx(SEARCH_HIGH)
        else:
            over = run_case(Case("mooncake", row.policy, row.above, 1, 60))
            assert attainment(workload, over.ttft_s, nodes) == row.above_attainment < GOODPUT_TARGET


def test_prism_eval_goodput_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "--goodput", "--traces", "mooncake", "--limit", "30", "--policies", "prism,least-conn"]
    assert main([*argv, "--no-report", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "| workload | policy | goodput (utilisation) |" in out
    assert "| mooncake | prism |" in out and "| mooncake | least-conn |" in out
    # each policy searched on the sound cluster and under the gray failure
    assert "4 goodput searches" in out and "Goodput under a gray failure" in out


def test_the_tables_slo_attainment_is_against_each_requests_own_slo() -> None:
    workload, _ = _workload("mooncake", 1, 80)
    nodes = cluster_for("mooncake", workload)
    result = run_case(Case("mooncake", "least-conn", 1.2, 1, 80))
    assert result.completed == result.requests == len(result.ttft_s)
    expected = attainment(workload, result.ttft_s, nodes)
    assert 0 < expected < 1, "a load where some requests miss and some meet their SLO"
    assert result.slices["all"].slo_attainment == pytest.approx(expected)
