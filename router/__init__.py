"""The router library: follows the brain's routing tables and routes each request locally.

`Router.connect(BrainAddress(...))` subscribes to one or more brains; `router.route(key, slice_name)`
returns the `Endpoint` that owns the key on the newest table, by weighted consistent hashing (`Ring`).
`add_parser` registers the `prism route` subcommand.
"""

from prismlb.wire import NoRouteError

from ._cli import add_parser
from ._ring import Ring
from ._router import Endpoint, Router

__all__ = ["Endpoint", "NoRouteError", "Ring", "Router", "add_parser"]
