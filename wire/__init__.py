"""Messages and transport shared by the Prism agent, brain and router."""

from ._codec import KINDS, MAX_TABLE_BYTES, MAX_VECTOR_BYTES, decode, encode
from ._curve import ClientCurve, ServerCurve, generate_keypair, start_authenticator
from ._exceptions import (
    ConfigError,
    FrameCountError,
    InvalidFieldError,
    MalformedError,
    NonFiniteError,
    NoRouteError,
    OversizedError,
    PrismError,
    SchemaVersionError,
    UnknownKindError,
    WireError,
)
from ._messages import (
    SCHEMA_VERSION,
    Heartbeat,
    NodeMetrics,
    NodeVector,
    RoutingTable,
    SliceTable,
    SnapshotRequest,
    TableNode,
)
from ._rejects import RejectCounter
from ._service import MetricsServer, serve_metrics, sd_notify, setup_logging, stop_on_signals, watchdog_interval_s
from ._transport import BrainAddress, TablePublisher, TableSubscriber, VectorReceiver, VectorSender

__all__ = [
    "KINDS",
    "MAX_TABLE_BYTES",
    "MAX_VECTOR_BYTES",
    "SCHEMA_VERSION",
    "BrainAddress",
    "ClientCurve",
    "ConfigError",
    "FrameCountError",
    "Heartbeat",
    "InvalidFieldError",
    "MalformedError",
    "MetricsServer",
    "NoRouteError",
    "NodeMetrics",
    "NodeVector",
    "NonFiniteError",
    "OversizedError",
    "PrismError",
    "RejectCounter",
    "RoutingTable",
    "SchemaVersionError",
    "ServerCurve",
    "SliceTable",
    "SnapshotRequest",
    "TableNode",
    "TablePublisher",
    "TableSubscriber",
    "UnknownKindError",
    "VectorReceiver",
    "VectorSender",
    "WireError",
    "decode",
    "encode",
    "generate_keypair",
    "sd_notify",
    "serve_metrics",
    "setup_logging",
    "start_authenticator",
    "stop_on_signals",
    "watchdog_interval_s",
]
