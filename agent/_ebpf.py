"""What the agent reports from the connection tracer's one program (the connect() count and the TCP health
window) and the host check behind `prism agent --check`."""

from __future__ import annotations

from collections.abc import Iterable

import pynvml

from ._conntrack import CheckRow, ConnectionTracer, prerequisites
from ._network import NetworkWindow


class ConnectCounter:
    """connect() calls on this host since the program was attached (syscalls:sys_enter_connect), counted by
    the same BPF program that traces connections: `tracer` is that program, for connection events; `network`
    its TCP health per agent window, which its ESTABLISHED events feed (`TracePath`)."""

    def __init__(self, tracer: ConnectionTracer) -> None:
        self.tracer = tracer
        self.network = NetworkWindow(tracer.tcp_counts)

    def total(self) -> int:
        """The per-CPU counts, summed."""
        return self.tracer.connect_calls_total()

    def close(self) -> None:
        """Detach the tracepoints and free the program."""
        self.tracer.close()

    def __enter__(self) -> ConnectCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe_ebpf(ports: Iterable[int] = (), pids: Iterable[int] = ()) -> tuple[ConnectCounter | None, str]:
    """The attached counter (and tracer, filtered to `ports`/`pids` when given) and what it does, or None and
    one line saying why not and how to fix it."""
    tracer, detail = ConnectionTracer.open(ports, pids)
    return (ConnectCounter(tracer) if tracer is not None else None), detail


def _nvml() -> CheckRow:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return ("nvml", False, f"no NVIDIA driver ({exc}); GPU metrics stay absent")
    try:
        return ("nvml", True, f"driver {pynvml.nvmlSystemGetDriverVersion()}, {pynvml.nvmlDeviceGetCount()} GPU(s)")
    finally:
        pynvml.nvmlShutdown()


def _bpf_load(rows: list[CheckRow]) -> CheckRow:
    missing = [detail for _name, ok, detail in rows if not ok]
    if missing:
        return ("bpf load", False, f"skipped: {missing[0]}")
    tracer, detail = ConnectionTracer.open()
    if tracer is not None:
        tracer.close()
    return ("bpf load", tracer is not None, detail)


def check() -> list[CheckRow]:
    """(item, works, detail) for each thing the agent needs from this host, in order."""
    rows = prerequisites()
    return [*rows, _bpf_load(rows), _nvml()]
