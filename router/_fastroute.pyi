"""route()'s common case in C (router/_fastroute.c)."""

from collections.abc import Sequence

from ._snapshot import Endpoint, Entry, InFlight

class Table:
    """One group's ring, entries and in-flight counter, for `route`."""

    def __init__(
        self,
        points: Sequence[int],
        owners: Sequence[int],
        slots: Sequence[int | None],
        shift: int,
        entries: tuple[Entry, ...],
        base_total: float,
        counter: InFlight,
        balance: float,
    ) -> None: ...
    def route(self, key: object) -> Endpoint | None:
        """The endpoint for a bare str, bytes or int key; None where the pure-Python path must decide."""

def position(key: object) -> int | None:
    """`_keys.position()` of an exact str, bytes or int key; None for any other type."""
