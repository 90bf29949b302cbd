"""`prism route`: print where keys go on the brain's current table, or render it as nginx upstreams and print
where nginx sends keys there."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prismlb.service import BRAIN_SNAPSHOT, BRAIN_UPDATES, SettingTable
from prismlb.wire import BrainAddress, ClientCurve, ConfigError, NoRouteError, RoutingTable

from ._nginx import DEFAULT_HASH, check_nginx_settings, nginx_choices, render_nginx
from ._router import Router

_SETTINGS = SettingTable("route", [BRAIN_UPDATES, BRAIN_SNAPSHOT])
"""The brain's endpoints, under the brain's own flags and variables."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "route",
        help="print where keys go on the brain's current table, or render it for nginx",
        description="Fetch the brain's current routing table and print the node a Prism router sends each key to. "
        "With --nginx, print the table as nginx upstream blocks instead, or with keys the server nginx's "
        "`hash ... consistent` picks for each in those blocks (its ring is not the router's: the two choose "
        "differently).",
    )
    _SETTINGS.add_arguments(parser)
    parser.add_argument(
        "--slice", help="slice to route in or render (default: the text slice, else 'default'; --nginx: every slice)"
    )
    parser.add_argument("--curve-secret", type=Path, metavar="FILE", help="our CURVE secret key file")
    parser.add_argument("--brain-public", type=Path, metavar="FILE", help="the brain's CURVE public key file")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a table (default: %(default)s)")
    parser.add_argument(
        "--nginx",
        action="store_true",
        help="print the table as nginx upstream blocks instead, or with keys where nginx sends them there",
    )
    parser.add_argument("--max-fails", type=int, default=1, help="nginx max_fails per server (default: %(default)s)")
    parser.add_argument(
        "--fail-timeout", type=float, default=10.0, help="nginx fail_timeout in seconds (default: %(default)s)"
    )
    parser.add_argument(
        "--nginx-hash",
        default=DEFAULT_HASH,
        help="nginx variable to hash on, '' for weighted round robin (default: %(default)s)",
    )
    parser.add_argument(
        "--nginx-listen",
        metavar="[HOST:]PORT",
        help="with --nginx: add a server block on this address proxying to the slice's upstream (needs --slice "
        "when the table has several slices)",
    )
    parser.add_argument(
        "keys", nargs="*", help="affinity keys (with --nginx: values of the --nginx-hash variable) to route"
    )
    parser.set_defaults(func=_run)


def _fail(message: str, status: int) -> int:
    """`status` after one line on stderr: 2 for a usage error, 1 for a failure."""
    print(f"prism route: {message}", file=sys.stderr)
    return status


def _run(args: argparse.Namespace) -> int:
    if not args.keys and not args.nginx:
        return _fail("give keys to route, or --nginx", 2)
    if (args.curve_secret is None) != (args.brain_public is None):
        return _fail("--curve-secret and --brain-public must be given together", 2)
    if not args.timeout > 0:
        return _fail(f"--timeout must be positive, got {args.timeout:g}", 2)
    if args.nginx_listen is not None and (args.keys or not args.nginx):
        return _fail("--nginx-listen adds a server block to --nginx's config: give it with --nginx and no keys", 2)
    if args.nginx and args.keys and not args.nginx_hash:
        return _fail("with --nginx-hash '' nginx balances round robin, so a key has no server of its own", 2)
    try:
        check_nginx_settings(args.max_fails, args.fail_timeout, args.nginx_hash, args.nginx_listen)
    except ValueError as exc:
        return _fail(str(exc), 2)
    curve = None if args.curve_secret is None else ClientCurve(args.curve_secret, args.brain_public)
    try:
        brain = _SETTINGS.resolve(args, os.environ)
        router = Router.connect(BrainAddress(brain["updates"], brain["snapshot"]), curve=curve)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    with router:
        router.wait_for_table(args.timeout)
    # Closed: the router stops following the brain and keeps this table, so every key uses the same one.
    table = router.table
    if table is None:
        return _fail(f"no routing table from {brain['updates']} / {brain['snapshot']} within {args.timeout:g} s", 1)
    names = sorted(s.name for s in table.slices)
    if args.slice is not None and args.slice not in names:
        return _fail(
            f"no slice {args.slice!r} in table epoch {table.epoch} version {table.version} (slices: "
            f"{', '.join(names) or 'none'})",
            2,
        )
    if args.nginx and not args.keys:
        try:
            text = render_nginx(
                table,
                slice_name=args.slice,
                max_fails=args.max_fails,
                fail_timeout_s=args.fail_timeout,
                hash_key=args.nginx_hash,
                listen=args.nginx_listen,
            )
        except ValueError as exc:
            return _fail(str(exc), 2)
        print(text, end="")
        return 0
    try:
        taken = router.slice_of(args.slice)
        if args.nginx:
            return _print_nginx_choices(table, args.slice or taken, args.keys, args.nginx_hash)
        where = f"slice {taken!r}" if taken == (args.slice or taken) else f"slice {taken!r} ({args.slice!r} is empty)"
        print(f"table epoch {table.epoch} version {table.version}, {where}")
        for key in args.keys:
            endpoint = router.route(key, args.slice)
            print(f"{key} -> {endpoint.node_id} {endpoint.address}")
    except NoRouteError as exc:
        return _fail(str(exc), 1)
    return 0


def _print_nginx_choices(table: RoutingTable, slice_name: str, keys: list[str], hash_key: str) -> int:
    """Where nginx, with the upstream `--nginx` renders for `slice_name`, sends a request whose `hash_key` is each
    key: the node ids at that server and the server."""
    try:
        choices = nginx_choices(table, keys, slice_name)
    except ValueError as exc:
        return _fail(str(exc), 1)
    upstream = choices[0].upstream
    print(f"table epoch {table.epoch} version {table.version}, nginx upstream {upstream} (hash {hash_key} consistent)")
    for key, choice in zip(keys, choices, strict=True):
        if choice.server is None:
            print(f"{key!r} -> round robin (nginx hashes no empty key)")
        else:
            print(f"{key} -> {','.join(choice.node_ids)} {choice.server}")
    return 0
