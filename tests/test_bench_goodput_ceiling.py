"""bench/goodput_ceiling.py: the summary's goodputs as read, the cache-bound capacity's rule and the decode batch's
stretch."""

from __future__ import annotations

from types import ModuleType

import pytest

from prismlb.sim._eval import SEARCH_LIMIT, TEXT_CLUSTER, _workload, request_rate
from prismlb.sim._model import DECODE_INTERFERENCE, PROFILES

from .conftest import load_bench

SUMMARY = """# Replay summary

## Goodput

| workload | prism | sglang | llm-d | best baseline | Prism / best |
| :--- | ---: | ---: | ---: | :--- | ---: |
| rag-1 | 137% | 123% | 116% | sglang | 1.11× |
| agentic-1 | ≥ 1280% | 263% | 349% | llm-d | 1.79× |
| azure-code | 14% | < 10% | < 10% | – | – |

## Goodput under a gray failure

| workload | prism | sglang | llm-d | best baseline | Prism / best |
| :--- | ---: | ---: | ---: | :--- | ---: |
| rag-1 | 99% | 98% | 97% | sglang | 1.01× |
"""


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("goodput_ceiling")


def test_the_sound_clusters_table_is_read_with_cells_at_the_searchs_bounds(bench: ModuleType) -> None:
    assert bench.recorded(SUMMARY) == {"rag-1": (123.0, 137.0), "agentic-1": (349.0, 1280.0)}


def test_a_text_workloads_capacity_is_its_work_left_by_an_infinite_cache(bench: ModuleType) -> None:
    name, bound, top, _ = bench.ceiling("rag:1")
    workload, expected = _workload("rag:1", 1, SEARCH_LIMIT)
    assert (name, bound) == (workload.name, expected) and 0 < bound < 1
    assert top == pytest.approx(1 / (1 - bound))


def test_encoders_no_cache_spares_lower_a_multimodal_workloads_capacity(bench: ModuleType) -> None:
    _, bound, top, _ = bench.ceiling("multimodal:1")
    assert 1 < top < 1 / (1 - bound)


def test_the_decode_batch_is_littles_law_at_its_own_time_per_token(bench: ModuleType) -> None:
    workload, _ = _workload("sessions:1", 1, SEARCH_LIMIT)
    rate = 2 * request_rate("sessions:1", 1, SEARCH_LIMIT, 1.0)
    stretch = bench.decode_stretch(workload, TEXT_CLUSTER, rate)
    profile = PROFILES["a100"]  # the text cluster's one class
    decoding = (stretch - 1) * profile.max_batch / DECODE_INTERFERENCE
    outputs = sum(r.output_tokens - 1 for r in workload.requests) / len(workload.requests)
    assert decoding > 1
    tpot_s = (1 + profile.decode_batch_slope * (decoding - 1)) / profile.decode_tokens_per_s  # `tpot_s`, unrounded
    assert decoding == pytest.approx(rate / len(TEXT_CLUSTER) * outputs * tpot_s)
    assert bench.decode_stretch(workload, TEXT_CLUSTER, rate / 2) < stretch
    assert bench.decode_stretch(workload, TEXT_CLUSTER, 1e9) == float("inf")


def test_the_decode_adjusted_capacity_is_the_load_whose_stretched_work_fits(bench: ModuleType) -> None:
    _, _, top, adjusted = bench.ceiling("sessions:1")
    workload, _ = _workload("sessions:1", 1, SEARCH_LIMIT)
    rate = request_rate("sessions:1", 1, SEARCH_LIMIT, adjusted)
    assert 0.5 * top < adjusted < top
    assert adjusted * bench.decode_stretch(workload, TEXT_CLUSTER, rate) == pytest.approx(top, rel=1e-6)
