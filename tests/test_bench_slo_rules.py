"""bench/slo_rules.py: the scorers each part swaps in, the batch class, and Prism told the batch requests' SLO."""

from __future__ import annotations

from types import ModuleType

import pytest

from prismlb.semantics import ttft_slo_s
from prismlb.sim import _ablations, _slo
from prismlb.sim._eval import _workload, cluster_for
from prismlb.sim._slo import Goodput

from .conftest import load_bench


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The bench, with the scorer, the goodput target and the variants restored after the test."""
    monkeypatch.setattr(_slo, "slo_s", _slo.slo_s)
    monkeypatch.setattr(_slo, "GOODPUT_TARGET", _slo.GOODPUT_TARGET)
    module = load_bench("slo_rules")
    monkeypatch.setitem(_ablations.VARIANTS, module.TOLD, None)
    return module


def test_each_part_scores_by_its_own_rule_and_registers_prism_told(bench: ModuleType) -> None:
    workload, _ = _workload("tenants:1", 1, 300)
    classes = _slo.pool_classes(cluster_for("tenants:1", workload))
    rule = {r.id: _slo.slo_s(r, classes) for r in workload.requests}
    long = max(workload.requests, key=lambda r: r.input_tokens)
    assert rule[long.id] > 0.8, "the longest prompt's SLO is its scaled prefill, above τ0"

    bench.score("scale", 10.0)
    slowest = max(_slo.unloaded_ttft_s(long, c) for c in classes[_slo.slice_of(long)])
    assert _slo.slo_s(long, classes) == pytest.approx(ttft_slo_s(_slo.slice_of(long), slowest, 10.0))
    assert _slo.slo_s(long, classes) == pytest.approx(2 * rule[long.id])
    assert _ablations.VARIANTS[bench.TOLD](16).routers[0].settings.slo_scale == 10.0
    assert _slo.GOODPUT_TARGET == 0.9

    bench.score("target", 5.0)
    assert _slo.GOODPUT_TARGET == 0.99 and _slo.slo_s(long, classes) == rule[long.id]

    bench.score("classes", 5.0)
    batch = [r for r in workload.requests if bench.is_batch(r)]
    assert 0.2 < len(batch) / len(workload.requests) < 0.4
    for r in workload.requests:
        expected = max(bench.BATCH_S, rule[r.id]) if bench.is_batch(r) else rule[r.id]
        assert _slo.slo_s(r, classes) == expected
    told = _ablations.VARIANTS[bench.TOLD](16)
    assert {told._request(r).slo_s for r in batch} == {bench.BATCH_S}
    assert all(told._request(r).slo_s is None for r in workload.requests if not bench.is_batch(r))


def test_the_told_rows_stand_as_prism_in_their_own_table(bench: ModuleType) -> None:
    rows = [
        Goodput("w", "prism", 1.0, 1.0, 0.9, None, None, ()),
        Goodput("w", bench.TOLD, 1.2, 1.2, 0.9, None, None, ()),
        Goodput("w", "sglang", 0.8, 0.8, 0.9, None, None, ()),
    ]
    assert [(r.policy, r.utilisation) for r in bench.told_in_place(rows)] == [("prism", 1.2), ("sglang", 0.8)]
