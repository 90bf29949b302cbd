"""The Prism brain: node vectors in, health-weighted routing tables out.

`Brain` (which loads torch for the predictor) and the failover scheduler's names (torch for its student) are
imported on first use, so the CLI and the router stay light.
"""

from typing import TYPE_CHECKING, Any

from ._cli import add_parser
from ._config import BrainConfig, resolve_config
from ._ctl import add_parsers as add_ctl_parsers
from ._load_relay import LoadRelay
from ._registry import EntryKey, NodeState, Registry
from ._slices import Capabilities, Tier, capabilities, pools
from ._tables import TableBuilder, next_epoch
from ._topology import numa_factor, virtual_nodes
from ._weights import LATENCY_WEIGHTS, TAU0_MS, Predictions, compute_weights, sensitivity

if TYPE_CHECKING:
    from ._brain import Brain
    from ._failover import FailoverScheduler, LocalFirst, StudentPolicy, ZoneObservation

_FAILOVER = ("FailoverScheduler", "LocalFirst", "StudentPolicy", "ZoneObservation")


def __getattr__(name: str) -> Any:
    if name == "Brain":
        from ._brain import Brain

        return Brain
    if name in _FAILOVER:
        from . import _failover

        return getattr(_failover, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LATENCY_WEIGHTS",
    "TAU0_MS",
    "Brain",
    "BrainConfig",
    "Capabilities",
    "EntryKey",
    "FailoverScheduler",
    "LocalFirst",
    "LoadRelay",
    "NodeState",
    "Predictions",
    "Registry",
    "StudentPolicy",
    "TableBuilder",
    "Tier",
    "ZoneObservation",
    "add_ctl_parsers",
    "add_parser",
    "capabilities",
    "compute_weights",
    "next_epoch",
    "numa_factor",
    "pools",
    "resolve_config",
    "sensitivity",
    "virtual_nodes",
]
