"""The BPF C programs the agent loads through bcc, and the headers they share with Python, as package data.

A program's `#include "NAME.h"` of a header beside it is inlined by `program_text` (bcc compiles the text it is
given, with no include path to this package); `constants` reads the same header's `#define NAME <integer>`
lines, so a constant the kernel side and the loader both use is written once."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib.resources import files

_INCLUDE = re.compile(r'^#include "(\w+)\.h"[ \t]*$', re.MULTILINE)
_DEFINE = re.compile(r"^#define (\w+) +(-?\d+)\b", re.MULTILINE)


def _read(filename: str) -> str:
    resource = files(__name__).joinpath(filename)
    if not resource.is_file():
        raise FileNotFoundError(f"no BPF source {filename!r} in {__name__}")
    return resource.read_text(encoding="utf-8")


def program_text(name: str) -> str:
    """The source of the BPF program `name` (e.g. "conntrack" for conntrack.c), its local headers inlined."""
    return _INCLUDE.sub(lambda m: _read(f"{m.group(1)}.h"), _read(f"{name}.c"))


@lru_cache(maxsize=None)
def constants(header: str) -> dict[str, int]:
    """Every `#define NAME <integer>` of the header `header` (e.g. "conntrack" for conntrack.h)."""
    return {name: int(value) for name, value in _DEFINE.findall(_read(f"{header}.h"))}


__all__ = ["constants", "program_text"]
