"""What every Prism service shares: settings resolved flag > variable > default, command-line numbers, /metrics
and its naming, whole HTTP replies, a threading HTTP server with bounded connections and read deadlines, systemd
notification, logging, signals, the bounded queue worker and waiting on a condition."""

from ._arguments import whole_number_at_least
from ._counters import kind_counter
from ._exposition import MS_TO_S, NODE_FAMILIES, NodeFamily, node_families
from ._http import POLL_S, BoundedHandler, BoundedHttpServer, NoDelayHandler, reply_bytes, reply_json
from ._service import MetricsServer, sd_notify, serve_metrics, setup_logging, stop_on_signals, watchdog_interval_s
from ._settings import (
    BRAIN_INGEST,
    BRAIN_PUBLIC,
    BRAIN_SNAPSHOT,
    BRAIN_UPDATES,
    CURVE_SECRET,
    ResolvedSettings,
    Setting,
    SettingParser,
    SettingTable,
    client_curve,
    parse_key_file,
    parse_listen_address,
    parse_number,
    parse_port,
    parse_positive,
    parse_text,
    parse_zmq_endpoint,
)
from ._wait import wait_until
from ._worker import BoundedWorker, QueueEntry

__all__ = [
    "POLL_S",
    "BRAIN_INGEST",
    "BRAIN_PUBLIC",
    "BRAIN_SNAPSHOT",
    "BRAIN_UPDATES",
    "CURVE_SECRET",
    "MS_TO_S",
    "NODE_FAMILIES",
    "BoundedHandler",
    "BoundedHttpServer",
    "BoundedWorker",
    "MetricsServer",
    "NoDelayHandler",
    "NodeFamily",
    "QueueEntry",
    "ResolvedSettings",
    "Setting",
    "SettingParser",
    "SettingTable",
    "client_curve",
    "kind_counter",
    "node_families",
    "parse_key_file",
    "parse_listen_address",
    "parse_number",
    "parse_port",
    "parse_positive",
    "parse_text",
    "parse_zmq_endpoint",
    "reply_bytes",
    "reply_json",
    "sd_notify",
    "serve_metrics",
    "setup_logging",
    "stop_on_signals",
    "wait_until",
    "watchdog_interval_s",
    "whole_number_at_least",
]
