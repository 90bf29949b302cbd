"""Simulation and trace replay support."""

from ._traces import traces_dir

__all__ = ["traces_dir"]
