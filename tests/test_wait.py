"""prismlb.service.wait_until: the one polling loop of services, benches and tests."""

from __future__ import annotations

import itertools
import time

from prismlb.service import wait_until


def test_it_returns_as_soon_as_the_check_holds() -> None:
    answers = itertools.chain([False, False], itertools.repeat(True))
    asked = []

    def check() -> bool:
        asked.append(1)
        return next(answers)

    assert wait_until(check, 10.0, interval_s=0.001)
    assert len(asked) == 3, "asked until it held, no more"


def test_a_check_that_never_holds_is_asked_once_more_at_the_deadline() -> None:
    asked: list[float] = []

    def check() -> bool:
        asked.append(time.monotonic())
        return False

    started = time.monotonic()
    assert not wait_until(check, 0.05, interval_s=0.01)
    assert asked[-1] - started >= 0.05, "the last answer comes at or after the deadline"
    assert 2 <= len(asked) <= 8


def test_the_checks_answer_counts_by_its_truth() -> None:
    assert wait_until(lambda: ["something"], 1.0)
    assert not wait_until(lambda: [], 0.0)
