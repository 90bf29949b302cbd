"""The engine timing model: queueing, prefill and decode times, prefix reuse, LRU eviction, admission limits."""

from __future__ import annotations

import math

import pytest

from prismlb.sim import PROFILES, EngineModel, GpuProfile, Job

A100 = PROFILES["a100"]
TINY = GpuProfile(1000.0, 10.0, 0.0, {"image": 0.5, "audio": 1.0, "video": 2.0}, kv_blocks=64, max_batch=2)


def job(blocks: tuple[int, ...], prompt: int, output: int = 1, encoder_s: float = 0.0, at: float = 0.0) -> Job:
    return Job(blocks, prompt, output, encoder_s, at)


def drain(model: EngineModel) -> list[tuple[str, Job, float]]:
    events = []
    while model.next_event_s() < math.inf:
        events += model.advance(model.next_event_s())
    return events


def test_prefill_then_decode_times() -> None:
    model = EngineModel(TINY, 16)
    j = job((1, 2), 40, output=5, encoder_s=0.5)
    assert [e[0] for e in model.submit(j, 0.0)] == ["admitted"]
    events = drain(model)
    assert [e[0] for e in events] == ["first_token", "finished"]
    assert j.first_token_s == pytest.approx(0.5 + 40 / 1000)
    assert j.finish_s == pytest.approx(j.first_token_s + 4 / 10)


def test_fifo_queue_waits_for_the_prefill_stage() -> None:
    model = EngineModel(TINY, 16)
    first, second = job((1,), 100, at=0.0), job((2,), 100, at=0.0)
    model.submit(first, 0.0)
    model.submit(second, 0.0)
    assert len(model.waiting) == 1 and model.running == 1
    drain(model)
    assert second.admitted_s == pytest.approx(first.first_token_s)
    assert second.first_token_s == pytest.approx(0.2, rel=0.05)  # stretched slightly by the first one decoding


def test_prefix_reuse_skips_prefill_and_counts_hits() -> None:
    model = EngineModel(TINY, 16)
    model.submit(job((1, 2, 3), 48), 0.0)
    drain(model)
    warm = job((1, 2, 9), 48, at=1.0)
    model.submit(warm, 1.0)
    drain(model)
    assert warm.hit_blocks == 2 and warm.cached_tokens == 32
    assert warm.first_token_s == pytest.approx(1.0 + 16 / 1000)
    assert (model.prefix_queries_tokens, model.prefix_hits_tokens) == (96, 32)


def test_lru_eviction_keeps_referenced_and_recent_blocks() -> None:
    model = EngineModel(TINY, 16)  # 64 blocks
    model.submit(job(tuple(range(0, 30)), 30 * 16 - 8), 0.0)
    drain(model)
    model.submit(job(tuple(range(100, 130)), 30 * 16 - 8), 1.0)
    drain(model)
    assert model.cached(0) and model.cached(100)
    model.submit(job(tuple(range(200, 230)), 30 * 16 - 8), 2.0)  # needs room: the oldest free blocks go first
    drain(model)
    assert not model.cached(0) and model.cached(100) and model.cached(229)
    assert model.removed[:3] == [0, 1, 2]
    assert model.used_blocks <= model.capacity_blocks


def test_admission_waits_for_cache_room_and_batch_room() -> None:
    model = EngineModel(TINY, 16)
    big = job(tuple(range(50)), 50 * 16, output=100)  # holds 57 of 64 blocks while it runs
    model.submit(big, 0.0)
    other = job(tuple(range(100, 110)), 160, at=0.0)
    model.submit(other, 0.0)
    events = model.advance(big.first_token_s or 0.9)
    assert ("first_token", big, big.first_token_s) in events
    assert other.admitted_s is None  # no room while the big one decodes
    drain(model)
    assert other.admitted_s == pytest.approx(big.finish_s)
    with pytest.raises(ValueError, match="exceed the KV cache"):
        model.submit(job(tuple(range(70)), 70 * 16), 5.0)


def test_kv_usage_counts_the_blocks_running_requests_hold_not_the_cached_rest() -> None:
    model = EngineModel(TINY, 16)  # 64 blocks
    first = job(tuple(range(30)), 30 * 16, output=20)  # 30 prompt blocks and 2 private ones while it runs
    model.submit(first, 0.0)
    model.advance(0.1)
    assert model.kv_usage == pytest.approx(32 / 64)
    drain(model)
    # ended: its prompt blocks stay cached, evictable on demand, which vLLM's usage counts as free
    assert model.kv_usage == 0.0 and model.used_blocks == 30
    again = job(tuple(range(30)), 30 * 16, output=20, at=10.0)
    model.submit(again, 10.0)
    assert again.hit_blocks == 30 and model.kv_usage == pytest.approx(32 / 64)


def test_batch_limit_holds_the_queue() -> None:
    model = EngineModel(TINY, 16)
    jobs = [job((i,), 16, output=50) for i in range(3)]
    for j in jobs:
        model.submit(j, 0.0)
    model.advance(0.1)
    assert model.running == 2 and len(model.waiting) == 1
    drain(model)
    assert jobs[2].admitted_s == pytest.approx(min(j.finish_s or 0 for j in jobs[:2]))


def test_profiles_and_block_granularity() -> None:
    assert EngineModel(A100, 512).capacity_blocks == 28_000 * 16 // 512
    with pytest.raises(ValueError):
        EngineModel(A100, 24)
    with pytest.raises(ValueError, match="unknown media"):
        A100.media_s({"smell": 1})
    assert A100.tpot_s(1) == pytest.approx(1 / 60) and A100.tpot_s(11) == pytest.approx(1.1 / 60)
