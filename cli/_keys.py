"""`prism keys`: write a CURVE key pair."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from prismlb.wire import generate_keypair

# where the brain expects each role's public key: agents and routers have separate folders (and ZAP domains),
# so a key admitted for one role is refused in the other
_FILING = {
    "agent": (
        "file {public} in the brain's agents folder (--curve-clients) as {name}.key; {name} must be the node id. "
        "Unless the agent advertises an endpoint at the address it connects from, also file {name}.endpoints "
        "there (one host or host:port a line)"
    ),
    "router": "file {public} in the brain's routers folder (--curve-routers) as {name}.key",
}


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
"""A node id's characters (`wire.NodeId`): a key's name is a file name in `--dir`, never a path out of it."""


def _name(text: str) -> str:
    if not _NAME.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a key name: letters, digits and . _ : @ - (a node id), starting with a letter or digit; "
            "choose the folder with --dir"
        )
    return text


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "keys",
        help="write a CURVE key pair (NAME.key public, NAME.key_secret secret)",
        description="Write a CURVE key pair for the brain, an agent (named after its node id) or a router.",
    )
    p.add_argument("name", type=_name, help="key name, e.g. brain or the node id")
    p.add_argument("--dir", default=".", type=Path, help="folder to write into (created if missing)")
    p.add_argument(
        "--role", choices=sorted(_FILING), help="whose key this is: the printout says where the brain wants it"
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    public, secret = generate_keypair(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret} (mode 0600; keep it on this host)")
    if args.role is not None:
        print(_FILING[args.role].format(public=public, name=args.name))
    return 0
