"""The `prism` command: one entry point, one subcommand per service or tool."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from prismlb import agent, brain, router
from prismlb.sim import _eval

from . import _demo, _keys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prism", description="Prism: load balancing for multimodal LLM inference")
    parser.add_argument("--version", action="version", version=f"prism {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    agent.add_parser(subparsers)
    brain.add_parser(subparsers)
    brain.add_ctl_parsers(subparsers)
    router.add_parser(subparsers)
    _keys.add_parser(subparsers)
    _demo.add_parser(subparsers)
    _eval.add_parser(subparsers)
    return parser


def _version() -> str:
    """The installed distribution's version ("unknown" when run from a tree that was never installed)."""
    try:
        return importlib.metadata.version("prism-lb")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
