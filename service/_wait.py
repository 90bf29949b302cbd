"""Waiting for a condition by polling it: the one loop the services' start-up checks, the benches and the tests
share, so that none of them waits a fixed time for something it can ask about."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(check: Callable[[], object], timeout_s: float, interval_s: float = 0.005) -> bool:
    """Poll `check` every `interval_s` until it holds or `timeout_s` passes (`time.monotonic`); whether it held.
    It is asked once more at the deadline, so a check that holds just as time runs out is not missed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval_s)
    return bool(check())
