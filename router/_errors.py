"""The router's own errors (the wire's `NoRouteError` covers a missing table, slice or node)."""

from __future__ import annotations

from prismlb.wire import PrismError


class ShedError(PrismError):
    """The guardian is shedding this request's class: the request is refused before it reaches any node."""

    def __init__(self, request_class: str, guardian: str, table: str) -> None:
        super().__init__(f"request class {request_class!r} is shed while the guardian is {guardian!r} ({table})")
        self.request_class = request_class
        self.guardian = guardian
