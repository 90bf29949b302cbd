"""Every TCP connection on this host from the kernel (bpf/conntrack.c through bcc), as Connection records.

The program writes its events into one ring buffer, read here a batch at a time straight from its shared memory
(`RingReader`): per event, one `struct.unpack_from` and one Connection, with the text of addresses and process
names made once per distinct value rather than once per event.
"""

from __future__ import annotations

import ctypes
import importlib
import mmap
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from prismlb.bpf import constants, program_text

from ._clock import UnixClock
from ._connections import Connection
from ._network import TcpCounts
from ._ringbuf import RingReader

PROGRAM = "conntrack"
TRACEFS = Path("/sys/kernel/tracing")
TRACEPOINTS: tuple[str, ...] = tuple(
    f"{category}:{name}"
    for category, name in re.findall(r"^TRACEPOINT_PROBE\((\w+), (\w+)\)", program_text(PROGRAM), re.MULTILINE)
)
RING_BYTES = 32 << 20
DEFAULT_PAGE_CNT = RING_BYTES // mmap.PAGESIZE
"""Ring buffer pages (one buffer, however many CPUs): 32 MiB, about 240,000 events, six seconds of 20,000
connections/s (two events each): a busy host's scheduler can keep the reader off the CPU for seconds, and the
reader catches up afterwards (it takes about 5 µs an event)."""
BATCH_S = 0.02
"""`poll` takes events at most this often while it keeps up: a wake-up costs more than an event, and the join waits
longer than this for a connection's events anyway (`AgentConfig.join_delay_s`)."""
MAX_BATCH = 4096
"""Events one `poll` takes at most: with a backlog, the callbacks get its oldest events (and the kernel their space)
without waiting for the rest to be read."""
NAMES_MAX = 8192
"""Texts of addresses, and processes' names and start times, kept for reuse, each; past this a cache starts over."""
_C = constants(PROGRAM)
MAX_FILTER_ENTRIES = _C["FILTER_ENTRIES"]
"""The size of the program's `ports` and `pids` maps."""
_ESTABLISHED = _C["EVENT_ESTABLISHED"]
_ROLES = {_C["ROLE_CLIENT"]: "client", _C["ROLE_SERVER"]: "server"}
_COUNT_INDEX = tuple(_C[f"COUNT_{field.upper()}"] for field in TcpCounts._fields)
"""Where each TcpCounts field sits in the program's `tcp_counts`."""
if _C["COUNTS"] != len(TcpCounts._fields):
    raise ImportError(f"bpf/{PROGRAM}.h counts {_C['COUNTS']} TCP counters; TcpCounts reads {len(TcpCounts._fields)}")

CheckRow = tuple[str, bool, str]
ConnectionCallback = Callable[[Connection], None]

EVENT_FIELDS = (
    "sock_id",
    "syn_ns",
    "established_ns",
    "closed_ns",
    "bytes_sent",
    "bytes_received",
    "retransmits",
    "pid",
    "tid",
    "family",
    "lport",
    "rport",
    "kind",
    "role",
    "laddr",
    "raddr",
    "comm",
)
"""The fields of bpf/conntrack.c's `struct conn` that an event is read for, in the struct's order."""
_UNSIGNED_CODES = {ctypes.c_uint8: "B", ctypes.c_uint16: "H", ctypes.c_uint32: "I", ctypes.c_uint64: "Q"}


def event_struct(leaf: Any) -> struct.Struct:
    """The struct.Struct that unpacks EVENT_FIELDS (and skips the rest) from an event, built from bcc's ctypes
    description of `struct conn` (`leaf`), so that the C struct stays the one definition of the layout."""
    fields = sorted((getattr(leaf, name).offset, name, kind) for name, kind in leaf._fields_ if name in EVENT_FIELDS)
    if tuple(name for _offset, name, _kind in fields) != EVENT_FIELDS:
        raise RuntimeError(f"bpf/{PROGRAM}.c's struct conn does not hold {EVENT_FIELDS} in this order")
    layout, end = "=", 0
    for offset, name, kind in fields:
        size = ctypes.sizeof(kind)
        code = f"{size}s" if issubclass(kind, ctypes.Array) else _UNSIGNED_CODES.get(kind)
        if code is None:
            raise RuntimeError(
                f"bpf/{PROGRAM}.c's struct conn field {name} is a {kind.__name__}, not an unsigned integer"
            )
        layout += f"{offset - end}x{code}" if offset > end else code
        end = offset + size
    return struct.Struct(layout)


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


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@lru_cache(maxsize=1)
def _boot_unix_s() -> float:
    with open("/proc/stat") as stat:
        return float(next(line.split()[1] for line in stat if line.startswith("btime ")))


def process_start_unix_s(pid: int) -> float | None:
    """When process `pid` started (epoch seconds), from /proc; None once it is gone.

    The kernel's own `task_struct` is off limits (its layout differs from the packaged headers), so the
    start time comes from user space."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return _boot_unix_s() + int(fields[19]) / _CLOCK_TICKS


class ConnectionTracer:
    """TCP connections of this host, client and server side, seen from tracepoints; open with `open()`.

    `poll()` delivers the kernel's events, in the order the kernel wrote them, as Connection records to
    `on_established` (client: after the handshake; server: when the process first reads or writes) and
    `on_closed` (with bytes, retransmits and the close time; only for a connection whose ESTABLISHED event was
    written). Times are epoch nanoseconds.
    """

    def __init__(self, bpf: Any, ports: frozenset[int], pids: frozenset[int]) -> None:
        """Configure the filters of the loaded program `bpf` and map its ring buffer; `open()` calls this."""
        self.on_established: ConnectionCallback | None = None
        self.on_closed: ConnectionCallback | None = None
        self.ports = ports
        self.pids = pids
        self.events_total = 0
        self._bpf = bpf
        self._clock = UnixClock()
        self._offset_ns = self._clock.offset_ns
        self._poll_lock = threading.Lock()
        self._closed = False
        self._drained_at = 0.0
        self._behind = False
        self._lost_at_close: int | None = None
        self._addresses: dict[tuple[int, bytes], str] = {}
        self._processes: dict[tuple[int, bytes], tuple[str, float | None]] = {}
        self._conns = bpf[b"conns"]
        self._event = event_struct(self._conns.Leaf)
        self._connect_calls = bpf[b"connect_calls"]
        self._lost_events = bpf[b"lost_events"]
        self._tcp_counts = bpf[b"tcp_counts"]
        self._fill(bpf[b"ports"], ports)
        self._fill(bpf[b"pids"], pids)
        match_all = bpf[b"match_all"]
        match_all[match_all.Key(_C["FILTER_PORTS"])] = match_all.Leaf(0 if ports else 1)
        match_all[match_all.Key(_C["FILTER_PIDS"])] = match_all.Leaf(0 if pids else 1)
        events = bpf[b"events"]
        self._ring = RingReader(events.map_fd, events.max_entries)

    @classmethod
    def open(
        cls, ports: Iterable[int] = (), pids: Iterable[int] = (), *, page_cnt: int = DEFAULT_PAGE_CNT
    ) -> tuple[ConnectionTracer | None, str]:
        """The attached tracer and what it traces, or None and one line saying why not and how to fix it.

        `ports`: trace only connections with one of these local or remote ports; `pids`: only these
        processes; empty means all. `page_cnt`: ring buffer pages (one buffer for all CPUs), a power of two.
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
            bpf = bcc.BPF(text=program_text(PROGRAM).encode(), cflags=[*_cflags(), f"-DPRISM_EVENT_PAGES={page_cnt}"])
        except Exception as exc:  # bcc raises a bare Exception when compiling, creating maps or attaching fails
            return None, f"loading {PROGRAM}.c failed ({_first_line(exc)}); make setup links kernel headers that match"
        try:
            tracer = cls(bpf, port_set, pid_set)
        except Exception as exc:  # bcc's map updates raise bare Exceptions; mmap raises OSError
            bpf.cleanup()
            return None, f"setting up {PROGRAM}.c's maps failed ({_first_line(exc)})"
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

    @property
    def lost_events(self) -> int:
        """Events the ring buffer had no room for, since the program was attached (until it was closed)."""
        if self._lost_at_close is not None:
            return self._lost_at_close
        return int(self._lost_events.sum(self._lost_events.Key(0)).value)

    def _address_text(self, family: int, raw: bytes) -> str:
        if len(self._addresses) >= NAMES_MAX:
            self._addresses.clear()
        text = self._addresses[family, raw] = socket.inet_ntop(family, raw[:4] if family == socket.AF_INET else raw)
        return text

    def _process(self, pid: int, comm: bytes) -> tuple[str, float | None]:
        """(thread name, process start) of an event's process, read once per (pid, name): with the name in the key
        a recycled pid is read again."""
        if len(self._processes) >= NAMES_MAX:
            self._processes.clear()
        name = comm.partition(b"\0")[0].decode(errors="replace")
        process = self._processes[pid, comm] = (name, process_start_unix_s(pid))
        return process

    def _decode(self, buffer: mmap.mmap, offset: int) -> tuple[bool, Connection]:
        """One event from the ring buffer: (whether it is an ESTABLISHED one, its Connection)."""
        (
            sock_id,
            syn_ns,
            established_ns,
            closed_ns,
            bytes_sent,
            bytes_received,
            retransmits,
            pid,
            tid,
            family,
            lport,
            rport,
            kind,
            role,
            laddr,
            raddr,
            comm_raw,
        ) = self._event.unpack_from(buffer, offset)
        addresses = self._addresses
        local = addresses.get((family, laddr)) or self._address_text(family, laddr)
        remote = addresses.get((family, raddr)) or self._address_text(family, raddr)
        if pid:
            comm, started = self._processes.get((pid, comm_raw)) or self._process(pid, comm_raw)
        else:
            comm = started = None
        established = kind == _ESTABLISHED
        offset_ns = self._offset_ns
        return established, Connection(
            sock_id,
            _ROLES[role],
            local,
            lport,
            remote,
            rport,
            established_ns + offset_ns,
            pid or None,
            tid or None,
            comm,
            started,
            (established_ns - syn_ns) / 1000 if syn_ns else None,
            None if established else closed_ns + offset_ns,
            bytes_sent,
            bytes_received,
            retransmits,
        )

    def poll(self, timeout_ms: int = 100) -> int:
        """Wait up to `timeout_ms` for events, hand them (MAX_BATCH at most) to the callbacks and return how many
        there were.

        Unless the previous call left events behind, waits (within the timeout) until BATCH_S after it took its
        events, so that events arriving close together are taken in one pass."""
        with self._poll_lock:
            if self._closed:
                return 0
            now = time.monotonic()
            deadline = now + max(timeout_ms, 0) / 1000
            pause_s = min(self._drained_at + BATCH_S, deadline) - now
            if pause_s > 0 and not self._behind:
                time.sleep(pause_s)
            if not self._ring.ready():
                left_s = deadline - time.monotonic()
                if left_s > 0:
                    self._ring.wait(left_s)
            self._clock.refresh_if_due()
            self._offset_ns = self._clock.offset_ns
            batch = self._ring.drain(self._decode, MAX_BATCH)
            self._drained_at = time.monotonic()
            self._behind = len(batch) == MAX_BATCH
        self.events_total += len(batch)
        on_established, on_closed = self.on_established, self.on_closed
        for established, connection in batch:
            callback = on_established if established else on_closed
            if callback is not None:
                callback(connection)
        return len(batch)

    def live_entries(self, ports: Collection[int] | None = None, pid: int | None = None) -> int:
        """Connections the kernel tracks now (entries in the `conns` map). With `ports` and `pid`, only those of
        process `pid`, or not yet tied to any process (a server's before its first send or receive) whose local or
        remote port is one of `ports`: a leak check's view of its own connections on a host where other processes
        keep theirs open, connect where nothing answers (SYN_SENT for minutes) or reuse the check's freed ports."""
        if ports is None or pid is None:
            return len(self._conns)
        wanted = set(ports)
        return sum(
            1
            for state in self._conns.values()
            if state.pid == pid or (state.pid == 0 and {state.lport, state.rport} & wanted)
        )

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
                self._lost_at_close = self.lost_events
                self._ring.close()
                self._bpf.cleanup()

    def __enter__(self) -> ConnectionTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
