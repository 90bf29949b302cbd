"""Worker library for inference servers: stage spans per modality and GPU-allocator metrics over OTLP."""

from ._allocator import AllocatorStats, allocator_stats_from_snapshot
from ._conventions import STAGES
from ._metrics import SnapshotProvider
from ._reservation import ReservationAdvisor, ReservationMode
from ._setup import setup
from ._spans import RequestSpan
from ._telemetry import PrismTelemetry

__all__ = [
    "STAGES",
    "AllocatorStats",
    "PrismTelemetry",
    "RequestSpan",
    "ReservationAdvisor",
    "ReservationMode",
    "SnapshotProvider",
    "allocator_stats_from_snapshot",
    "setup",
]
