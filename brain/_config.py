"""The brain's settings: every flag and environment variable in one table (`SETTINGS`), resolved by the settings
resolver of `prismlb.wire` (flag, then variable, then default); what one setting says about another is checked
here."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from prismlb.service import (
    BRAIN_INGEST,
    BRAIN_SNAPSHOT,
    BRAIN_UPDATES,
    CURVE_SECRET,
    Setting,
    SettingParser,
    SettingTable,
    parse_listen_address,
    parse_number,
    parse_port,
    parse_text,
)
from prismlb.wire import AGENTS_DOMAIN, ROUTERS_DOMAIN, ConfigError, ServerCurve

from ._admin import AdminAccess, admin_access
from ._weights import LATENCY_WEIGHTS


@dataclass(frozen=True)
class BrainConfig:
    """How the brain runs: what `resolve_config` makes from its settings, or what a test or replay sets."""

    ingest: str = BRAIN_INGEST.default
    updates: str = BRAIN_UPDATES.default
    snapshot: str = BRAIN_SNAPSHOT.default
    stale_periods: float = 3.0
    heartbeat_s: float = 1.0
    cycle_s: float = 0.2
    state_dir: Path | None = None
    curve: ServerCurve | None = None
    """Ingest CURVE: agents' keys, ZAP domain `AGENTS_DOMAIN`; set together with `curve_routers`."""
    curve_routers: ServerCurve | None = None
    """Tables and snapshots CURVE: routers' keys, ZAP domain `ROUTERS_DOMAIN`."""
    allow_plaintext: bool = False
    """CURVE off on a bind beyond this host without the start-up warning: the operator trusts the network."""
    metrics_port: int = 0
    metrics_addr: str = "0.0.0.0"
    """Every interface, so that the cluster's Prometheus can scrape the brain; read-only, so no token needed."""
    admin_port: int = 9470
    admin_addr: str = "127.0.0.1"
    admin_access: AdminAccess = AdminAccess()  # token (if any), public reads, insecure, allowed Host names
    scale_hook: str | None = None  # a command or an http(s):// webhook called on SCALE_UP
    predict_period_s: float = 1.0
    control_period_s: float = 5.0
    train_budget_s: float = 0.5  # CPU seconds of training ...
    train_interval_s: float = 5.0  # ... per this many seconds: 10% of one core
    brain_id: str = ""
    """This brain's name in its tables and heartbeats (default: the host name and the updates endpoint)."""
    priority: int = 0
    """Routers follow the live brain with the highest (priority, brain_id); -1000 to 1000."""
    holddown_s: float = 10.0
    """After a start, the longest the brain waits before its first table while it has not yet heard from
    `restart_quorum` of the nodes its state folder knew (or, without a state folder, from any node)."""
    failover_model: Path | None = None
    """The failover scheduler's student (`prism train failover`); None or a missing file: the rule-based split."""
    failover_reload_s: float = 600.0
    """How often the brain looks for a new student in `failover_model` and switches to it."""
    restart_quorum: float = 0.9
    """Share of the nodes the state folder knew that, once heard from, end `holddown_s` early."""
    ingest_workers: int = 0
    """Processes that decode and validate node vectors for the brain (0: the brain's own thread does); for
    fleets beyond what one interpreter decodes in time. Not with CURVE (see `_shards`)."""
    latency_weights: bool = LATENCY_WEIGHTS
    """Weights also weigh each node's latency for the slice, s(τ̂) from the predictor's forecast (the design's
    rule); off, weights are health alone, since routers already weigh the queues that make most of a node's tail
    (`_weights`, measured in docs/eval.md)."""


def _number(what: str, raw: object) -> float:
    return parse_number(raw, float, f"{what} must be a number, got {raw!r}")


def _at_least(what: str, minimum: float) -> SettingParser:
    def parse(raw: object) -> float:
        number = _number(what, raw)
        if not number >= minimum:
            raise ValueError(f"{what} must be >= {minimum}, got {raw!r}")
        return number

    return parse


def _whole(what: str, low: int, high: int) -> SettingParser:
    def parse(raw: object) -> int:
        number = _number(what, raw)
        if not (low <= number <= high and number == int(number)):
            raise ValueError(f"{what} must be a whole number from {low} to {high}, got {raw!r}")
        return int(number)

    return parse


def _yes_no(what: str) -> SettingParser:
    """A switch: given on the command line (True), or 1/true/yes or 0/false/no in the variable."""

    def parse(raw: object) -> bool:
        if isinstance(raw, bool):
            return raw
        if parse_text(raw).lower() in ("0", "false", "no"):
            return False
        if str(raw).lower() in ("1", "true", "yes"):
            return True
        raise ValueError(f"{what} must be 1 or 0, got {raw!r}")

    return parse


def _folder(raw: object) -> Path:
    if not parse_text(raw):
        raise ValueError("empty path")
    return Path(str(raw))


def _brain_id(raw: object) -> str:
    value = parse_text(raw)
    if not 0 < len(value) <= 256:
        raise ValueError(f"brain id must be 1 to 256 characters, got {value!r}")
    return value


_DEFAULT = BrainConfig()

SETTINGS = SettingTable(
    "brain",
    [
        BRAIN_INGEST,
        BRAIN_UPDATES,
        BRAIN_SNAPSHOT,
        Setting(
            "stale_periods",
            "missed periods before a node is dropped",
            _at_least("stale periods", 1),
            _DEFAULT.stale_periods,
            flag="--stale-periods",
        ),
        Setting(
            "heartbeat_s",
            "seconds between heartbeats",
            _at_least("heartbeat", 0.05),
            _DEFAULT.heartbeat_s,
            flag="--heartbeat-s",
        ),
        Setting(
            "state_dir",
            "folder the brain keeps its state in: epoch, known nodes, experiments, history, predictor",
            _folder,
            flag="--state-dir",
            variable="PRISM_BRAIN_STATE_DIR",
            shown="none (nothing persisted)",
        ),
        replace(
            CURVE_SECRET,
            help="the brain's CURVE secret key file; CURVE needs --curve-clients and --curve-routers too",
        ),
        Setting(
            "curve_clients",
            "folder of the authorised agents' public keys",
            _folder,
            flag="--curve-clients",
            variable="PRISM_CURVE_CLIENTS",
            metavar="DIR",
            shown="off",
        ),
        Setting(
            "curve_routers",
            "folder of the authorised routers' public keys, needed with CURVE",
            _folder,
            flag="--curve-routers",
            variable="PRISM_CURVE_ROUTERS",
            metavar="DIR",
            shown="off",
        ),
        Setting(
            "allow_plaintext",
            "CURVE off on a bind beyond this host without the start-up warning (the variable: 1 or 0)",
            _yes_no("allow plaintext"),
            _DEFAULT.allow_plaintext,
            flag="--allow-plaintext",
            variable="PRISM_BRAIN_ALLOW_PLAINTEXT",
            action="store_true",
        ),
        Setting(
            "metrics_port",
            "port of the brain's Prometheus /metrics, 0 = off",
            parse_port("metrics port"),
            _DEFAULT.metrics_port,
            flag="--metrics-port",
            variable="PRISM_BRAIN_METRICS_PORT",
        ),
        Setting(
            "metrics_addr",
            "address of /metrics",
            parse_listen_address,
            _DEFAULT.metrics_addr,
            flag="--metrics-addr",
            variable="PRISM_BRAIN_METRICS_ADDR",
        ),
        Setting(
            "admin_port",
            "port of the admin API for prism ctl and prism top, 0 = off",
            parse_port("admin port"),
            _DEFAULT.admin_port,
            flag="--admin-port",
            variable="PRISM_BRAIN_ADMIN_PORT",
        ),
        Setting(
            "admin_addr",
            "address of the admin API; anything but loopback needs a token file",
            parse_listen_address,
            _DEFAULT.admin_addr,
            flag="--admin-addr",
            variable="PRISM_BRAIN_ADMIN_ADDR",
        ),
        Setting(
            "admin_token_file",
            "file (mode 600) with the bearer token every admin request then needs",
            flag="--admin-token-file",
            variable="PRISM_BRAIN_ADMIN_TOKEN_FILE",
            metavar="FILE",
        ),
        Setting(
            "admin_public_reads",
            "with a token file: GET requests need no token",
            _yes_no("admin public reads"),
            False,
            flag="--admin-public-reads",
            action="store_true",
        ),
        Setting(
            "admin_insecure",
            "without a token file: allow drain and experiment changes on loopback",
            _yes_no("admin insecure"),
            False,
            flag="--admin-insecure",
            action="store_true",
        ),
        Setting(
            "admin_allowed_hosts",
            "extra Host names the admin API answers, comma-separated",
            flag="--admin-allowed-hosts",
            variable="PRISM_BRAIN_ADMIN_ALLOWED_HOSTS",
        ),
        Setting(
            "scale_hook",
            "command or http(s):// webhook run on scale-up",
            flag="--scale-hook",
            variable="PRISM_SCALE_HOOK",
        ),
        Setting(
            "train_budget_s",
            f"CPU seconds of predictor training per {_DEFAULT.train_interval_s:g} s; 0 = no training",
            _at_least("train budget", 0),
            _DEFAULT.train_budget_s,
            flag="--train-budget-s",
        ),
        Setting(
            "ingest_workers",
            "processes decoding node vectors for the brain, for large fleets (not with CURVE)",
            _whole("ingest workers", 0, 64),
            _DEFAULT.ingest_workers,
            flag="--ingest-workers",
        ),
        Setting(
            "brain_id",
            "this brain's name in its tables and heartbeats, 1 to 256 characters",
            _brain_id,
            flag="--brain-id",
            variable="PRISM_BRAIN_ID",
            shown="host name/updates endpoint",
        ),
        Setting(
            "priority",
            "routers follow the live brain of highest priority, -1000 to 1000",
            _whole("priority", -1000, 1000),
            _DEFAULT.priority,
            flag="--priority",
            variable="PRISM_BRAIN_PRIORITY",
        ),
        Setting(
            "holddown_s",
            "longest wait for the nodes the last run knew before the first table",
            _at_least("hold-down", 0),
            _DEFAULT.holddown_s,
            flag="--holddown-s",
            variable="PRISM_BRAIN_HOLDDOWN_S",
        ),
        Setting(
            "failover_model",
            "the cross-zone failover student (`prism train failover`); without one, zone-local first",
            _folder,
            flag="--failover-model",
            variable="PRISM_BRAIN_FAILOVER_MODEL",
        ),
        Setting(
            "latency_weights",
            "weights also weigh each node's predicted tail latency (the design's rule; the variable: 1 or 0)",
            _yes_no("latency weights"),
            _DEFAULT.latency_weights,
            flag="--latency-weights",
            variable="PRISM_BRAIN_LATENCY_WEIGHTS",
            action="store_true",
        ),
        Setting(
            "failover_reload_s",
            "seconds between looks for a new failover student",
            _at_least("failover reload", 1),
            _DEFAULT.failover_reload_s,
            flag="--failover-reload-s",
        ),
    ],
)

ENV = {s.name: s.variable for s in SETTINGS if s.variable}
"""Each setting's environment variable, by setting name, for messages that point at one."""


def resolve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> BrainConfig:
    """`SETTINGS` from `args` (None = not given), then `environ`, then defaults; ConfigError if one is invalid or
    two contradict."""
    s = SETTINGS.resolve(args, environ)
    secret, clients, routers = s["curve_secret"], s["curve_clients"], s["curve_routers"]
    if len({secret is None, clients is None, routers is None}) != 1:
        raise ConfigError(
            "CURVE needs all of --curve-secret, --curve-clients (agents' keys) and --curve-routers (routers' keys), "
            "or none of them"
        )
    if clients is not None and routers is not None and clients.resolve() == routers.resolve():
        raise ConfigError(f"--curve-clients and --curve-routers must be different folders, both are {clients}")
    if s["ingest_workers"] and secret is not None:
        raise ConfigError("--ingest-workers cannot be used with CURVE: the workers could not check node identities")
    return s.build(
        BrainConfig,
        curve=ServerCurve(secret, clients, AGENTS_DOMAIN) if secret is not None else None,
        curve_routers=ServerCurve(secret, routers, ROUTERS_DOMAIN) if secret is not None else None,
        admin_access=admin_access(
            s["admin_addr"],
            s["admin_token_file"],
            s["admin_public_reads"],
            s["admin_insecure"],
            s["admin_allowed_hosts"],
        ),
        brain_id=s["brain_id"] or "",
    )
