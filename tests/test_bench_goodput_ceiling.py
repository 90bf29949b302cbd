"""bench/goodput_ceiling.py: the summary's goodputs as read, and the cache-bound capacity's rule."""

from __future__ import annotations

from types import ModuleType

import pytest

from prismlb.sim._eval import SEARCH_LIMIT, _workload

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
    name, bound, top = bench.ceiling("rag:1")
    workload, expected = _workload("rag:1", 1, SEARCH_LIMIT)
    assert (name, bound) == (workload.name, expected) and 0 < bound < 1
    assert top == pytest.approx(1 / (1 - bound))


def test_encoders_no_cache_spares_lower_a_multimodal_workloads_capacity(bench: ModuleType) -> None:
    _, bound, top = bench.ceiling("multimodal:1")
    assert 1 < top < 1 / (1 - bound)
