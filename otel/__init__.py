"""Worker library for inference servers and training jobs on their hosts: stage spans per modality, GPU-allocator
metrics over OTLP, the adaptive batch window, and gradient-aware offload bandwidth."""

from ._allocator import AllocatorStats, allocator_stats_from_snapshot
from ._batch_window import AdaptiveBatchWindow, BatchWindowSettings, BreakerState, BreakerTransition
from ._conventions import STAGES
from ._metrics import SnapshotProvider
from ._offload import (
    CHUNK_BYTES,
    QP_RATE_MBPS,
    URGENT_SHARE,
    BandwidthPlan,
    BandwidthScheduler,
    Clock,
    EmulatedLink,
    GradientMonitor,
    LayerGradient,
    LinkPolicy,
    LinkRun,
    RateClass,
    SimulatedClock,
    TokenBucket,
    Transfer,
    WallClock,
    fifo,
    qp_rate_limits,
    static_equal_share,
)
from ._reservation import ReservationAdvisor, ReservationMode
from ._sessions import (
    DirectorySnapshotStore,
    MemorySnapshotStore,
    SessionSnapshot,
    SnapshotStore,
    context_hash,
)
from ._setup import setup
from ._spans import RequestSpan
from ._telemetry import PrismTelemetry

__all__ = [
    "CHUNK_BYTES",
    "QP_RATE_MBPS",
    "STAGES",
    "URGENT_SHARE",
    "AdaptiveBatchWindow",
    "AllocatorStats",
    "BandwidthPlan",
    "BandwidthScheduler",
    "BatchWindowSettings",
    "BreakerState",
    "BreakerTransition",
    "Clock",
    "DirectorySnapshotStore",
    "EmulatedLink",
    "GradientMonitor",
    "LayerGradient",
    "LinkPolicy",
    "LinkRun",
    "MemorySnapshotStore",
    "PrismTelemetry",
    "RateClass",
    "RequestSpan",
    "ReservationAdvisor",
    "ReservationMode",
    "SessionSnapshot",
    "SimulatedClock",
    "SnapshotProvider",
    "SnapshotStore",
    "TokenBucket",
    "Transfer",
    "WallClock",
    "allocator_stats_from_snapshot",
    "context_hash",
    "fifo",
    "qp_rate_limits",
    "setup",
    "static_equal_share",
]
