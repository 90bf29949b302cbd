"""Where the public request traces live: `PRISM_TRACES`, else `../shared/data/traces` next to the project,
else the workplace's `/work/shared/data/traces` (a clone elsewhere, as in CI, still finds them)."""

from __future__ import annotations

import os
from pathlib import Path

_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "traces",
    Path("/work/shared/data/traces"),
)


def traces_dir() -> Path:
    """The traces folder; the first candidate when none exists (callers report the missing file)."""
    configured = os.environ.get("PRISM_TRACES")
    if configured:
        return Path(configured)
    return next((path for path in _CANDIDATES if path.is_dir()), _CANDIDATES[0])
