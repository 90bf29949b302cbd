"""The router library: follows the brain's routing tables and places each request locally.

`Router.connect(BrainAddress(...))` subscribes to one or more brains. `router.route(request)` returns the
`Endpoint` for a `Request` (affinity key, modality, session, class) or a bare key: its slice, its experiment
arm, its session's endpoint, else bounded-load consistent hashing on the weighted `Ring`.
`with router.request(...) as lease:` also counts the request in flight and reports its outcome to passive
health and the circuit breaker. `prefix_key` computes affinity keys from token ids or text. `PrismTransport`
and `AsyncPrismTransport` route an httpx client (`EngineTokenizer` gives them the engines' token ids for text);
`Gateway` (`prism gateway`) relays HTTP requests through a router for callers that cannot embed one;
`render_nginx` writes a table as nginx upstreams; `add_parser` registers the `prism route` and `prism gateway`
subcommands.
"""

from __future__ import annotations

from prismlb.wire import NoRouteError

from ._cli import add_parser
from ._errors import ShedError
from ._gateway import Gateway, GatewayConfig, WorkerWatch, static_table
from ._health import Circuit, EndpointStatus, Outcome
from ._httpx import AsyncPrismTransport, PrismTransport
from ._keys import (
    BLOCK_SIZE,
    PREFIX_TOKENS,
    TEXT_BYTES_PER_TOKEN,
    ExtraKey,
    block_hash,
    block_hashes,
    media_block,
    position,
    prefix_key,
    text_block_hashes,
)
from ._lease import Lease
from ._nginx import nginx_choices, render_nginx
from ._nginx import ring_points as nginx_ring_points
from ._request import (
    AFFINITY_HEADER,
    CLASS_HEADER,
    CONTEXT_HEADER,
    SESSION_HEADER,
    TTFT_SLO_HEADER,
    Request,
)
from ._ring import Ring
from ._router import Router
from ._settings import Settings
from ._snapshot import Endpoint
from ._tokenize import EngineTokenizer
from ._turns import Ticket

__all__ = [
    "AFFINITY_HEADER",
    "BLOCK_SIZE",
    "CLASS_HEADER",
    "CONTEXT_HEADER",
    "PREFIX_TOKENS",
    "SESSION_HEADER",
    "TEXT_BYTES_PER_TOKEN",
    "TTFT_SLO_HEADER",
    "AsyncPrismTransport",
    "Circuit",
    "Endpoint",
    "EndpointStatus",
    "EngineTokenizer",
    "ExtraKey",
    "Gateway",
    "GatewayConfig",
    "Lease",
    "NoRouteError",
    "Outcome",
    "PrismTransport",
    "Request",
    "Ring",
    "Router",
    "Settings",
    "Ticket",
    "WorkerWatch",
    "ShedError",
    "add_parser",
    "block_hash",
    "block_hashes",
    "media_block",
    "position",
    "prefix_key",
    "nginx_choices",
    "nginx_ring_points",
    "render_nginx",
    "static_table",
    "text_block_hashes",
]
