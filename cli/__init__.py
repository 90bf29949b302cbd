"""The `prism` command: one entry point, one subcommand per service or tool.

Exit status 2 with one line on stderr is a usage error (a bad flag value, an unknown name, a number out of
range): argparse's convention, kept to one line for argparse's own errors too. A command reports one by
returning 2 after its line, or, from deeper down, by raising `argparse.ArgumentError`, which `main` turns into
the line and status 2. Status 1 is a failure at run time (a port taken, a file that cannot be read).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence
from typing import NoReturn

from prismlb import agent, brain, demo, router
from prismlb.sim import add_eval_parser

from . import _keys, _train


def _usage_error(prog: str, message: str) -> NoReturn:
    """`prog: message` on stderr and exit status 2. The SystemExit's text is the message (its code is 2), for
    callers that run `main` in their own process."""
    print(f"{prog}: {message}", file=sys.stderr)
    exit_ = SystemExit(message)
    exit_.code = 2
    raise exit_


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its usage errors in one line, pointing at --help instead of printing the usage;
    subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        _usage_error(self.prog, f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="prism", description="Prism: load balancing for multimodal LLM inference")
    parser.add_argument("--version", action="version", version=f"prism {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    agent.add_parser(subparsers)
    brain.add_parser(subparsers)
    brain.add_ctl_parsers(subparsers)
    router.add_parser(subparsers)
    _keys.add_parser(subparsers)
    demo.add_parser(subparsers)
    add_eval_parser(subparsers)
    _train.add_parser(subparsers)
    return parser


def _version() -> str:
    """The installed distribution's version ("unknown" when run from a tree that was never installed)."""
    try:
        return importlib.metadata.version("prism-lb")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except argparse.ArgumentError as exc:
        _usage_error(f"{parser.prog} {args.command}", str(exc))


__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
