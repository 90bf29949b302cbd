"""Workload families: seeded determinism, each family's defining shape, and `prism eval --workload` end to end."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from prismlb.cli import main
from prismlb.sim._families import FAMILIES, PRESETS, _Chain, family_workload
from prismlb.sim._types import SimRequest, Workload
from prismlb.sim._workload import BLOCK_TOKENS, infinite_cache_hit_rate

N = 600


@pytest.fixture(scope="module")
def built() -> dict[str, Workload]:
    return {name: preset(1, N) for name, preset in PRESETS.items()}


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", list(PRESETS))
def test_same_seed_same_requests_other_seed_others(name: str, built: dict[str, Workload]) -> None:
    assert PRESETS[name](1, N) == built[name]
    assert PRESETS[name](2, N).requests != built[name].requests


@pytest.mark.parametrize("name", list(PRESETS))
def test_requests_are_ordered_sized_and_chained(name: str, built: dict[str, Workload]) -> None:
    w = built[name]
    assert len(w.requests) == N and w.block_tokens == BLOCK_TOKENS
    assert [r.id for r in w.requests] == list(range(N))
    times = [r.arrival_s for r in w.requests]
    assert times[0] == 0 and times == sorted(times)
    for r in w.requests:
        text = r.input_tokens - r.media_tokens
        assert text >= 1 and r.output_tokens >= 1 and len(r.blocks) == -(-text // BLOCK_TOKENS)
    # Chained ids: a block id always has the same parent, so equal ids mean equal prefixes.
    parent: dict[int, int] = {}
    for r in w.requests:
        for i, block in enumerate(r.blocks):
            assert parent.setdefault(block, r.blocks[i - 1] if i else -1) == (r.blocks[i - 1] if i else -1)
    assert 0 <= infinite_cache_hit_rate(w) < 1


def test_chain_shares_ids_exactly_as_far_as_the_prefix() -> None:
    chain = _Chain()
    a = chain.blocks([("sys", 1024), ("q", 100)])
    b = chain.blocks([("sys", 1024), ("r", 100)])
    c = chain.blocks([("sys", 1000), ("q", 124)])
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert c[0] == a[0] and c[1] != a[1]  # same first 512 tokens, then a different cut of the text
    assert chain.blocks([("sys", 1024), ("q", 100)]) == a
    assert chain.blocks([("other", 1024)])[0] not in a


def test_tenants_share_exactly_their_system_prompt_blocks(built: dict[str, Workload]) -> None:
    by_first: dict[int, list[SimRequest]] = defaultdict(list)
    for r in built["tenants"].requests:
        by_first[r.blocks[0]].append(r)
    assert 20 <= len(by_first) <= 200  # a tenant's system prompt starts with a block of its own
    biggest = max(by_first.values(), key=len)
    assert len(biggest) > N / 20  # Zipf: the busiest tenant sends far more than an equal share
    for group in by_first.values():
        shared = min(_common_prefix(group[0].blocks, r.blocks) for r in group[1:]) if len(group) > 1 else None
        if shared is None:
            continue
        assert 1 <= shared <= 32
        # Exactly the system prompt: its blocks are whole, and nothing after it is shared by two requests.
        tails = [r.blocks[shared:] for r in group]
        assert len({b for t in tails for b in t}) == sum(len(t) for t in tails)


def test_a_session_turn_extends_its_previous_turn(built: dict[str, Workload]) -> None:
    turns: dict[str, list[SimRequest]] = defaultdict(list)
    for r in built["sessions"].requests:
        assert r.session is not None
        turns[r.session].append(r)
    multi = [t for t in turns.values() if len(t) > 1]
    assert len(multi) > 20
    for session in multi:
        for before, after in zip(session, session[1:]):
            full = before.input_tokens // BLOCK_TOKENS  # the previous prompt's whole blocks
            assert after.blocks[:full] == before.blocks[:full]
            assert after.input_tokens > before.input_tokens + before.output_tokens
            assert after.arrival_s > before.arrival_s


def test_agentic_turns_share_their_task_context(built: dict[str, Workload]) -> None:
    tasks: dict[str, list[SimRequest]] = defaultdict(list)
    for r in built["agentic"].requests:
        assert r.session is not None
        tasks[r.session].append(r)
    assert np.mean([len(t) for t in tasks.values()]) > 5  # many turns per task
    for task in tasks.values():
        context = min(len(r.blocks) for r in task)
        assert context >= 6  # the shared agent prompt and task context: thousands of tokens
        assert all(r.blocks[: context - 1] == task[0].blocks[: context - 1] for r in task)
    growth = np.concatenate([np.diff([r.input_tokens for r in task]) for task in tasks.values()])
    assert (growth > 0).all() and np.median(growth) < 2 * BLOCK_TOKENS  # tool calls append small blocks
    first = {t[0].blocks[0] for t in tasks.values()}
    assert len(first) == 1  # one agent framework's prompt before every task


def test_rag_requests_share_chunk_blocks(built: dict[str, Workload]) -> None:
    requests = built["rag"].requests
    assert {r.signature for r in requests} == {"rag+text"}
    assert len({r.blocks[0] for r in requests}) < N  # the instruction prefix starts shared blocks
    # Past the instruction (200 tokens) the second block holds retrieved text: shared by requests of one topic.
    second = defaultdict(int)
    for r in requests:
        second[r.blocks[1]] += 1
    assert max(second.values()) > 10
    assert all(3 * BLOCK_TOKENS < r.input_tokens - 200 <= 5 * BLOCK_TOKENS + 512 for r in requests)


def test_multimodal_carries_media(built: dict[str, Workload]) -> None:
    requests = built["multimodal"].requests
    signatures = {r.signature for r in requests}
    assert signatures == {"text", "image+text", "audio+text", "video+text"}
    for r in requests:
        kind = r.signature.removesuffix("+text")
        assert (r.media_tokens > 0) == (kind != "text") and set(r.media) == ({kind} - {"text"})
        assert r.input_tokens > r.media_tokens
    videos = [r.media_tokens for r in requests if r.signature == "video+text"]
    assert max(videos) > 1280  # several frames, each an image


def test_bursty_arrivals_vary_more_than_poisson(built: dict[str, Workload]) -> None:
    gaps = np.diff([r.arrival_s for r in PRESETS["bursty"](1).requests])
    assert gaps.std() / gaps.mean() > 1.2
    tenants = np.diff([r.arrival_s for r in built["tenants"].requests])
    assert 0.8 < tenants.std() / tenants.mean() < 1.2  # the same mix with Poisson arrivals


def test_ramp_rate_rises_over_the_run() -> None:
    times = np.array([r.arrival_s for r in PRESETS["ramp"](1).requests])
    quarter = times[-1] / 4
    assert (times >= 3 * quarter).sum() > 2 * (times < quarter).sum()


def test_reasoning_is_the_tenants_mix_with_long_replies(built: dict[str, Workload]) -> None:
    """Outside the presets `prism eval` replays, by name like them; the same prompts and arrivals as the tenants'
    at the same seed, only the replies longer (a reasoning model's)."""
    assert "reasoning" in FAMILIES and "reasoning" not in PRESETS
    reasoning, tenants = family_workload("reasoning:1", N), built["tenants"]
    assert reasoning.name == "reasoning-1"
    assert [(r.arrival_s, r.blocks, r.input_tokens) for r in reasoning.requests] == [
        (r.arrival_s, r.blocks, r.input_tokens) for r in tenants.requests
    ]
    chat = np.median([r.output_tokens for r in tenants.requests])
    assert np.median([r.output_tokens for r in reasoning.requests]) > 8 * chat
    assert max(r.output_tokens for r in reasoning.requests) > 4096  # past every chat reply's cap


def test_family_workload_parses_name_and_seed() -> None:
    assert family_workload("rag:2", 50) == PRESETS["rag"](2, 50)
    assert family_workload("rag", 50) == PRESETS["rag"](1, 50)
    assert family_workload("rag", 50).name == "rag-1"
    with pytest.raises(ValueError, match="unknown workload family 'chat'; families: tenants, sessions, agentic"):
        family_workload("chat:1")
    with pytest.raises(ValueError, match="whole number"):
        family_workload("rag:x")
    with pytest.raises(ValueError, match="positive"):
        PRESETS["tenants"](1, 0)


def test_eval_runs_a_family(capsys: pytest.CaptureFixture[str]) -> None:
    """The levels and the goodput search over a family; not the ablations (19 of the 21 searches), which
    test_sim_ablations runs end to end."""
    argv = ["eval", "--workload", "sessions:1", "--no-kill", "--no-report", "--limit", "60", "--jobs", "1"]
    assert main([*argv, "--levels", "80%", "--policies", "prism,least-conn", "--no-ablations", "--no-gray"]) == 0
    printed = capsys.readouterr().out
    assert "sessions-1: 60 requests, prefix-hit bound 0." in printed
    assert "## sessions-1 · 80% utilisation" in printed and "| prism |" in printed and "| least-conn |" in printed
    assert "| sessions-1 | prism |" in printed and "| sessions-1 | least-conn |" in printed
    assert "2 runs and 2 goodput searches" in printed
    assert "mooncake" not in printed  # the shared traces run only when --traces names them
    with pytest.raises(SystemExit, match="unknown workload family"):
        main(["eval", "--workload", "nope", "--no-report"])
