"""The start-up hold: a brain publishes its first table only once its evidence supports it.

A brain that has just started knows only the nodes that have reached it so far. Published at once, its first
table would drop every node whose agent has not reached it yet, and routers following it would lose those
nodes (or, with none heard, every node) until the agents came back. So the brain remembers the nodes it last
routed to (a file in its state folder, rewritten when the set changes) and holds its first table until it has
heard from `quorum` of them, or from any node when it remembers none, or until `holddown_s` has passed: a
node that is really gone then leaves the table, as it would have after its staleness limit.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Collection
from pathlib import Path

_log = logging.getLogger("prism.brain")
KNOWN_NODES_FILE = "nodes.json"


class KnownNodes:
    """The node ids of the last table, persisted in the state folder (nothing without one)."""

    def __init__(self, state_dir: Path | None) -> None:
        self._path = None if state_dir is None else state_dir / KNOWN_NODES_FILE
        self.ids: frozenset[str] = self._load()

    def _load(self) -> frozenset[str]:
        if self._path is None:
            return frozenset()
        try:
            ids = json.loads(self._path.read_text())
        except FileNotFoundError:
            return frozenset()
        except (OSError, ValueError) as exc:
            _log.warning("known nodes file %s unusable (%s); the first table waits out the hold-down", self._path, exc)
            return frozenset()
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            _log.warning("known nodes file %s is not a list of node ids; ignored", self._path)
            return frozenset()
        return frozenset(ids)

    def remember(self, ids: Collection[str]) -> None:
        """Persist `ids` when they differ from the last ones (atomically: a crash leaves the old file)."""
        new = frozenset(ids)
        if new == self.ids:
            return
        self.ids = new
        if self._path is None:
            return
        tmp = self._path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(sorted(new)))
            os.replace(tmp, self._path)
        except OSError as exc:
            _log.warning("cannot persist known nodes to %s: %s", self._path, exc)


class StartupHold:
    """Decides when the first table may go out; once released it stays released."""

    def __init__(self, known: frozenset[str], quorum: float, holddown_s: float) -> None:
        self.known = known
        self.needed = math.ceil(quorum * len(known)) if known else 1
        self.holddown_s = holddown_s
        self._since: float | None = None
        self.released = False

    def check(self, now: float, live: Collection[str]) -> bool:
        """True once the table may be published: quorum heard, or the hold-down passed since the first check."""
        if self.released:
            return True
        if self._since is None:
            self._since = now
            if self.known:
                _log.info(
                    "holding the first table until %d of the %d nodes of the last run report (at most %g s)",
                    self.needed,
                    len(self.known),
                    self.holddown_s,
                )
        heard = len(self.known.intersection(live)) if self.known else len(live)
        if heard >= self.needed or now - self._since >= self.holddown_s:
            self.released = True
            _log.info(
                "first table released after %.1f s: %d node(s) reporting, %d known from the last run",
                now - self._since,
                len(live),
                len(self.known),
            )
        return self.released
