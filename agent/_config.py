"""The agent's settings: command-line argument, then environment variable, then TOML file, then default;
validated here, in one place."""

from __future__ import annotations

import argparse
import math
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from prismlb.wire import ClientCurve, ConfigError, NodeVector

from ._kv_events import rank_endpoint

DEFAULT_BRAIN = "tcp://127.0.0.1:5555"
DEFAULT_ENDPOINT_PORT = 8000
DEFAULT_PERIOD_S = 1.0
DEFAULT_METRICS_ADDR = "0.0.0.0"
"""Every interface, as the brain's: a cluster's Prometheus scrapes each host from outside it."""
DEFAULT_OTLP_HOST = "127.0.0.1"
DEFAULT_OTLP_GRPC_PORT = 4317
DEFAULT_OTLP_HTTP_PORT = 4318
DEFAULT_JOIN_DELAY_S = 0.25
MAX_KV_DP_RANKS = 64
"""More DP ranks than one node has GPUs is a mistake, not a deployment; each rank costs the agent two sockets."""

_VECTOR_FIELDS = {f.name: f.type for f in msgspec.structs.fields(NodeVector)}


def _default_endpoint() -> str:
    return f"http://{socket.gethostname()}:{DEFAULT_ENDPOINT_PORT}"


@dataclass(frozen=True)
class AgentConfig:
    """What one agent reports, where to, and how often."""

    node_id: str = field(default_factory=socket.gethostname)
    host: str = field(default_factory=socket.gethostname)
    endpoint: str = field(default_factory=_default_endpoint)
    brain: str = DEFAULT_BRAIN
    """The brain's ingest endpoint; several, comma-separated, for brains run as a highly available group
    (every brain gets every vector, so any of them can lead)."""
    zone: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    period_s: float = DEFAULT_PERIOD_S
    ebpf: bool = True
    curve: ClientCurve | None = None
    metrics_port: int = 0
    metrics_addr: str = DEFAULT_METRICS_ADDR
    otlp_host: str = DEFAULT_OTLP_HOST
    otlp_grpc_port: int = DEFAULT_OTLP_GRPC_PORT
    otlp_http_port: int = DEFAULT_OTLP_HTTP_PORT
    trace_ports: frozenset[int] = frozenset()
    trace_pids: frozenset[int] = frozenset()
    join_delay_s: float = DEFAULT_JOIN_DELAY_S
    engine_url: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    kv_dp_ranks: int = 1
    """The engine's data-parallel ranks on this node: rank r publishes its KV events (and answers replays) on the
    `kv_events` (`kv_replay`) port + r, so that is rank 0's, or the node's first rank's."""
    kv_full_every_s: float = 60.0
    """How often the KV stream sends the node's whole block set, which brings back a brain that lost the stream."""


FILE_KEYS = frozenset(
    {
        "node_id",
        "host",
        "endpoint",
        "brain",
        "zone",
        "labels",
        "period",
        "ebpf",
        "curve_secret",
        "brain_public",
        "metrics_port",
        "metrics_addr",
        "otlp_host",
        "otlp_grpc_port",
        "otlp_http_port",
        "trace_port",
        "trace_pid",
        "join_delay",
        "engine_url",
        "kv_events",
        "kv_replay",
        "kv_dp_ranks",
        "kv_full_every",
    }
)


class _Sources:
    """Where settings come from, in order: command-line argument, environment variable, TOML file."""

    def __init__(
        self, args: argparse.Namespace, environ: Mapping[str, str], file: Mapping[str, Any], path: str
    ) -> None:
        unknown = sorted(set(file) - FILE_KEYS)
        if unknown:
            raise ConfigError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(FILE_KEYS))}")
        self.args, self.environ, self.file, self.path = args, environ, file, path

    def pick(self, attr: str, flag: str, env: str = "") -> tuple[Any, str]:
        """(value, where it came from), or (None, "") when no source sets it."""
        value = getattr(self.args, attr, None)
        if value is not None:
            return value, flag
        if env and self.environ.get(env):
            return self.environ[env], env
        if attr in self.file:
            return self.file[attr], f"{self.path}: {attr}"
        return None, ""


def _load_file(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    path = getattr(args, "config", None) or environ.get("PRISM_AGENT_CONFIG")
    if not path:
        return {}, ""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f), str(path)
    except OSError as exc:
        raise ConfigError(f"cannot read agent config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"agent config {path} is not valid TOML: {exc}") from None


def _as_vector_field(name: str, value: object, source: str) -> None:
    """Raise ConfigError unless `value` is valid as NodeVector.`name` on the wire."""
    try:
        msgspec.convert(value, _VECTOR_FIELDS[name])
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: invalid {name.replace('_', ' ')} {value!r}: {exc}") from None


def _labels(items: list[str], source: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.strip().partition("=")
        if not sep or not key:
            raise ConfigError(f"{source}: malformed label {item!r}, expected KEY=VALUE")
        if key in labels:
            raise ConfigError(f"{source}: label {key!r} given twice")
        labels[key] = value
    return labels


def _period(raw: str | float, source: str) -> float:
    try:
        period = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: period {raw!r} is not a number of seconds") from None
    if not math.isfinite(period) or period <= 0:
        raise ConfigError(f"{source}: period must be a positive number of seconds, got {raw!r}")
    return period


def _port(raw: str | int, source: str, what: str = "metrics port") -> int:
    try:
        port = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {what} {raw!r} is not an integer") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{source}: {what} must be 0 (off) to 65535, got {port}")
    return port


def _id_set(raw: str | list[str], source: str, what: str, high: int) -> frozenset[int]:
    """A comma-separated (or repeated) list of integers in 1..high."""
    items = raw if isinstance(raw, list) else raw.split(",")
    values: set[int] = set()
    for item in (i.strip() for part in items for i in str(part).split(",")):
        if not item:
            continue
        if not item.isdigit() or not 1 <= int(item) <= high:
            raise ConfigError(f"{source}: {what} {item!r} is not an integer in 1..{high}")
        values.add(int(item))
    return frozenset(values)


def _otlp(src: _Sources) -> dict[str, Any]:
    host, _ = src.pick("otlp_host", "--otlp-host", "PRISM_OTLP_HOST")
    if host is not None and not host:
        raise ConfigError("--otlp-host: empty address")
    ports = {}
    for attr, flag, env, default in (
        ("otlp_grpc_port", "--otlp-grpc-port", "PRISM_OTLP_GRPC_PORT", DEFAULT_OTLP_GRPC_PORT),
        ("otlp_http_port", "--otlp-http-port", "PRISM_OTLP_HTTP_PORT", DEFAULT_OTLP_HTTP_PORT),
    ):
        raw, source = src.pick(attr, flag, env)
        ports[attr] = _port(raw, source, "OTLP port") if raw is not None else default
    trace_ports, ports_source = src.pick("trace_port", "--trace-port", "PRISM_TRACE_PORTS")
    trace_pids, pids_source = src.pick("trace_pid", "--trace-pid", "PRISM_TRACE_PIDS")
    raw_delay, delay_source = src.pick("join_delay", "--join-delay", "PRISM_JOIN_DELAY_S")
    delay = DEFAULT_JOIN_DELAY_S
    if raw_delay is not None:
        try:
            delay = float(raw_delay)
        except ValueError:
            raise ConfigError(f"{delay_source}: join delay {raw_delay!r} is not a number of seconds") from None
        if not 0 <= delay <= 10:
            raise ConfigError(f"{delay_source}: join delay must be 0 to 10 seconds, got {raw_delay!r}")
    return {
        "otlp_host": host if host is not None else DEFAULT_OTLP_HOST,
        **ports,
        "trace_ports": _id_set(trace_ports, ports_source, "port", 65535) if trace_ports is not None else frozenset(),
        "trace_pids": _id_set(trace_pids, pids_source, "pid", 2**32 - 1) if trace_pids is not None else frozenset(),
        "join_delay_s": delay,
    }


def _check_endpoint(endpoint: str, source: str) -> None:
    try:
        parts = urlsplit(endpoint)
        _ = parts.port  # raises ValueError when the port is not a number in range
    except ValueError as exc:
        raise ConfigError(f"{source}: inference endpoint {endpoint!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{source}: inference endpoint {endpoint!r} must look like http://HOST:PORT")


def brain_endpoints(brain: str) -> list[str]:
    """The ingest endpoints in a `brain` setting (comma-separated), each once, in order."""
    return list(dict.fromkeys(part.strip() for part in brain.split(",") if part.strip())) or [brain]


def _check_zmq(brain: str, source: str, what: str = "brain ingest endpoint") -> None:
    scheme, sep, rest = brain.partition("://")
    host, colon, port = rest.rpartition(":")
    tcp_ok = scheme == "tcp" and bool(host) and bool(colon) and port.isdigit() and 0 < int(port) < 65536
    ipc_ok = scheme == "ipc" and bool(rest)
    if not sep or not (tcp_ok or ipc_ok):
        raise ConfigError(f"{source}: {what} {brain!r} must be tcp://HOST:PORT or ipc://PATH")


def _curve(src: _Sources) -> ClientCurve | None:
    secret, secret_source = src.pick("curve_secret", "--curve-secret", "PRISM_CURVE_SECRET")
    public, public_source = src.pick("brain_public", "--brain-public", "PRISM_BRAIN_PUBLIC")
    if secret is None and public is None:
        return None
    if secret is None or public is None:
        given = secret_source or public_source
        raise ConfigError(
            f"{given} given alone: CURVE needs both --curve-secret (PRISM_CURVE_SECRET) "
            "and --brain-public (PRISM_BRAIN_PUBLIC)"
        )
    for path, source in ((secret, secret_source), (public, public_source)):
        if not Path(path).is_file():
            raise ConfigError(f"{source}: CURVE key file {path} does not exist")
    return ClientCurve(secret_file=Path(secret), server_public_file=Path(public))


def resolve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> AgentConfig:
    """Settings from `args` (None = not given), then `environ` (PRISM_*), then the TOML file named by
    --config / PRISM_AGENT_CONFIG, then defaults; ConfigError if invalid."""
    src = _Sources(args, environ, *_load_file(args, environ))
    node_id, node_source = src.pick("node_id", "--node-id", "PRISM_NODE_ID")
    node_id = node_id if node_id is not None else socket.gethostname()
    _as_vector_field("node_id", node_id, node_source or "hostname as node id")

    host, host_source = src.pick("host", "--host")
    host = host if host is not None else socket.gethostname()
    _as_vector_field("host", host, host_source or "hostname")

    endpoint, endpoint_source = src.pick("endpoint", "--endpoint", "PRISM_ENDPOINT")
    endpoint = endpoint if endpoint is not None else _default_endpoint()
    _check_endpoint(endpoint, endpoint_source or "default endpoint")
    _as_vector_field("endpoint", endpoint, endpoint_source or "default endpoint")

    brain, brain_source = src.pick("brain", "--brain", "PRISM_BRAIN_INGEST")
    brain = brain if brain is not None else DEFAULT_BRAIN
    for endpoint_ in brain_endpoints(brain):
        _check_zmq(endpoint_, brain_source or "default brain")

    zone, zone_source = src.pick("zone", "--zone", "PRISM_ZONE")
    zone = zone if zone is not None else ""
    _as_vector_field("zone", zone, zone_source or "default zone")

    raw_labels, labels_source = src.pick("label", "--label", "PRISM_LABELS")
    if raw_labels is None and "labels" in src.file:
        raw_labels, labels_source = src.file["labels"], f"{src.path}: labels"
    if isinstance(raw_labels, dict):
        labels = {str(k): str(v) for k, v in raw_labels.items()}
    elif raw_labels is not None:
        labels = _labels(raw_labels if isinstance(raw_labels, list) else raw_labels.split(","), labels_source)
    else:
        labels = {}
    _as_vector_field("labels", labels, labels_source or "labels")

    raw_period, period_source = src.pick("period", "--period", "PRISM_PERIOD_S")
    period = _period(raw_period, period_source) if raw_period is not None else DEFAULT_PERIOD_S
    _as_vector_field("period_s", period, period_source or "default period")

    raw_port, port_source = src.pick("metrics_port", "--metrics-port", "PRISM_AGENT_METRICS_PORT")
    metrics_port = _port(raw_port, port_source) if raw_port is not None else 0

    metrics_addr, addr_source = src.pick("metrics_addr", "--metrics-addr")
    if metrics_addr is not None and not metrics_addr:
        raise ConfigError(f"{addr_source}: empty address")

    ebpf, ebpf_source = src.pick("ebpf", "--no-ebpf")
    if ebpf is not None and not isinstance(ebpf, bool):
        raise ConfigError(f"{ebpf_source}: ebpf must be true or false, got {ebpf!r}")
    return AgentConfig(
        node_id=node_id,
        host=host,
        endpoint=endpoint,
        brain=brain,
        zone=zone,
        labels=labels,
        period_s=period,
        ebpf=ebpf if ebpf is not None else True,
        curve=_curve(src),
        metrics_port=metrics_port,
        metrics_addr=metrics_addr if metrics_addr is not None else DEFAULT_METRICS_ADDR,
        **_otlp(src),
        **_engine(src),
    )


def _engine(src: _Sources) -> dict[str, Any]:
    url, url_source = src.pick("engine_url", "--engine-url", "PRISM_ENGINE_URL")
    if url is not None:
        _check_endpoint(url, url_source)
    kv_events, kv_source = src.pick("kv_events", "--kv-events", "PRISM_KV_EVENTS")
    kv_replay, replay_source = src.pick("kv_replay", "--kv-replay", "PRISM_KV_REPLAY")
    for value, source in ((kv_events, kv_source), (kv_replay, replay_source)):
        if value is not None:
            _check_zmq(value, source, "KV-event endpoint")
    if kv_replay is not None and kv_events is None:
        raise ConfigError(f"{replay_source} given without --kv-events (PRISM_KV_EVENTS)")
    raw_ranks, ranks_source = src.pick("kv_dp_ranks", "--kv-dp-ranks", "PRISM_KV_DP_RANKS")
    dp_ranks = _dp_ranks(raw_ranks, ranks_source) if raw_ranks is not None else AgentConfig.kv_dp_ranks
    if dp_ranks > 1 and kv_events is None:
        raise ConfigError(f"{ranks_source} given without --kv-events (PRISM_KV_EVENTS)")
    for value, source in ((kv_events, kv_source), (kv_replay, replay_source)):
        if value is not None:
            try:
                rank_endpoint(value, dp_ranks - 1)
            except ValueError as exc:
                raise ConfigError(f"{source} with {dp_ranks} DP ranks ({ranks_source}): {exc}") from None
    raw_full, full_source = src.pick("kv_full_every", "--kv-full-every", "PRISM_KV_FULL_EVERY_S")
    full_every = _period(raw_full, full_source) if raw_full is not None else AgentConfig.kv_full_every_s
    return {
        "engine_url": url,
        "kv_events": kv_events,
        "kv_replay": kv_replay,
        "kv_dp_ranks": dp_ranks,
        "kv_full_every_s": full_every,
    }


def _dp_ranks(raw: str | int, source: str) -> int:
    if isinstance(raw, bool) or not (isinstance(raw, int) or (isinstance(raw, str) and raw.strip().isdigit())):
        raise ConfigError(f"{source}: KV-event DP ranks {raw!r} is not a whole number")
    ranks = int(raw)
    if not 1 <= ranks <= MAX_KV_DP_RANKS:
        raise ConfigError(f"{source}: KV-event DP ranks must be 1 to {MAX_KV_DP_RANKS}, got {ranks}")
    return ranks
