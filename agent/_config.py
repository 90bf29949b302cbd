"""The agent's settings: every flag, environment variable and TOML key in one table (`SETTINGS`), resolved by the
settings resolver of `prismlb.wire` (flag, then variable, then the TOML file named by --config, then default);
what one setting says about another is checked here."""

from __future__ import annotations

import argparse
import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import msgspec

from prismlb.service import (
    BRAIN_INGEST,
    BRAIN_PUBLIC,
    CURVE_SECRET,
    ResolvedSettings,
    Setting,
    SettingParser,
    SettingTable,
    client_curve,
    parse_listen_address,
    parse_number,
    parse_port,
    parse_positive,
    parse_text,
)
from prismlb.wire import ClientCurve, ConfigError, NodeVector

from ._kv_events import rank_endpoint
from ._otlp_receiver import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_GRPC_RPCS,
    DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_READ_TIMEOUT_S,
)

DEFAULT_ENDPOINT_PORT = 8000
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
    brain: str = BRAIN_INGEST.default
    """The brain's ingest endpoint; several, comma-separated, for brains run as a highly available group
    (every brain gets every vector, so any of them can lead)."""
    zone: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    period_s: float = 1.0
    ebpf: bool = True
    curve: ClientCurve | None = None
    metrics_port: int = 0
    metrics_addr: str = "0.0.0.0"
    """Every interface, as the brain's: a cluster's Prometheus scrapes each host from outside it."""
    otlp_host: str = DEFAULT_HOST
    otlp_grpc_port: int = DEFAULT_GRPC_PORT
    otlp_http_port: int = DEFAULT_HTTP_PORT
    otlp_max_connections: int = DEFAULT_MAX_CONNECTIONS
    otlp_read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    otlp_max_grpc_rpcs: int = DEFAULT_MAX_GRPC_RPCS
    otlp_max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    trace_ports: frozenset[int] = frozenset()
    trace_pids: frozenset[int] = frozenset()
    join_delay_s: float = 0.25
    engine_url: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    kv_dp_ranks: int = 1
    """The engine's data-parallel ranks on this node: rank r publishes its KV events (and answers replays) on the
    `kv_events` (`kv_replay`) port + r, so that is rank 0's, or the node's first rank's."""
    kv_full_every_s: float = 60.0
    """How often the KV stream sends the node's whole block set, which brings back a brain that lost the stream."""


def _vector_field(name: str, check: SettingParser = parse_text) -> SettingParser:
    """`check`, then valid as NodeVector.`name` on the wire, so that a vector the agent builds is never refused."""

    def parse(raw: object) -> Any:
        value = check(raw)
        try:
            msgspec.convert(value, _VECTOR_FIELDS[name])
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid {name.replace('_', ' ')} {value!r}: {exc}") from None
        return value

    return parse


def _labels(raw: object) -> dict[str, str]:
    """KEY=VALUE items (repeated flags, or comma-separated in the variable), or a TOML table."""
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    labels: dict[str, str] = {}
    for item in raw if isinstance(raw, list) else parse_text(raw).split(","):
        key, sep, value = str(item).strip().partition("=")
        if not sep or not key:
            raise ValueError(f"malformed label {item!r}, expected KEY=VALUE")
        if key in labels:
            raise ValueError(f"label {key!r} given twice")
        labels[key] = value
    return labels


def _seconds(what: str) -> SettingParser:
    """A positive, finite number of seconds."""

    def parse(raw: object) -> float:
        seconds = parse_number(raw, float, f"{what} {raw!r} is not a number of seconds")
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"{what} must be a positive number of seconds, got {raw!r}")
        return seconds

    return parse


def _join_delay(raw: object) -> float:
    delay = parse_number(raw, float, f"join delay {raw!r} is not a number of seconds")
    if not 0 <= delay <= 10:
        raise ValueError(f"join delay must be 0 to 10 seconds, got {raw!r}")
    return delay


def _switch(what: str) -> SettingParser:
    def parse(raw: object) -> bool:
        if not isinstance(raw, bool):
            raise ValueError(f"{what} must be true or false, got {raw!r}")
        return raw

    return parse


def _ids(what: str, high: int) -> SettingParser:
    """A set of integers in 1..high: comma-separated, repeated, or a TOML list."""

    def parse(raw: object) -> frozenset[int]:
        items = raw if isinstance(raw, list) else [raw]
        values: set[int] = set()
        for item in (i.strip() for part in items for i in str(part).split(",")):
            if not item:
                continue
            if not item.isdigit() or not 1 <= int(item) <= high:
                raise ValueError(f"{what} {item!r} is not an integer in 1..{high}")
            values.add(int(item))
        return frozenset(values)

    return parse


def _url(what: str) -> SettingParser:
    def parse(raw: object) -> str:
        url = parse_text(raw)
        try:
            parts = urlsplit(url)
            _ = parts.port  # raises ValueError when the port is not a number in range
        except ValueError as exc:
            raise ValueError(f"{what} {url!r} is not a URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{what} {url!r} must look like http://HOST:PORT")
        return url

    return parse


def _zmq(what: str) -> SettingParser:
    """An endpoint the agent connects to: tcp://HOST:PORT or ipc://PATH."""

    def parse(raw: object) -> str:
        endpoint = parse_text(raw)
        scheme, sep, rest = endpoint.partition("://")
        host, colon, port_ = rest.rpartition(":")
        tcp_ok = scheme == "tcp" and bool(host) and bool(colon) and port_.isdigit() and 0 < int(port_) < 65536
        ipc_ok = scheme == "ipc" and bool(rest)
        if not sep or not (tcp_ok or ipc_ok):
            raise ValueError(f"{what} {endpoint!r} must be tcp://HOST:PORT or ipc://PATH")
        return endpoint

    return parse


def brain_endpoints(brain: str) -> list[str]:
    """The ingest endpoints in a `brain` setting (comma-separated), each once, in order."""
    return list(dict.fromkeys(part.strip() for part in brain.split(",") if part.strip())) or [brain]


def _brains(raw: object) -> str:
    brain = parse_text(raw)
    for endpoint in brain_endpoints(brain):
        _zmq("brain ingest endpoint")(endpoint)
    return brain


def _dp_ranks(raw: object) -> int:
    if isinstance(raw, bool) or not (isinstance(raw, int) or (isinstance(raw, str) and raw.strip().isdigit())):
        raise ValueError(f"KV-event DP ranks {raw!r} is not a whole number")
    ranks = int(raw)
    if not 1 <= ranks <= MAX_KV_DP_RANKS:
        raise ValueError(f"KV-event DP ranks must be 1 to {MAX_KV_DP_RANKS}, got {ranks}")
    return ranks


CONFIG = Setting(
    "config",
    "the TOML settings file; flags and environment variables override it",
    flag="--config",
    variable="PRISM_AGENT_CONFIG",
    metavar="FILE",
)

SETTINGS = SettingTable(
    "agent",
    [
        CONFIG,
        Setting(
            "node_id",
            "the node's id in its vector and in the routing tables",
            _vector_field("node_id"),
            socket.gethostname,
            flag="--node-id",
            variable="PRISM_NODE_ID",
            key="node_id",
            shown="host name",
        ),
        Setting(
            "host",
            "the host name the vector reports",
            _vector_field("host"),
            socket.gethostname,
            flag="--host",
            key="host",
            shown="host name",
        ),
        Setting(
            "endpoint",
            "the URL of the inference server this node serves",
            _vector_field("endpoint", _url("inference endpoint")),
            _default_endpoint,
            flag="--endpoint",
            variable="PRISM_ENDPOINT",
            key="endpoint",
            shown="http://HOSTNAME:8000",
        ),
        replace(
            BRAIN_INGEST,
            name="brain",
            help="the brain's ingest endpoint; several, comma-separated, for a highly available group (every brain "
            "gets every vector)",
            parse=_brains,
            flag="--brain",
            key="brain",
        ),
        Setting("zone", "the node's zone", _vector_field("zone"), "", flag="--zone", variable="PRISM_ZONE", key="zone"),
        Setting(
            "labels",
            "a label of the node, repeatable (the variable: k=v,k=v; the file: a table)",
            _vector_field("labels", _labels),
            {},
            flag="--label",
            variable="PRISM_LABELS",
            key="labels",
            action="append",
            metavar="KEY=VALUE",
        ),
        Setting(
            "period",
            "seconds between vectors (at most 3600)",
            _vector_field("period_s", _seconds("period")),
            AgentConfig.period_s,
            flag="--period",
            variable="PRISM_PERIOD_S",
            key="period",
            metavar="SECONDS",
        ),
        Setting(
            "ebpf",
            "load the eBPF program (connection tracing, connect_calls_total, the tcp_* fields); the flag turns it off",
            _switch("ebpf"),
            AgentConfig.ebpf,
            flag="--no-ebpf",
            key="ebpf",
            action="store_false",
        ),
        replace(CURVE_SECRET, help="the agent's CURVE secret key file; needs --brain-public", key="curve_secret"),
        replace(BRAIN_PUBLIC, key="brain_public"),
        Setting(
            "metrics_port",
            "port of the agent's Prometheus /metrics, 0 = off",
            parse_port("metrics port"),
            AgentConfig.metrics_port,
            flag="--metrics-port",
            variable="PRISM_AGENT_METRICS_PORT",
            key="metrics_port",
        ),
        Setting(
            "metrics_addr",
            "address of /metrics (127.0.0.1 keeps it on the host)",
            parse_listen_address,
            AgentConfig.metrics_addr,
            flag="--metrics-addr",
            key="metrics_addr",
        ),
        Setting(
            "otlp_host",
            "address the OTLP receiver listens on",
            parse_listen_address,
            AgentConfig.otlp_host,
            flag="--otlp-host",
            variable="PRISM_OTLP_HOST",
            key="otlp_host",
        ),
        Setting(
            "otlp_grpc_port",
            "OTLP/gRPC port, 0 = off",
            parse_port("OTLP port"),
            AgentConfig.otlp_grpc_port,
            flag="--otlp-grpc-port",
            variable="PRISM_OTLP_GRPC_PORT",
            key="otlp_grpc_port",
        ),
        Setting(
            "otlp_http_port",
            "OTLP/HTTP port, 0 = off",
            parse_port("OTLP port"),
            AgentConfig.otlp_http_port,
            flag="--otlp-http-port",
            variable="PRISM_OTLP_HTTP_PORT",
            key="otlp_http_port",
        ),
        Setting(
            "otlp_max_connections",
            "open OTLP/HTTP connections, one thread each; the next is answered 503 and closed",
            parse_positive(int),
            AgentConfig.otlp_max_connections,
            variable="PRISM_OTLP_MAX_CONNECTIONS",
        ),
        Setting(
            "otlp_read_timeout_s",
            "seconds each OTLP/HTTP request may take to arrive, and a connection may idle between requests",
            parse_positive(float),
            AgentConfig.otlp_read_timeout_s,
            variable="PRISM_OTLP_READ_TIMEOUT_S",
        ),
        Setting(
            "otlp_max_grpc_rpcs",
            "OTLP/gRPC exports at once; more are answered RESOURCE_EXHAUSTED",
            parse_positive(int),
            AgentConfig.otlp_max_grpc_rpcs,
            variable="PRISM_OTLP_MAX_GRPC_RPCS",
        ),
        Setting(
            "otlp_max_inflight_bytes",
            "bytes of OTLP request bodies held at once, both protocols together (at least 16 MiB, the largest "
            "message); one that does not fit is answered 503 or RESOURCE_EXHAUSTED",
            parse_positive(int),
            AgentConfig.otlp_max_inflight_bytes,
            variable="PRISM_OTLP_MAX_INFLIGHT_BYTES",
            shown="67108864 (64 MiB)",
        ),
        Setting(
            "trace_port",
            "trace only connections with one of these local or remote ports (also comma-separated; at most 1,024)",
            _ids("port", 65535),
            [],
            flag="--trace-port",
            variable="PRISM_TRACE_PORTS",
            key="trace_port",
            action="append",
            shown="every port",
        ),
        Setting(
            "trace_pid",
            "trace only these processes' connections (also comma-separated; at most 1,024)",
            _ids("pid", 2**32 - 1),
            [],
            flag="--trace-pid",
            variable="PRISM_TRACE_PIDS",
            key="trace_pid",
            action="append",
            shown="every process",
        ),
        Setting(
            "join_delay",
            "seconds spans wait for kernel events before the join (0 to 10)",
            _join_delay,
            AgentConfig.join_delay_s,
            flag="--join-delay",
            variable="PRISM_JOIN_DELAY_S",
            key="join_delay",
            metavar="SECONDS",
        ),
        Setting(
            "engine_url",
            "the inference engine's Prometheus /metrics URL (the engine source)",
            _url("engine URL"),
            flag="--engine-url",
            variable="PRISM_ENGINE_URL",
            key="engine_url",
            shown="off",
        ),
        Setting(
            "kv_events",
            "the engine's KV-event ZeroMQ publisher, tcp://HOST:PORT (the kv_events source and the KV stream)",
            _zmq("KV-event endpoint"),
            flag="--kv-events",
            variable="PRISM_KV_EVENTS",
            key="kv_events",
            shown="off",
        ),
        Setting(
            "kv_replay",
            "the engine's KV-event replay endpoint; needs --kv-events",
            _zmq("KV-event endpoint"),
            flag="--kv-replay",
            variable="PRISM_KV_REPLAY",
            key="kv_replay",
            shown="off",
        ),
        Setting(
            "kv_dp_ranks",
            f"the engine's data-parallel ranks on this node (1 to {MAX_KV_DP_RANKS}): rank r publishes on the "
            "--kv-events (and --kv-replay) port + r",
            _dp_ranks,
            AgentConfig.kv_dp_ranks,
            flag="--kv-dp-ranks",
            variable="PRISM_KV_DP_RANKS",
            key="kv_dp_ranks",
        ),
        Setting(
            "kv_full_every",
            "seconds between sends of the node's whole KV block set to the brains",
            _seconds("interval"),
            AgentConfig.kv_full_every_s,
            flag="--kv-full-every",
            variable="PRISM_KV_FULL_EVERY_S",
            key="kv_full_every",
            metavar="SECONDS",
        ),
    ],
    file=CONFIG,
)


def resolve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> AgentConfig:
    """`SETTINGS` from `args` (None = not given), then `environ`, then the TOML file named by --config, then
    defaults; ConfigError if one is invalid or two contradict."""
    s = SETTINGS.resolve(args, environ)
    _check_engine(s)
    return s.build(AgentConfig, _SETTING_OF, curve=client_curve(s))


_SETTING_OF = {
    "period_s": "period",
    "trace_ports": "trace_port",
    "trace_pids": "trace_pid",
    "join_delay_s": "join_delay",
    "kv_full_every_s": "kv_full_every",
}
"""The `AgentConfig` fields whose setting goes by another name (the flag's, without its unit or plural)."""


def _check_engine(s: ResolvedSettings) -> None:
    """Refuse KV-event settings given without --kv-events, and DP ranks whose ports would run past 65535."""
    ranks, needs = s["kv_dp_ranks"], SETTINGS["kv_events"].label
    if s["kv_events"] is None and s["kv_replay"] is not None:
        raise ConfigError(f"{s.source('kv_replay')} given without {needs}")
    if s["kv_events"] is None and ranks > 1:
        raise ConfigError(f"{s.source('kv_dp_ranks')} given without {needs}")
    for name in ("kv_events", "kv_replay"):
        if s[name] is not None:
            try:
                rank_endpoint(s[name], ranks - 1)
            except ValueError as exc:
                raise ConfigError(
                    f"{s.source(name)} with {ranks} DP ranks ({s.source('kv_dp_ranks')}): {exc}"
                ) from None
