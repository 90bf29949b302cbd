"""Frames on the wire: [kind, schema version, msgpack payload]; decoding validates everything."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import msgspec

from ._exceptions import (
    FrameCountError,
    InvalidFieldError,
    MalformedError,
    NonFiniteError,
    OversizedError,
    SchemaVersionError,
    UnknownKindError,
)
from ._messages import (
    SCHEMA_VERSION,
    ClusterLoad,
    Heartbeat,
    KvBlocks,
    KvDelta,
    KvSnapshotEnd,
    Message,
    NodeVector,
    RouterLoad,
    RoutingTable,
    SliceUpdate,
    SnapshotRequest,
    TableHead,
)

MAX_VECTOR_BYTES = 64 * 1024
MAX_TABLE_BYTES = 16 * 1024 * 1024

KINDS: dict[type, bytes] = {
    NodeVector: b"prism.node",
    RoutingTable: b"prism.table",
    Heartbeat: b"prism.heartbeat",
    SnapshotRequest: b"prism.snapshot?",
    TableHead: b"prism.head",
    SliceUpdate: b"prism.slice",
    KvBlocks: b"prism.kvblocks",
    KvDelta: b"prism.kvdelta",
    KvSnapshotEnd: b"prism.kvend",
    RouterLoad: b"prism.routerload",
    ClusterLoad: b"prism.load",
}
TOPIC_SEPARATOR = b"/"
"""A message's first frame is its kind, optionally followed by a topic (a slice update's slice name) between
two of these, so that subscribers filter by prefix in ZeroMQ itself ("llm" never matches "llm2")."""
_TYPES = {kind: cls for cls, kind in KINDS.items()}
_VERSION = str(SCHEMA_VERSION).encode()
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {cls: msgspec.msgpack.Decoder(cls) for cls in KINDS}

M = TypeVar("M", bound=Message)


def encode(message: Message, topic: str | None = None) -> list[bytes]:
    kind = KINDS[type(message)]
    if topic is not None:
        kind += TOPIC_SEPARATOR + topic.encode() + TOPIC_SEPARATOR
    return [kind, _VERSION, _ENCODER.encode(message)]


def topic_prefix(cls: type, topic: str | None = None) -> bytes:
    """The ZeroMQ subscription prefix for messages of `cls` (on `topic`, when given)."""
    kind = KINDS[cls]
    return kind + TOPIC_SEPARATOR + topic.encode() + TOPIC_SEPARATOR if topic is not None else kind


def decode(frames: Sequence[bytes], expect: tuple[type[M], ...], max_bytes: int) -> M:
    """Decode one multipart message into one of the expected types, or raise a `WireError`."""
    if len(frames) != 3:
        raise FrameCountError(f"expected 3 frames, got {len(frames)}")
    kind, version, payload = (bytes(f) for f in frames)
    cls = _TYPES.get(kind.partition(TOPIC_SEPARATOR)[0])
    if cls is None or cls not in expect:
        raise UnknownKindError(f"unexpected message kind {kind[:40]!r}")
    if version != _VERSION:
        raise SchemaVersionError(f"schema version {version[:16]!r}, this build speaks {SCHEMA_VERSION}")
    if len(payload) > max_bytes:
        raise OversizedError(f"{len(payload)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return _DECODERS[cls].decode(payload)
    except msgspec.ValidationError as exc:
        if _has_non_finite(payload):
            raise NonFiniteError(str(exc)) from None
        raise InvalidFieldError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise MalformedError(str(exc)) from None


def _has_non_finite(payload: bytes) -> bool:
    """Whether a payload that failed validation holds NaN or an infinity (reported as such, not as a range
    error); only read on that error path."""
    try:
        stack = [msgspec.msgpack.decode(payload)]
    except msgspec.DecodeError:
        return False
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
