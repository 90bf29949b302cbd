"""Where this router last sent each affinity key, and how much prompt went there: its guess of the engines' caches."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ._request import Key


class PrefixMemory:
    """The last entry and cost per affinity key, least recently used forgotten past `capacity`; thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[Key, tuple[str, int]] = OrderedDict()

    def get(self, key: Key) -> tuple[str, int] | None:
        """(entry label, cost) of the key's last placement, if remembered."""
        with self._lock:
            return self._entries.get(key)

    def put(self, key: Key, label: str, cost: int) -> None:
        with self._lock:
            self._entries[key] = (label, cost)
            self._entries.move_to_end(key)
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
