"""The eBPF connect() counter (bcc, tracepoints only) and the host check behind `prism agent --check`."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import pynvml

from prismlb.bpf import program_text

PROGRAM = "connect_count"
TRACEPOINT = Path("/sys/kernel/tracing/events/syscalls/sys_enter_connect")

CheckRow = tuple[str, bool, str]


class ConnectCounter:
    """connect() calls on this host since the program was attached (syscalls:sys_enter_connect)."""

    def __init__(self, bpf: Any) -> None:
        self._bpf = bpf
        self._table = bpf[b"connect_calls"]

    def total(self) -> int:
        """The per-CPU counts, summed."""
        return int(self._table.sum(self._table.Key(0)).value)

    def close(self) -> None:
        """Detach the tracepoint and free the program."""
        self._bpf.cleanup()

    def __enter__(self) -> ConnectCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _root() -> CheckRow:
    uid = os.geteuid()
    if uid == 0:
        return ("root", True, "running as root")
    return ("root", False, f"running as uid {uid}; run as root (loading BPF needs CAP_BPF and CAP_PERFMON)")


def _bcc() -> CheckRow:
    try:
        bcc = importlib.import_module("bcc")
    except (ImportError, OSError) as exc:
        return ("bcc", False, f"cannot import bcc ({exc}); apt-get install python3-bpfcc")
    return ("bcc", True, f"bcc {getattr(bcc, '__version__', '(unknown version)')}")


def _tracefs() -> CheckRow:
    if TRACEPOINT.is_dir():
        return ("tracefs", True, str(TRACEPOINT))
    return (
        "tracefs",
        False,
        f"{TRACEPOINT} missing; mount tracefs at /sys/kernel/tracing (make setup) on a kernel with syscall tracepoints",
    )


def _kernel_headers() -> CheckRow:
    build = Path("/lib/modules") / os.uname().release / "build"
    if build.exists():
        return ("kernel headers", True, f"{build} -> {build.resolve()}")
    return ("kernel headers", False, f"{build} missing; make setup links kernel headers")


def _prerequisites() -> list[CheckRow]:
    return [_root(), _bcc(), _tracefs(), _kernel_headers()]


def _load() -> tuple[ConnectCounter | None, str]:
    bcc = importlib.import_module("bcc")
    try:
        bpf = bcc.BPF(text=program_text(PROGRAM).encode())
    except Exception as exc:  # bcc raises a bare Exception when compiling or attaching fails
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"loading {PROGRAM}.c failed ({first_line}); make setup links kernel headers that match"
    return ConnectCounter(bpf), f"counting connect() calls on syscalls:sys_enter_connect ({PROGRAM}.c)"


def probe_ebpf() -> tuple[ConnectCounter | None, str]:
    """The attached counter and what it does, or None and one line saying why not and how to fix it."""
    for _name, ok, detail in _prerequisites():
        if not ok:
            return None, detail
    return _load()


def _nvml() -> CheckRow:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return ("nvml", False, f"no NVIDIA driver ({exc}); GPU metrics stay absent")
    try:
        return ("nvml", True, f"driver {pynvml.nvmlSystemGetDriverVersion()}, {pynvml.nvmlDeviceGetCount()} GPU(s)")
    finally:
        pynvml.nvmlShutdown()


def check() -> list[CheckRow]:
    """(item, works, detail) for each thing the agent needs from this host, in order."""
    rows = _prerequisites()
    missing = [detail for _name, ok, detail in rows if not ok]
    if missing:
        rows.append(("bpf load", False, f"skipped: {missing[0]}"))
    else:
        counter, detail = _load()
        if counter is not None:
            counter.close()
        rows.append(("bpf load", counter is not None, detail))
    rows.append(_nvml())
    return rows
