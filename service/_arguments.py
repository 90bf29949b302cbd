"""Numbers given on a command line: argparse types whose errors say what was wrong in one line (the bad text, or
the bound the option sets, in the option's own words)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def whole_number_at_least(minimum: int, too_small: str) -> Callable[[str], int]:
    """An argparse `type=` for a whole number of at least `minimum`. Anything else is an ArgumentTypeError
    (argparse's usage error): text that is no whole number is named, a smaller number gets `too_small` with the
    number in place of `{value}`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(too_small.format(value=value))
        return value

    return parse
