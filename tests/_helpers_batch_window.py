"""What the tests of the two batch-window benches share: a quick run of one and the rows of its phase table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASE_HEADER = "| phase (by arrival) | requests | P99 TTFT ms: fixed 200 ms | adaptive | fixed / adaptive |"
PHASE_ROW = re.compile(r"^\| (before|spike|after)[^|]*\| (\d+) \| ([\d,]+) \| ([\d,]+) \| (\d+\.\d\d)× \|", re.M)


def quick_bench(script: str) -> tuple[str, list[tuple[str, int, int, int, float]]]:
    """What `bench/<script> --quick` printed, and its phase table's rows: (phase, requests, P99 TTFT ms of the
    fixed window, of the adaptive one, their ratio as printed). Both benches print the table the same way."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert PHASE_HEADER in done.stdout
    rows = [
        (phase, int(count), int(fixed.replace(",", "")), int(adaptive.replace(",", "")), float(ratio))
        for phase, count, fixed, adaptive, ratio in PHASE_ROW.findall(done.stdout)
    ]
    return done.stdout, rows
