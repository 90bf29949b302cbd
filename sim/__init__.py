"""Simulation and trace replay support; `EmulatedEngine` is an emulator of a vLLM-like inference server."""

from ._engine import EmulatedEngine, block_hashes, prompt_tokens
from ._model import PROFILES, EngineModel, GpuProfile, Job
from ._traces import traces_dir

__all__ = [
    "PROFILES",
    "EmulatedEngine",
    "EngineModel",
    "GpuProfile",
    "Job",
    "block_hashes",
    "prompt_tokens",
    "traces_dir",
]
