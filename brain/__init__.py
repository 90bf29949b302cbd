"""The Prism brain: node vectors in, health-weighted routing tables out."""

from ._brain import Brain
from ._cli import add_parser
from ._ctl import add_parsers as add_ctl_parsers
from ._config import BrainConfig, resolve_config
from ._registry import EntryKey, NodeState, Registry
from ._slices import Capabilities, Tier, capabilities, pools
from ._tables import TableBuilder, next_epoch
from ._topology import numa_factor, virtual_nodes
from ._weights import Predictions, compute_weights, sensitivity

__all__ = [
    "Brain",
    "BrainConfig",
    "Capabilities",
    "EntryKey",
    "NodeState",
    "Predictions",
    "Registry",
    "TableBuilder",
    "Tier",
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
