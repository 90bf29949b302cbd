"""`prism keys`: write a CURVE key pair."""

from __future__ import annotations

import argparse
from pathlib import Path

from prismlb.wire import generate_keypair


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("keys", help="write a CURVE key pair (NAME.key public, NAME.key_secret secret)")
    p.add_argument("name", help="key name, e.g. brain or the node id")
    p.add_argument("--dir", default=".", type=Path, help="folder to write into (created if missing)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    public, secret = generate_keypair(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret} (mode 0600; keep it on this host)")
    return 0
