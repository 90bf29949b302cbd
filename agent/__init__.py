"""The Prism node agent: samples its GPU host (eBPF through bcc, psutil) and streams node vectors to the brain."""

from ._agent import Agent
from ._cli import add_parser
from ._config import AgentConfig, resolve_config
from ._connections import Connection
from ._conntrack import CheckRow, ConnectionTracer
from ._ebpf import ConnectCounter, check, probe_ebpf
from ._engine import EngineCollector, EngineSample
from ._host import HostSample, HostSampler

__all__ = [
    "Agent",
    "AgentConfig",
    "CheckRow",
    "ConnectCounter",
    "Connection",
    "ConnectionTracer",
    "EngineCollector",
    "EngineSample",
    "HostSample",
    "HostSampler",
    "add_parser",
    "check",
    "probe_ebpf",
    "resolve_config",
]
