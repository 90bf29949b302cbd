"""Simulation and trace replay support; `EmulatedEngine` is an emulator of a vLLM-like inference server."""

from ._engine import EmulatedEngine, block_hashes, prompt_tokens
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
    offered_utilisation,
    scale_to_utilisation,
    servegen_mm,
)

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
    "Workload",
    "azure",
    "block_hashes",
    "infinite_cache_hit_rate",
    "load",
    "mooncake_conversation",
    "offered_utilisation",
    "prompt_tokens",
    "scale_to_utilisation",
    "servegen_mm",
    "traces_dir",
]
