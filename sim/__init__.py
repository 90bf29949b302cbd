"""Simulation and trace replay support; `EmulatedEngine` is an emulator of a vLLM-like inference server.

`train_failover` (torch) is imported on first use."""

from typing import TYPE_CHECKING, Any

from ._engine import EmulatedEngine, block_hashes, prompt_tokens, request_tokens
from ._eval import add_parser as add_eval_parser
from ._eval import resolve_workload
from ._model import PROFILES, EngineModel, GpuProfile, Job
from ._traces import traces_dir
from ._types import ClusterView, EngineStats, Outcome, Policy, RunResult, SimNode, SimRequest, SliceStats, Workload
from ._workload import (
    BLOCK_TOKENS,
    LEVELS,
    MOONCAKE_TRACE,
    WORKLOADS,
    azure,
    infinite_cache_hit_rate,
    load,
    mooncake_conversation,
    mooncake_tokens,
    offered_utilisation,
    scale_to_utilisation,
    servegen_mm,
)

if TYPE_CHECKING:
    from ._failover_train import TrainReport, train_failover


def __getattr__(name: str) -> Any:
    if name in ("TrainReport", "train_failover"):
        from . import _failover_train

        return getattr(_failover_train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BLOCK_TOKENS",
    "LEVELS",
    "MOONCAKE_TRACE",
    "PROFILES",
    "WORKLOADS",
    "ClusterView",
    "EmulatedEngine",
    "EngineModel",
    "EngineStats",
    "GpuProfile",
    "Job",
    "Outcome",
    "Policy",
    "RunResult",
    "SimNode",
    "SimRequest",
    "SliceStats",
    "TrainReport",
    "Workload",
    "add_eval_parser",
    "azure",
    "block_hashes",
    "infinite_cache_hit_rate",
    "load",
    "mooncake_conversation",
    "mooncake_tokens",
    "offered_utilisation",
    "prompt_tokens",
    "request_tokens",
    "resolve_workload",
    "scale_to_utilisation",
    "servegen_mm",
    "traces_dir",
    "train_failover",
]
