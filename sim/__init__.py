"""Simulation and trace replay support; `EmulatedEngine` is an emulator of a vLLM-like inference server."""

from ._engine import PROFILES, EmulatedEngine, GpuProfile, block_hashes, prompt_tokens
from ._traces import traces_dir

__all__ = ["PROFILES", "EmulatedEngine", "GpuProfile", "block_hashes", "prompt_tokens", "traces_dir"]
