"""The BPF C programs the agent loads through bcc, shipped as package data."""

from __future__ import annotations

from importlib.resources import files


def program_text(name: str) -> str:
    """The source of the BPF program `name` (e.g. "conntrack" for conntrack.c)."""
    resource = files(__name__).joinpath(f"{name}.c")
    if not resource.is_file():
        raise FileNotFoundError(f"no BPF program {name!r} in {__name__}")
    return resource.read_text(encoding="utf-8")


__all__ = ["program_text"]
