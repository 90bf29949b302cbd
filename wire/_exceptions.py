"""Every exception Prism raises, in one module."""

from __future__ import annotations


class PrismError(Exception):
    """Base class of all Prism errors."""


class ConfigError(PrismError):
    """A setting is missing or out of range."""


class WireError(PrismError):
    """A message failed to decode; `kind` names the failure for counting and logging."""

    kind = "malformed"


class FrameCountError(WireError):
    kind = "frames"


class UnknownKindError(WireError):
    kind = "unknown_kind"


class SchemaVersionError(WireError):
    kind = "schema_version"


class OversizedError(WireError):
    kind = "oversized"


class MalformedError(WireError):
    kind = "malformed"


class InvalidFieldError(WireError):
    """Wrong type, out-of-range value or negative count."""

    kind = "invalid_field"


class NonFiniteError(WireError):
    kind = "non_finite"


class SpoofedIdentityError(WireError):
    """A node vector names another node than the one its sender's CURVE key belongs to."""

    kind = "spoofed_identity"


class UnknownKeyError(WireError):
    """A node vector came over a connection whose CURVE key is no longer in the authorised-keys folder."""

    kind = "unknown_key"


class EndpointNotAllowedError(WireError):
    """A node vector advertises an endpoint host its sender's key is not registered for."""

    kind = "endpoint_not_allowed"


class FutureSampleError(WireError):
    """A node vector's sample time is further ahead of the brain's clock than any honest clock skew: taken,
    it would make every later vector of that node look old (a replay) until that time came."""

    kind = "future_sample"


class NoRouteError(PrismError):
    """The router has no table yet, or no node in the requested slice."""
