"""Every TCP connection on this host from the kernel (bpf/conntrack.c through bcc), as Connection records."""

from __future__ import annotations

import importlib
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from prismlb.bpf import constants, program_text

from ._clock import UnixClock
from ._connections import Connection
from ._network import TcpCounts

PROGRAM = "conntrack"
TRACEFS = Path("/sys/kernel/tracing")
TRACEPOINTS: tuple[str, ...] = tuple(
    f"{category}:{name}"
    for category, name in re.findall(r"^TRACEPOINT_PROBE\((\w+), (\w+)\)", program_text(PROGRAM), re.MULTILINE)
)
DEFAULT_PAGE_CNT = 128
_C = constants(PROGRAM)
MAX_FILTER_ENTRIES = _C["FILTER_ENTRIES"]
"""The size of the program's `ports` and `pids` maps."""
_COUNT_INDEX = tuple(_C[f"COUNT_{field.upper()}"] for field in TcpCounts._fields)
"""Where each TcpCounts field sits in the program's `tcp_counts`."""
if _C["COUNTS"] != len(TcpCounts._fields):
    raise ImportError(f"bpf/{PROGRAM}.h counts {_C['COUNTS']} TCP counters; TcpCounts reads {len(TcpCounts._fields)}")

CheckRow = tuple[str, bool, str]
ConnectionCallback = Callable[[Connection], None]


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
    events = TRACEFS / "events"
    if events.is_dir():
        return ("tracefs", True, str(TRACEFS))
    return ("tracefs", False, f"{events} missing; mount tracefs at {TRACEFS} (make setup)")


def _kernel_headers() -> CheckRow:
    build = Path("/lib/modules") / os.uname().release / "build"
    if build.exists():
        return ("kernel headers", True, f"{build} -> {build.resolve()}")
    return ("kernel headers", False, f"{build} missing; make setup links kernel headers")


def _tracepoint(tracepoint: str) -> CheckRow:
    path = TRACEFS / "events" / tracepoint.replace(":", "/") / "format"
    if path.is_file():
        return (f"tracepoint {tracepoint}", True, str(path))
    return (
        f"tracepoint {tracepoint}",
        False,
        f"{path} missing: this kernel lacks the tracepoint {PROGRAM}.c needs; run Linux 6.3 or later",
    )


def prerequisites() -> list[CheckRow]:
    """(item, works, detail) for what loading bpf/conntrack.c needs: root, bcc, tracefs, headers, tracepoints."""
    return [_root(), _bcc(), _tracefs(), _kernel_headers(), *(_tracepoint(name) for name in TRACEPOINTS)]


def _cflags() -> list[str]:
    """The program's variants for this kernel's tracepoint formats: -DPRISM_RETRANSMIT_HAS_ERR where
    tcp_retransmit_skb also reports failed attempts (its `err` field), -DPRISM_SEND_RESET_SOCKADDR where
    tcp_send_reset gives its addresses as sockaddrs (Linux 6.10 on) rather than as ports and addresses."""
    events = TRACEFS / "events" / "tcp"
    flags = []
    if re.search(r"field:int err;", (events / "tcp_retransmit_skb" / "format").read_text()):
        flags.append("-DPRISM_RETRANSMIT_HAS_ERR")
    if re.search(r"field:__u8 saddr\[28\];", (events / "tcp_send_reset" / "format").read_text()):
        flags.append("-DPRISM_SEND_RESET_SOCKADDR")
    return flags


def _checked(values: Iterable[int], low: int, high: int, what: str) -> frozenset[int]:
    checked = frozenset(values)
    if len(checked) > MAX_FILTER_ENTRIES:
        raise ValueError(f"{len(checked)} {what}s to filter on; at most {MAX_FILTER_ENTRIES}")
    for value in checked:
        if not low <= value <= high:
            raise ValueError(f"{what} {value} is outside {low}..{high}")
    return checked


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _address(family: int, raw: Any) -> str:
    packed = bytes(raw)
    return socket.inet_ntop(family, packed[:4] if family == socket.AF_INET else packed)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@lru_cache(maxsize=1)
def _boot_unix_s() -> float:
    with open("/proc/stat") as stat:
        return float(next(line.split()[1] for line in stat if line.startswith("btime ")))


@lru_cache(maxsize=4096)
def process_start_unix_s(pid: int, comm: str) -> float | None:
    """When process `pid` started (epoch seconds), read once per (pid, comm) from /proc; None once it is gone.

    The kernel's own `task_struct` is off limits (its layout differs from the packaged headers), so the
    start time comes from user space; with `comm` in the key a recycled pid is read again."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return _boot_unix_s() + int(fields[19]) / _CLOCK_TICKS


class ConnectionTracer:
    """TCP connections of this host, client and server side, seen from tracepoints; open with `open()`.

    `poll()` delivers the kernel's events, in kernel time order within each call, as Connection records to
    `on_established` (client: after the handshake; server: when the process first reads or writes) and
    `on_closed` (with bytes, retransmits and the close time). Times are epoch nanoseconds.
    """

    def __init__(self, bpf: Any, ports: frozenset[int], pids: frozenset[int], page_cnt: int) -> None:
        """Configure the filters of the loaded program `bpf` and open its perf buffer; `open()` calls this."""
        self.on_established: ConnectionCallback | None = None
        self.on_closed: ConnectionCallback | None = None
        self.ports = ports
        self.pids = pids
        self.lost_events = 0
        self.events_total = 0
        self._bpf = bpf
        self._clock = UnixClock()
        self._batch: list[tuple[int, int, Connection]] = []
        self._poll_lock = threading.Lock()
        self._closed = False
        self._conns = bpf[b"conns"]
        self._connect_calls = bpf[b"connect_calls"]
        self._tcp_counts = bpf[b"tcp_counts"]
        self._fill(bpf[b"ports"], ports)
        self._fill(bpf[b"pids"], pids)
        match_all = bpf[b"match_all"]
        match_all[match_all.Key(_C["FILTER_PORTS"])] = match_all.Leaf(0 if ports else 1)
        match_all[match_all.Key(_C["FILTER_PIDS"])] = match_all.Leaf(0 if pids else 1)
        self._cpus: list[int] = importlib.import_module("bcc.utils").get_online_cpus()
        self._events = bpf[b"events"]
        self._events.open_perf_buffer(self._on_event, page_cnt=page_cnt, lost_cb=self._on_lost)

    @classmethod
    def open(
        cls, ports: Iterable[int] = (), pids: Iterable[int] = (), *, page_cnt: int = DEFAULT_PAGE_CNT
    ) -> tuple[ConnectionTracer | None, str]:
        """The attached tracer and what it traces, or None and one line saying why not and how to fix it.

        `ports`: trace only connections with one of these local or remote ports; `pids`: only these
        processes; empty means all. `page_cnt`: perf buffer pages per CPU, a power of two.
        """
        port_set = _checked(ports, 1, 0xFFFF, "port")
        pid_set = _checked(pids, 1, 0xFFFFFFFF, "pid")
        if page_cnt < 1 or page_cnt & (page_cnt - 1):
            raise ValueError(f"page_cnt {page_cnt} is not a power of two")
        for _name, ok, detail in prerequisites():
            if not ok:
                return None, detail
        bcc = importlib.import_module("bcc")
        try:
            bpf = bcc.BPF(text=program_text(PROGRAM).encode(), cflags=_cflags())
        except Exception as exc:  # bcc raises a bare Exception when compiling or attaching fails
            return None, f"loading {PROGRAM}.c failed ({_first_line(exc)}); make setup links kernel headers that match"
        try:
            tracer = cls(bpf, port_set, pid_set, page_cnt)
        except Exception as exc:  # bcc again: the perf buffer needs locked memory (RLIMIT_MEMLOCK)
            bpf.cleanup()
            return None, f"opening the perf buffer failed ({_first_line(exc)}); lower page_cnt or raise RLIMIT_MEMLOCK"
        filters = (("ports", port_set), ("pids", pid_set))
        scope = "; ".join(f"{what} {sorted(values)}" for what, values in filters if values)
        return tracer, (
            f"tracing TCP connections ({scope or 'all'}), counting connect() calls and TCP health signals "
            f"({PROGRAM}.c on {len(TRACEPOINTS)} tracepoints)"
        )

    @staticmethod
    def _fill(table: Any, keys: frozenset[int]) -> None:
        for key in keys:
            table[table.Key(key)] = table.Leaf(1)

    def _on_lost(self, count: int) -> None:
        self.lost_events += count

    def _on_event(self, _cpu: int, data: Any, _size: int) -> None:
        event = self._events.event(data)
        to_unix = self._clock.to_unix_ns
        comm = event.comm.decode(errors="replace") if event.pid else None
        connection = Connection(
            sock_id=event.sock_id,
            role="server" if event.role == _C["ROLE_SERVER"] else "client",
            local_addr=_address(event.family, event.laddr),
            local_port=event.lport,
            remote_addr=_address(event.family, event.raddr),
            remote_port=event.rport,
            established_unix_ns=to_unix(event.established_ns),
            pid=event.pid or None,
            tid=event.tid or None,
            comm=comm,
            process_start_unix_s=process_start_unix_s(event.pid, comm) if comm is not None else None,
            handshake_us=(event.established_ns - event.syn_ns) / 1000 if event.syn_ns else None,
            closed_unix_ns=to_unix(event.closed_ns) if event.kind == _C["EVENT_CLOSED"] else None,
            bytes_sent=event.bytes_sent,
            bytes_received=event.bytes_received,
            retransmits=event.retransmits,
        )
        self._batch.append((event.ts_ns, event.kind, connection))

    def poll(self, timeout_ms: int = 100) -> int:
        """Wait up to `timeout_ms` for events, hand them to the callbacks and return how many there were."""
        with self._poll_lock:
            if self._closed:
                return 0
            self._clock.refresh_if_due()
            self._bpf.perf_buffer_poll(timeout_ms)
            batch, self._batch = self._batch, []
        batch.sort(key=lambda item: item[0])  # each CPU has its own buffer: restore the kernel's order
        self.events_total += len(batch)
        for _ts, kind, connection in batch:
            callback = self.on_established if kind == _C["EVENT_ESTABLISHED"] else self.on_closed
            if callback is not None:
                callback(connection)
        return len(batch)

    def live_entries(self) -> int:
        """Connections the kernel tracks now (entries in the `conns` map)."""
        return len(self._conns)

    def stats(self, sock_id: int, local_port: int, remote_port: int) -> tuple[int, int, int] | None:
        """(bytes sent, bytes received, retransmits) of a live connection now; None once it is closed, or when
        its socket's address already belongs to a newer connection (other ports) whose close came first."""
        try:
            state = self._conns[self._conns.Key(sock_id)]
        except KeyError:
            return None
        if (state.lport, state.rport) != (local_port, remote_port):
            return None
        return (state.bytes_sent, state.bytes_received, state.retransmits)

    def connect_calls_total(self) -> int:
        """connect() calls on this host since the program was attached (any socket, any filter)."""
        return int(self._connect_calls.sum(self._connect_calls.Key(0)).value)

    def tcp_counts(self) -> TcpCounts:
        """The program's TCP health counters since it was attached (bpf/conntrack.c `tcp_counts`)."""
        table = self._tcp_counts
        return TcpCounts(*(int(table.sum(table.Key(i)).value) for i in _COUNT_INDEX))

    @staticmethod
    def program_text() -> str:
        """The BPF C source this tracer loads."""
        return program_text(PROGRAM)

    def close(self) -> None:
        """Detach the program and free it; waits for a poll() in progress. Idempotent."""
        with self._poll_lock:
            if not self._closed:
                self._closed = True
                for cpu in self._cpus:  # close the perf buffers while the program's maps are still open
                    del self._events[cpu]
                self._bpf.cleanup()

    def __enter__(self) -> ConnectionTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
