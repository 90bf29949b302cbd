"""The baselines of the cluster replay, each a faithful model of a public load balancer."""

from collections.abc import Callable

from .._types import Policy
from ._aibrix import AIBrixPrefixCache
from ._dynamo import DynamoKvRouter
from ._least_conn import LeastConnections
from ._llmd import CHART_WEIGHTS, LLMDScorer
from ._nginx_hash import NginxConsistentHash
from ._round_robin import RoundRobin
from ._sglang import SGLangCacheAware
from ._vllm_router import VllmKvAware

BASELINES: dict[str, Callable[[], Policy]] = {
    "round-robin": RoundRobin,
    "least-conn": LeastConnections,
    "nginx-hash": NginxConsistentHash,
    "sglang": SGLangCacheAware,
    "llm-d": LLMDScorer,
    "llm-d-chart": lambda: LLMDScorer(weights=CHART_WEIGHTS, name="llm-d-chart"),
}
"""Each baseline's factory by its name (the policy's `name`), with its source's defaults."""

__all__ = [
    "BASELINES",
    "AIBrixPrefixCache",
    "DynamoKvRouter",
    "LLMDScorer",
    "LeastConnections",
    "NginxConsistentHash",
    "RoundRobin",
    "SGLangCacheAware",
    "VllmKvAware",
]
