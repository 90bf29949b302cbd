"""The Prism brain: node vectors in, health-weighted routing tables out."""

from ._brain import Brain
from ._cli import add_parser
from ._ctl import add_parsers as add_ctl_parsers
from ._config import BrainConfig, resolve_config
from ._registry import NodeState, Registry
from ._tables import DEFAULT_SLICE, TableBuilder, next_epoch

__all__ = [
    "DEFAULT_SLICE",
    "Brain",
    "BrainConfig",
    "NodeState",
    "Registry",
    "TableBuilder",
    "add_ctl_parsers",
    "add_parser",
    "next_epoch",
    "resolve_config",
]
