"""`prism ctl` (inspect tables, drain nodes, set experiments) and `prism top` (a live view), both over the
brain's admin API."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prismlb.service import Setting, SettingTable
from prismlb.wire import ConfigError

from ._config import SETTINGS as BRAIN_SETTINGS

DEFAULT_ADMIN = "http://127.0.0.1:9470"
SLICES = ("llm", "vlm", "av", "rag")
_TOKEN = dataclasses.replace(
    BRAIN_SETTINGS["admin_token_file"],
    name="token_file",
    help="file with the brain's admin token (the brain's own setting, so one variable serves both)",
    flag="--token-file",
)
CTL_SETTINGS = SettingTable(
    "prism ctl",
    [
        Setting("admin", "the brain's admin URL", default=DEFAULT_ADMIN, flag="--admin", variable="PRISM_BRAIN_ADMIN"),
        _TOKEN,
    ],
)
"""The admin client's settings: the brain's URL and its token file (the brain's `admin_token_file` setting)."""
TOKEN_ENV = _TOKEN.variable


class CtlError(Exception):
    """The admin API could not be reached or refused the request."""


def call(
    admin: str,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    timeout_s: float = 5.0,
    token: str | None = None,
) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(admin.rstrip("/") + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except (ValueError, AttributeError):
            message = exc.reason
        hint = f" (give the brain's token with --token-file or {TOKEN_ENV})" if exc.code == 401 and not token else ""
        raise CtlError(f"{method} {path}: {exc.code} {message}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise CtlError(f"cannot reach the brain's admin API at {admin}: {getattr(exc, 'reason', exc)}") from None


def _admin_arg(p: argparse.ArgumentParser) -> None:
    CTL_SETTINGS.add_arguments(p)


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    ctl = subparsers.add_parser(
        "ctl",
        help="inspect and steer a running brain",
        description="Inspect and steer a running brain through its admin API: status, drain and undrain nodes, "
        "set or remove A/B experiments.",
    )
    _admin_arg(ctl)
    commands = ctl.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")
    for name, help_text in (
        ("status", "nodes, weights, predictions and alarms"),
        ("table", "the current routing table as JSON"),
        ("events", "recent drift events and guardian transitions"),
        ("experiments", "the A/B experiments"),
    ):
        commands.add_parser(name, help=help_text)
    for name in ("drain", "undrain"):
        p = commands.add_parser(name, help=f"{name} a node")
        p.add_argument("node_id")
    experiment = commands.add_parser("experiment", help="set or remove an A/B experiment")
    experiment.add_argument("action", choices=("set", "rm"))
    experiment.add_argument("name")
    experiment.add_argument("--slice", choices=SLICES)
    experiment.add_argument("--arm", action="append", default=[], metavar="VERSION=FRACTION")
    ctl.set_defaults(func=_ctl)

    top = subparsers.add_parser(
        "top",
        help="live view of nodes, weights, predictions, alarms and tables",
        description="A live view of a running brain: its nodes, weights, predictions, alarms and tables.",
    )
    _admin_arg(top)
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(func=_top)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    try:
        return dict(CTL_SETTINGS.resolve(args, os.environ).values)
    except ConfigError as exc:
        raise CtlError(str(exc)) from None


def _admin(args: argparse.Namespace) -> str:
    return str(_settings(args)["admin"])


def _token(args: argparse.Namespace) -> str | None:
    """The token from --token-file or the brain's own variable; the brain checks the file's mode, not us, since
    an operator reading a copy they own is fine."""
    path = _settings(args)["token_file"]
    if not path:
        return None
    try:
        token = Path(path).read_text(encoding="ascii", errors="replace").strip()
    except OSError as exc:
        raise CtlError(f"cannot read the admin token file {path}: {exc.strerror}") from None
    if not token:
        raise CtlError(f"the admin token file {path} is empty")
    return token


def _arms(items: list[str]) -> dict[str, float]:
    """`--arm VERSION=FRACTION` flags as {version: fraction}; argparse.ArgumentError (a usage error) for a bad one."""
    arms: dict[str, float] = {}
    for item in items:
        version, sep, fraction = item.partition("=")
        try:
            arms[version] = float(fraction)
        except ValueError:
            raise argparse.ArgumentError(None, f"--arm {item!r}: expected VERSION=FRACTION") from None
        if not sep or not version:
            raise argparse.ArgumentError(None, f"--arm {item!r}: expected VERSION=FRACTION")
    return arms


def _ctl(args: argparse.Namespace) -> int:
    try:
        admin, token = _admin(args), _token(args)
        command = args.ctl_command
        if command in ("status", "table", "events", "experiments"):
            result = call(admin, "GET", f"/v1/{command}", token=token)
        elif command in ("drain", "undrain"):
            result = call(admin, "POST", f"/v1/nodes/{args.node_id}/{command}", token=token)
        elif args.action == "rm":
            result = call(admin, "DELETE", f"/v1/experiments/{args.name}", token=token)
        else:
            if not args.slice or not args.arm:
                raise argparse.ArgumentError(
                    None, "experiment set needs --slice and at least one --arm VERSION=FRACTION"
                )
            body = {"slice": args.slice, "arms": _arms(args.arm)}
            result = call(admin, "PUT", f"/v1/experiments/{args.name}", body, token=token)
    except CtlError as exc:
        print(f"prism ctl: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str))
    return 0


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def render(status: dict[str, Any]) -> str:
    """One frame of `prism top` from an admin status document."""
    lines = [
        f"prism brain  table {status.get('epoch')}.{status.get('version')}  "
        f"guardian {status.get('guardian', '?')}  shed {','.join(status.get('shed_classes', [])) or '-'}  "
        f"predictor {status.get('predictor', '-')}  nodes {len(status.get('nodes', []))}",
        "",
        f"{'NODE':<24} {'ZONE':<8} {'HEALTH':>6} "
        + " ".join(f"{s.upper():>5}" for s in SLICES)
        + f" {'P99 PRED':>9} {'P99 SEEN':>9} {'STALL':>6} {'ADMIT':>6} {'AGE s':>6}  ALARMS",
    ]
    for node in status.get("nodes", []):
        weights = node.get("weights", {})
        name = node["node_id"] + (" (drained)" if node.get("drained") else "")
        lines.append(
            f"{name:<24} {node.get('zone', ''):<8} {_fmt(node.get('health')):>6} "
            + " ".join(f"{_fmt(weights.get(s)):>5}" for s in SLICES)
            + f" {_fmt(node.get('predicted_p99_ms'), '.0f'):>9} {_fmt(node.get('observed_p99_ms'), '.0f'):>9}"
            + f" {_fmt(node.get('stall_ms'), '.0f'):>6} {_fmt(node.get('admit_ms'), '.0f'):>6}"
            + f" {_fmt(node.get('age_s'), '.1f'):>6}"
            + f"  {','.join(node.get('alarms', [])) or '-'}"
        )
    return "\n".join(lines)


def _top(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise argparse.ArgumentError(None, f"--interval must be positive, got {args.interval:g}")
    try:
        admin, token = _admin(args), _token(args)
    except CtlError as exc:
        print(f"prism top: {exc}", file=sys.stderr)
        return 1
    try:
        while True:
            try:
                frame = render(call(admin, "GET", "/v1/status", token=token))
            except CtlError as exc:
                if args.once:
                    print(f"prism top: {exc}", file=sys.stderr)
                    return 1
                frame = f"prism top: {exc} (retrying)"
            if args.once:
                print(frame)
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + frame + "\n")
            sys.stdout.flush()
            time.sleep(max(0.1, args.interval))
    except KeyboardInterrupt:
        return 0
