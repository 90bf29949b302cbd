"""Replay workloads from the real traces: counts and means against the traces README, mm mix, load scaling."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter

import pytest

from prismlb import sim
from prismlb.sim._workload import (
    AUDIO_TOKENS_PER_CLIP,
    IMAGE_TOKENS_MAX,
    MM_AUDIO_SHARE,
    MM_VIDEO_SHARE,
    VIDEO_FRAMES,
    spread_over_resolution,
)

pytestmark = pytest.mark.skipif(
    not (sim.traces_dir() / sim.MOONCAKE_TRACE).exists(), reason=f"traces not found in {sim.traces_dir()}"
)

# The traces README's rows and measured facts: (rows, span s, mean input tokens, mean output tokens).
README = {
    "mooncake": (12_031, 3_537, 12_035, 343),
    "azure-code": (8_819, 3_436, 2_048, 28),
    "azure-conv": (19_366, 3_502, 1_155, 211),
}
ENCODER_S = {"image": 0.015, "audio": 0.025, "video": 0.120}


@pytest.fixture(scope="module")
def workloads() -> dict[str, sim.Workload]:
    return {name: sim.load(name, seed=7, limit=None) for name in sim.WORKLOADS}


def request(
    number: int, arrival_s: float, input_tokens: int, blocks: tuple[int, ...], media_tokens: int = 0
) -> sim.SimRequest:
    return sim.SimRequest(number, arrival_s, input_tokens, 1, blocks, media_tokens=media_tokens)


@pytest.mark.parametrize("name", sorted(README))
def test_trace_rows_span_and_means_match_the_readme(workloads: dict[str, sim.Workload], name: str) -> None:
    rows, span_s, mean_in, mean_out = README[name]
    requests = workloads[name].requests
    assert len(requests) == rows
    assert requests[-1].arrival_s == pytest.approx(span_s, abs=4.0)  # Mooncake's last arrival, within its 3 s
    assert statistics.mean(r.input_tokens for r in requests) == pytest.approx(mean_in, rel=0.01)
    assert statistics.mean(r.output_tokens for r in requests) == pytest.approx(mean_out, rel=0.01)


@pytest.mark.parametrize("name", sim.WORKLOADS)
def test_requests_are_in_arrival_order_from_zero_with_blocks_covering_text(
    workloads: dict[str, sim.Workload], name: str
) -> None:
    w = workloads[name]
    assert w.name == name and w.block_tokens == sim.BLOCK_TOKENS and w.source
    assert [r.id for r in w.requests] == list(range(len(w.requests)))
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    for r in w.requests:
        assert r.input_tokens >= 1 and r.output_tokens >= 1 and 0 <= r.media_tokens < r.input_tokens
        assert len(r.blocks) == math.ceil((r.input_tokens - r.media_tokens) / sim.BLOCK_TOKENS)


def test_mooncake_keeps_hash_ids_and_its_infinite_cache_bound(workloads: dict[str, sim.Workload]) -> None:
    w = workloads["mooncake"]
    assert w.requests[0].blocks[:3] == (0, 1, 2)
    assert all(r.blocks[0] == 0 and r.session is None for r in w.requests)
    assert sim.infinite_cache_hit_rate(w) == pytest.approx(0.374, abs=0.001)  # the traces README's bound


def test_mooncake_arrivals_spread_over_the_three_seconds_its_timestamps_round_to() -> None:
    """The trace records ten requests per timestamp on a 3 s grid; replayed, they arrive one by one within it."""
    w = sim.mooncake_conversation(limit=2000, seed=1)
    arrivals = [r.arrival_s for r in w.requests]
    assert len(set(arrivals)) == len(arrivals)
    per_second = Counter(int(t) for t in arrivals)
    assert max(per_second.values()) < 28  # the largest tie of the trace, at one instant before
    assert len(per_second) > 0.5 * arrivals[-1]  # most seconds see an arrival, not one in three
    assert [r.arrival_s for r in sim.mooncake_conversation(limit=2000, seed=1).requests] == arrivals
    assert [r.arrival_s for r in sim.mooncake_conversation(limit=2000, seed=2).requests] != arrivals


def _at(*times: float) -> list[sim.SimRequest]:
    return [request(i, t, 100 + i, (i,)) for i, t in enumerate(times)]


def test_a_rounded_trace_spreads_each_timestamp_over_its_resolution_in_the_trace_order() -> None:
    recorded = _at(6.0, 0.0, 0.0, 0.0, 3.0, 3.0, 6.0, 9.0)  # 8 requests on 4 timestamps of a 3 s grid
    spread = spread_over_resolution(recorded, seed=3)
    by_id = {r.id: r for r in spread}
    for r in recorded:
        assert r.arrival_s <= by_id[r.id].arrival_s < r.arrival_s + 3.0
    assert [r.id for r in spread] == [1, 2, 3, 4, 5, 0, 6, 7]  # the file's order within a timestamp
    assert [r.arrival_s for r in spread] == sorted(r.arrival_s for r in spread)
    assert spread == spread_over_resolution(recorded, seed=3) != spread_over_resolution(recorded, seed=4)


def test_timestamps_without_rounding_stay_as_they_are() -> None:
    fine = _at(0.0, 0.000002, 0.5, 0.51, 2.0)  # one request per timestamp, as Azure's
    assert spread_over_resolution(fine, seed=1) == fine
    burst = _at(0.0, 10.0, 10.0, 10.0, 20.0, 30.0, 40.0)  # one deliberate burst in a sparse file
    assert [r.arrival_s for r in spread_over_resolution(burst, seed=1)] == [0.0, 10.0, 10.0, 10.0, 20.0, 30.0, 40.0]
    assert spread_over_resolution(_at(5.0, 5.0, 5.0), seed=1) == _at(5.0, 5.0, 5.0)  # one instant: no resolution


def test_mooncake_tokens_derive_each_blocks_tokens_from_its_id() -> None:
    block = sim.BLOCK_TOKENS
    tokens = sim.mooncake_tokens([7, 9], block + 3)
    assert len(tokens) == block + 3
    assert tokens[:2] == [7 * block, 7 * block + 1]
    assert tokens[block - 1 :] == [8 * block - 1, 9 * block, 9 * block + 1, 9 * block + 2]
    other = sim.mooncake_tokens([7, 3], 2 * block)
    assert other[:block] == tokens[:block]  # a shared block id: the same tokens
    assert not set(other[block:]) & set(tokens[block:])
    assert sim.mooncake_tokens([7], 0) == []


@pytest.mark.parametrize("name", ["azure-code", "azure-conv"])
def test_azure_blocks_are_never_shared(workloads: dict[str, sim.Workload], name: str) -> None:
    w = workloads[name]
    blocks = [b for r in w.requests for b in r.blocks]
    assert len(blocks) == len(set(blocks))
    assert sim.infinite_cache_hit_rate(w) == 0.0


def test_limit_takes_the_first_rows() -> None:
    assert len(sim.mooncake_conversation(limit=100).requests) == 100
    assert len(sim.azure("conv", limit=50).requests) == 50
    assert len(sim.load("mm", seed=1, limit=300).requests) == 300


def test_hit_bound_counts_blocks_seen_before_capping_partial_blocks_at_the_text() -> None:
    w = sim.Workload(
        "t",
        [request(0, 0.0, 700, (1, 2)), request(1, 1.0, 600, (1, 3)), request(2, 2.0, 800, (1, 3), media_tokens=200)],
        512,
        "test",
    )
    # request 1: block 1 (512); request 2: block 1 (512) and block 3, partial: 600 text tokens - 512 = 88
    assert sim.infinite_cache_hit_rate(w) == pytest.approx((512 + 512 + 88) / (700 + 600 + 800))


def test_mm_is_deterministic_per_seed() -> None:
    a, b, c = sim.servegen_mm(3, 2000), sim.servegen_mm(3, 2000), sim.servegen_mm(4, 2000)
    assert a == b
    assert a.requests != c.requests


def test_mm_mix_follows_the_documented_shares_and_rules(workloads: dict[str, sim.Workload]) -> None:
    requests = workloads["mm"].requests
    assert len(requests) == 6000
    kinds = Counter(r.signature for r in requests)
    assert set(kinds) <= {"text", "image+text", "audio+text", "video+text"}
    with_media = len(requests) - kinds["text"]
    assert kinds["audio+text"] / with_media == pytest.approx(MM_AUDIO_SHARE, abs=0.015)
    assert kinds["video+text"] / with_media == pytest.approx(MM_VIDEO_SHARE, abs=0.01)
    for r in requests:
        modality = r.signature.removesuffix("+text")
        assert set(r.media) == (set() if modality == "text" else {modality})
        if modality == "image":
            assert r.media["image"] >= 1 and r.media_tokens <= r.media["image"] * IMAGE_TOKENS_MAX
        elif modality == "audio":
            assert r.media == {"audio": 1} and 1 <= r.media_tokens <= AUDIO_TOKENS_PER_CLIP
        elif modality == "video":
            assert r.media == {"video": 1} and r.media_tokens <= VIDEO_FRAMES[1] * IMAGE_TOKENS_MAX


def test_mm_shares_only_each_clients_first_block() -> None:
    requests = sim.servegen_mm(5, 3000).requests
    firsts = Counter(r.blocks[0] for r in requests)
    rest = [b for r in requests for b in r.blocks[1:]]
    assert max(firsts) < 35 and max(firsts.values()) > 100  # block i: client i's shared system prompt (35 clients)
    assert len(rest) == len(set(rest)) and not set(rest) & set(firsts)
    assert 0 < sim.infinite_cache_hit_rate(sim.Workload("mm", requests, sim.BLOCK_TOKENS, "")) < 1


def test_loading_is_fast() -> None:
    start = time.perf_counter()
    sim.mooncake_conversation()
    assert time.perf_counter() - start < 1.0
    start = time.perf_counter()
    sim.servegen_mm(0, 6000)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("name", sim.WORKLOADS)
@pytest.mark.parametrize("level", sorted(sim.LEVELS))
def test_scaling_hits_the_named_utilisation(workloads: dict[str, sim.Workload], name: str, level: str) -> None:
    w = workloads[name]
    scaled = sim.scale_to_utilisation(w, sim.LEVELS[level], 8 * 20_000.0, encoder_s_per_media=ENCODER_S)
    assert sim.offered_utilisation(scaled, 8 * 20_000.0, encoder_s_per_media=ENCODER_S) == pytest.approx(
        sim.LEVELS[level], abs=1e-6
    )
    factor = scaled.requests[-1].arrival_s / w.requests[-1].arrival_s
    assert [r.arrival_s for r in scaled.requests] == pytest.approx([r.arrival_s * factor for r in w.requests])
    assert [(r.id, r.input_tokens, r.blocks) for r in scaled.requests] == [
        (r.id, r.input_tokens, r.blocks) for r in w.requests
    ]


def test_utilisation_without_encoders_is_prompt_tokens_over_capacity_and_span() -> None:
    w = sim.Workload("t", [request(0, 0.0, 1000, (1, 2)), request(1, 10.0, 3000, (3,) * 6)], 512, "test")
    assert sim.offered_utilisation(w, 100.0) == pytest.approx(4000 / 100 / 10)
    assert sim.scale_to_utilisation(w, 0.5, 100.0).requests[1].arrival_s == pytest.approx(80.0)
    assert sim.LEVELS == {"50%": 0.5, "80%": 0.8, "95%": 0.95}


def test_bad_arguments_raise_value_error(workloads: dict[str, sim.Workload]) -> None:
    w = workloads["azure-code"]
    for utilisation in (0.0, -0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="utilisation"):
            sim.scale_to_utilisation(w, utilisation, 1e5)
    for capacity in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="capacity"):
            sim.scale_to_utilisation(w, 0.8, capacity)
    with pytest.raises(ValueError, match="no requests"):
        sim.scale_to_utilisation(sim.Workload("empty", [], 512, ""), 0.8, 1e5)
    with pytest.raises(ValueError, match="spans no time"):
        sim.offered_utilisation(sim.Workload("one", [request(0, 0.0, 10, (1,))], 512, ""), 1e5)
    with pytest.raises(ValueError, match="video"):
        sim.offered_utilisation(workloads["mm"], 1e5, encoder_s_per_media={"image": 0.01, "audio": 0.02})
    with pytest.raises(ValueError, match="unknown workload"):
        sim.load("sharegpt", seed=0, limit=None)
    with pytest.raises(ValueError, match="'code' or 'conv'"):
        sim.azure("chat", limit=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="count"):
        sim.servegen_mm(0, 0)
