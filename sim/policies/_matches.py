"""The leading-run prefix match of the baselines' global block indexes (Dynamo's radix tree, llm-d's indexer)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping


def leading_matches(holders: Mapping[int, Collection[str]], blocks: Iterable[int]) -> dict[str, int]:
    """Per holder, the blocks it holds among the leading run of `blocks` some holder holds: both indexes walk a
    request's chained block hashes, adding 1 to every holder of each, and stop at the first hash nobody holds."""
    found: dict[str, int] = {}
    for block in blocks:
        names = holders.get(block)
        if not names:
            break
        for name in names:
            found[name] = found.get(name, 0) + 1
    return found
