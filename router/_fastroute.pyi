"""route()'s common case, and the prefix index's tables, in C (router/_fastroute.c)."""

from collections.abc import Iterable, Sequence

from ._snapshot import Endpoint, Entry, InFlight

class Table:
    """One group's ring, entries and in-flight counter: `Group.pick`'s twin in C, for `route`."""

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
        """`Group.pick` for a bare str, bytes or int key with nothing excluded: its endpoint, or None where the
        Python path must decide (a gated entry on the way, or another key type)."""

def position(key: object) -> int | None:
    """`_keys.position()` of an exact str, bytes or int key; None for any other type."""

class BlockIndex:
    """`PrefixIndex`'s tables (router/_index.py): block hashes are ints in [0, 2**64), node ids str."""

    def __init__(self, placed_ttl_s: float, max_placed: int) -> None: ...
    @property
    def placed_ttl_s(self) -> float: ...
    @property
    def max_placed(self) -> int: ...
    def stored(self, node: str, blocks: Iterable[int]) -> None: ...
    def removed(self, node: str, blocks: Iterable[int]) -> None: ...
    def reset(self, node: str, blocks: Iterable[int]) -> None: ...
    def drop(self, node: str) -> None: ...
    def placed(self, node: str, blocks: Sequence[int], now: float) -> None: ...
    def match(self, blocks: Sequence[int], now: float) -> dict[str, int]: ...
    def size(self, node: str) -> int: ...
    def __len__(self) -> int: ...
