"""bench/live_routers.py's replay check: each contender's replay model on the live run's requests and cluster,
and the verdict on whether live and replay order the contenders alike."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import ModuleType

import jinja2
import pytest

from prismlb.demo import DemoRequest
from prismlb.sim import PROFILES
from prismlb.sim._engine import CHARS_PER_TOKEN, request_tokens

from .conftest import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("live_routers")


def outcome(bench: ModuleType, contender: object, p99_ms: float) -> object:
    return bench.Outcome(contender, "v", answered=100, ttft_ms=[p99_ms] * 100)


def test_agreement_names_the_pairs_ordered_differently(bench: ModuleType) -> None:
    by_name = {(c.name, c.policy): c for c in bench.CONTENDERS}
    prism = by_name["prism", "expected TTFT, prefix index"]
    sglang, power = by_name["sglang", "cache_aware"], by_name["sglang", "power_of_two"]
    kv, cache = by_name["vllm", "kv_aware"], by_name["vllm", "cache_aware"]
    live = [outcome(bench, prism, 900), outcome(bench, sglang, 1200), outcome(bench, kv, 700)]
    live += [outcome(bench, power, 5000), outcome(bench, cache, 1100)]
    replayed = {"prism": 1000.0, "sglang": 1500.0, "vllm-kv-aware": 800.0}
    lines = bench.agreement(live, replayed)
    assert lines[2].startswith("| vllm kv_aware | 700 ms | 1 | vllm-kv-aware | 800 ms | 1 |")
    assert not any("power_of_two" in line for line in lines), "no replay model: not in the comparison"
    assert lines[-1] == "Live and replay orderings of contenders with different models agree."
    replayed["vllm-kv-aware"] = 1200.0
    verdict = bench.agreement(live, replayed)[-1]
    assert verdict == (
        "Live and replay orderings of contenders with different models disagree on 1 of 5: "
        "prism expected TTFT, prefix index / vllm kv_aware."
    )


def test_replay_models_run_on_the_live_cluster(bench: ModuleType) -> None:
    p99 = bench.replay_p99_ms(bench.CONTENDERS, 60, 0.6)
    assert set(p99) == {"prism", "4-routers", "4-routers-own-turns", "sglang", "vllm-kv-aware", "dynamo-kv"}
    assert all(value > 0 for value in p99.values())


def test_the_cluster_is_any_list_of_known_gpu_classes(bench: ModuleType) -> None:
    assert bench.gpu_classes(" A100, a100,l40s ,") == ("a100", "a100", "l40s")
    for bad in ("a100,b200", "", " , "):
        with pytest.raises(argparse.ArgumentTypeError, match="unknown GPU class"):
            bench.gpu_classes(bad)
    p99 = bench.replay_p99_ms(bench.CONTENDERS[:1], 60, 0.6, gpus=("a100",) * 4)
    slower = bench.replay_p99_ms(bench.CONTENDERS[:1], 60, 0.6, gpus=("l40s",) * 4)
    assert slower["prism"] > p99["prism"], "the same requests and load on slower engines wait longer"


def test_rounds_pool_their_requests_and_keep_each_rounds_p99(bench: ModuleType) -> None:
    prism = bench.CONTENDERS[0]
    fast = bench.Outcome(prism, "v", answered=100, ttft_ms=[100.0] * 100, shares={"a": 0.8, "b": 0.2}, wall_s=40.0)
    fast.within_slo = 100
    slow = bench.Outcome(prism, "v", answered=99, lost=1, ttft_ms=[300.0] * 99, shares={"a": 0.4, "b": 0.6})
    slow.within_slo = 80
    slow.errors, slow.wall_s, slow.prompt_tokens, slow.cached_tokens = {"HTTPStatusError": 1}, 42.0, 1000, 250
    assert bench.pooled([fast]) is fast, "one round is reported as it ran"
    both = bench.pooled([fast, slow])
    assert (both.answered, both.lost, both.errors, len(both.ttft_ms)) == (199, 1, {"HTTPStatusError": 1}, 199)
    assert both.round_p99_ms == [100.0, 300.0]
    assert both.shares == pytest.approx({"a": 0.6, "b": 0.4}) and both.wall_s == 42.0
    head, _, row = bench.table([both], ["a", "b"])
    assert "| p99 by round |" in head and "| 100, 300 ms |" in row and "| 25.0% | 60% | 40% |" in row
    assert both.within_slo == 180 and "| 1 | 1 | 89.6% |" in row, "errors and lost requests miss their SLO"
    assert "p99 by round" not in bench.table([fast], ["a", "b"])[0], "one round: the table as before"
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])


def test_the_slo_is_the_replays_on_the_engines_slowed_clock(bench: ModuleType) -> None:
    def request(tokens: int) -> object:
        return bench.DemoRequest(0, 0.0, "x" * tokens * CHARS_PER_TOKEN, 8, "k")

    l40s = PROFILES["l40s"].prefill_tokens_per_s
    gpus = ("h100", "l40s")
    assert bench.slo_ms(request(10), 4.0, gpus) == pytest.approx(4 * 800), "a short prompt: τ0, four times slower"
    long = 20 * int(l40s)  # 20 s alone on the slowest engine: its SLO is five times that
    assert bench.slo_ms(request(long), 2.0, gpus) == pytest.approx(2 * 5 * 20_000, rel=1e-3)
    assert bench.slo_ms(request(long), 2.0, ("h100",)) < bench.slo_ms(request(long), 2.0, gpus)


def test_dynamos_tokenizer_gives_the_ids_the_engines_kv_events_carry(bench: ModuleType, tmp_path: Path) -> None:
    """Dynamo's frontend renders the chat template and splits the text with the tokenizer's pattern into words it
    looks up; done here with Python's `re` and jinja2, as `tokenizers` (not in Prism's environment) does it."""
    texts = ["the quick brown fox jumps over", "the quick brown fox jumps over the lazy dog\nagain", "ab"]
    requests = [DemoRequest(i, 0.0, text, 4, "k") for i, text in enumerate(texts)]
    out = bench.dynamo_model_dir(requests, tmp_path / "model")
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    template = json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    vocab = tokenizer["model"]["vocab"]
    pattern = tokenizer["pre_tokenizer"]["pattern"]["Regex"]
    for text in texts:
        messages = [{"role": "user", "content": text}]
        rendered = jinja2.Template(template).render(messages=messages)
        assert rendered == text
        ids = [vocab[word] for word in re.findall(pattern, rendered)]
        assert ids == request_tokens({"messages": messages})
    two = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert jinja2.Template(template).render(messages=two) == "be brief\nhi", "joined as the engines join them"
    assert vocab["<eos>"] == 0 and vocab["tok "] == 1, "the worker's output token is not the end of sequence"
