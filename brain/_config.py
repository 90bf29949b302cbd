"""Brain settings: argument > documented environment variable > default, validated here only."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prismlb.wire import AGENTS_DOMAIN, ROUTERS_DOMAIN, ConfigError, ServerCurve

from ._admin import AdminAccess, admin_access

ENV = {
    "ingest": "PRISM_BRAIN_INGEST",
    "updates": "PRISM_BRAIN_UPDATES",
    "snapshot": "PRISM_BRAIN_SNAPSHOT",
    "state_dir": "PRISM_BRAIN_STATE_DIR",
    "metrics_port": "PRISM_BRAIN_METRICS_PORT",
    "metrics_addr": "PRISM_BRAIN_METRICS_ADDR",
    "curve_secret": "PRISM_CURVE_SECRET",
    "curve_clients": "PRISM_CURVE_CLIENTS",
    "curve_routers": "PRISM_CURVE_ROUTERS",
    "allow_plaintext": "PRISM_BRAIN_ALLOW_PLAINTEXT",
    "admin_port": "PRISM_BRAIN_ADMIN_PORT",
    "admin_addr": "PRISM_BRAIN_ADMIN_ADDR",
    "admin_token_file": "PRISM_BRAIN_ADMIN_TOKEN_FILE",
    "admin_allowed_hosts": "PRISM_BRAIN_ADMIN_ALLOWED_HOSTS",
    "scale_hook": "PRISM_SCALE_HOOK",
    "brain_id": "PRISM_BRAIN_ID",
    "priority": "PRISM_BRAIN_PRIORITY",
    "holddown_s": "PRISM_BRAIN_HOLDDOWN_S",
}


@dataclass(frozen=True)
class BrainConfig:
    ingest: str = "tcp://127.0.0.1:5555"
    updates: str = "tcp://127.0.0.1:5556"
    snapshot: str = "tcp://127.0.0.1:5557"
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
    restart_quorum: float = 0.9
    ingest_workers: int = 0
    """Processes that decode and validate node vectors for the brain (0: the brain's own thread does); for
    fleets beyond what one interpreter decodes in time. Not with CURVE (see `_shards`)."""


def _pick(args: argparse.Namespace, environ: Mapping[str, str], name: str) -> str | None:
    value = getattr(args, name, None)
    if value is None and name in ENV:
        value = environ.get(ENV[name])
    return None if value is None else str(value)


def _endpoint(name: str, value: str) -> str:
    if not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"{name} must be a ZeroMQ endpoint (tcp://host:port or ipc://path), got {value!r}")
    return value


def _number(name: str, value: str, *, minimum: float) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if not number >= minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")
    return number


def resolve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> BrainConfig:
    defaults = BrainConfig()
    secret = _pick(args, environ, "curve_secret")
    clients = _pick(args, environ, "curve_clients")
    routers = _pick(args, environ, "curve_routers")
    if len({secret is None, clients is None, routers is None}) != 1:
        raise ConfigError(
            "CURVE needs all of --curve-secret, --curve-clients (agents' keys) and --curve-routers (routers' keys), "
            "or none of them"
        )
    if clients and routers and Path(clients).resolve() == Path(routers).resolve():
        raise ConfigError(f"--curve-clients and --curve-routers must be different folders, both are {clients}")
    state_dir = _pick(args, environ, "state_dir")
    metrics_port = _pick(args, environ, "metrics_port")
    port = int(_number("metrics port", metrics_port, minimum=0)) if metrics_port is not None else 0
    if port > 65535:
        raise ConfigError(f"metrics port must be <= 65535, got {port}")
    raw_admin = _pick(args, environ, "admin_port")
    admin_port = int(_number("admin port", raw_admin, minimum=0)) if raw_admin is not None else defaults.admin_port
    if admin_port > 65535:
        raise ConfigError(f"admin port must be <= 65535, got {admin_port}")
    return BrainConfig(
        ingest=_endpoint("ingest", _pick(args, environ, "ingest") or defaults.ingest),
        updates=_endpoint("updates", _pick(args, environ, "updates") or defaults.updates),
        snapshot=_endpoint("snapshot", _pick(args, environ, "snapshot") or defaults.snapshot),
        stale_periods=_number("stale periods", _pick(args, environ, "stale_periods") or "3", minimum=1),
        heartbeat_s=_number("heartbeat", _pick(args, environ, "heartbeat_s") or "1", minimum=0.05),
        state_dir=Path(state_dir) if state_dir else None,
        curve=ServerCurve(Path(secret), Path(clients), AGENTS_DOMAIN) if secret and clients else None,
        curve_routers=ServerCurve(Path(secret), Path(routers), ROUTERS_DOMAIN) if secret and routers else None,
        allow_plaintext=_flag("allow plaintext", _pick(args, environ, "allow_plaintext")),
        metrics_port=port,
        metrics_addr=_pick(args, environ, "metrics_addr") or defaults.metrics_addr,
        admin_port=admin_port,
        admin_addr=(admin_addr := _pick(args, environ, "admin_addr") or defaults.admin_addr),
        admin_access=admin_access(
            admin_addr,
            _pick(args, environ, "admin_token_file"),
            bool(getattr(args, "admin_public_reads", False)),
            bool(getattr(args, "admin_insecure", False)),
            _pick(args, environ, "admin_allowed_hosts"),
        ),
        scale_hook=_pick(args, environ, "scale_hook"),
        train_budget_s=_number("train budget", _pick(args, environ, "train_budget_s") or "0.5", minimum=0),
        brain_id=_brain_id(_pick(args, environ, "brain_id")),
        priority=_priority(_pick(args, environ, "priority")),
        holddown_s=_number("hold-down", _pick(args, environ, "holddown_s") or str(defaults.holddown_s), minimum=0),
        ingest_workers=_ingest_workers(_pick(args, environ, "ingest_workers"), curve=secret is not None),
    )


def _ingest_workers(value: str | None, *, curve: bool) -> int:
    if value is None:
        return 0
    workers = _number("ingest workers", value, minimum=0)
    if workers != int(workers) or workers > 64:
        raise ConfigError(f"ingest workers must be a whole number from 0 to 64, got {value!r}")
    if workers and curve:
        raise ConfigError("--ingest-workers cannot be used with CURVE: the workers could not check node identities")
    return int(workers)


def _brain_id(value: str | None) -> str:
    if value is not None and not 0 < len(value) <= 256:
        raise ConfigError(f"brain id must be 1 to 256 characters, got {value!r}")
    return value or ""


def _priority(value: str | None) -> int:
    if value is None:
        return 0
    number = _number("priority", value, minimum=-1000)
    if number > 1000 or number != int(number):
        raise ConfigError(f"priority must be a whole number from -1000 to 1000, got {value!r}")
    return int(number)


def _flag(name: str, value: str | None) -> bool:
    if value is None or value.lower() in ("", "0", "false", "no"):
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    raise ConfigError(f"{name} must be 1 or 0, got {value!r}")
