"""The kernel connection tracer for real (bpf/conntrack.c through bcc): loopback over IPv4 and IPv6, two network
namespaces over veth, handshake accuracy against an nftables-dropped SYN, map leaks, filters, lost events.
Skipped only without root or bcc."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from prismlb.agent import Connection, ConnectionTracer
from prismlb.agent._clock import UnixClock, measure_offset_ns

from ._netns import Namespace, veth_pair
from .conftest import require_ebpf, wait_for

pytestmark = pytest.mark.ebpf

FourTuple = tuple[str, int, str, int]


@dataclass
class _Seen:
    """What the callbacks received, by (role, 4-tuple)."""

    established: dict[tuple[str, FourTuple], list[Connection]] = field(default_factory=dict)
    closed: dict[tuple[str, FourTuple], list[Connection]] = field(default_factory=dict)

    def on_established(self, conn: Connection) -> None:
        self.established.setdefault((conn.role, conn.four_tuple), []).append(conn)

    def on_closed(self, conn: Connection) -> None:
        self.closed.setdefault((conn.role, conn.four_tuple), []).append(conn)

    def one(self, kind: str, role: str, four_tuple: FourTuple, timeout_s: float = 5.0) -> Connection:
        """The single event of `kind` for this connection, waiting for it."""
        seen = self.established if kind == "established" else self.closed
        key = (role, four_tuple)
        assert wait_for(lambda: key in seen, timeout_s), f"no {kind} event for {role} {four_tuple}"
        events = seen[key]
        assert len(events) == 1, events
        return events[0]

    def roles_for_port(self, port: int) -> set[str]:
        keys = [*self.established, *self.closed]
        return {role for role, (_la, lport, _ra, rport) in keys if port in (lport, rport)}


@contextmanager
def _polled(tracer: ConnectionTracer) -> Iterator[_Seen]:
    """Poll `tracer` from a background thread into a _Seen until the block ends, then close it."""
    seen = _Seen()
    tracer.on_established = seen.on_established
    tracer.on_closed = seen.on_closed
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            tracer.poll(20)

    poller = threading.Thread(target=loop, name="poll", daemon=True)
    poller.start()
    try:
        yield seen
    finally:
        stop.set()
        poller.join()
        tracer.close()


def _open(ports: tuple[int, ...] = (), pids: tuple[int, ...] = (), page_cnt: int = 64) -> ConnectionTracer:
    tracer, detail = ConnectionTracer.open(ports, pids, page_cnt=page_cnt)
    assert tracer is not None, detail
    return tracer


def _tuple(sock: socket.socket) -> FourTuple:
    local, remote = sock.getsockname(), sock.getpeername()
    return (local[0], local[1], remote[0], remote[1])


def _reverse(four_tuple: FourTuple) -> FourTuple:
    local_addr, local_port, remote_addr, remote_port = four_tuple
    return (remote_addr, remote_port, local_addr, local_port)


def _comm(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


class _EchoDouble:
    """A server thread: for each connection reads until EOF, answers twice as many bytes, closes."""

    def __init__(self, listener: socket.socket, count: int) -> None:
        self.listener = listener
        self.count = count
        self.tid = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.tid = threading.get_native_id()
        try:
            for _ in range(self.count):
                conn, _peer = self.listener.accept()
                with conn:
                    received = _read_to_eof(conn)
                    conn.sendall(b"r" * (2 * len(received)))
        except BaseException as exc:  # reported by join(), in the test's thread
            self.error = exc

    def join(self) -> None:
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "server thread stuck"
        if self.error is not None:
            raise self.error


def _read_to_eof(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _exchange(sock: socket.socket, size: int) -> int:
    """Send `size` bytes, half-close, read the answer to EOF; its length."""
    sock.sendall(b"q" * size)
    sock.shutdown(socket.SHUT_WR)
    return len(_read_to_eof(sock))


def _check_connections(seen: _Seen, clients: list[tuple[FourTuple, int, int, int]], server: _EchoDouble) -> None:
    """Each client (4-tuple, size sent, connect start/end epoch ns) has its client and server events, exact."""
    pid, tid = os.getpid(), threading.get_native_id()
    for four_tuple, size, started_ns, connected_ns in clients:
        client = seen.one("established", "client", four_tuple)
        assert (client.pid, client.tid, client.comm) == (pid, tid, _comm(tid))
        assert client.process_start_unix_s == pytest.approx(psutil.Process().create_time(), abs=0.05)
        assert client.handshake_us is not None and client.handshake_us > 0
        assert client.handshake_us <= (connected_ns - started_ns) / 1000
        assert started_ns - 1_000_000 <= client.established_unix_ns <= connected_ns + 1_000_000
        client_closed = seen.one("closed", "client", four_tuple)
        assert (client_closed.bytes_sent, client_closed.bytes_received) == (size, 2 * size)
        assert (client_closed.pid, client_closed.sock_id) == (pid, client.sock_id)
        assert client_closed.closed_unix_ns is not None
        assert client.established_unix_ns <= client_closed.closed_unix_ns <= time.time_ns()

        server_side = _reverse(four_tuple)
        accepted = seen.one("established", "server", server_side)
        assert (accepted.pid, accepted.tid, accepted.handshake_us) == (pid, server.tid, None)
        # The server's time is its handshake's end (not the later first read): on loopback it follows the
        # client's within the same softirq chain; 50 ms leaves room for a loaded CI machine.
        assert abs(accepted.established_unix_ns - client.established_unix_ns) < 50_000_000
        server_closed = seen.one("closed", "server", server_side)
        assert (server_closed.bytes_sent, server_closed.bytes_received) == (2 * size, size)
        assert server_closed.pid == pid


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_loopback_connections_are_seen_from_both_ends(host: str) -> None:
    require_ebpf()
    count = 200
    with socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as listener:
        tracer = _open()
        with _polled(tracer) as seen:
            server = _EchoDouble(listener, count)
            clients = []
            for i in range(count):
                size = 1 + 37 * i
                started_ns = time.time_ns()
                with socket.create_connection(listener.getsockname()[:2], timeout=5) as sock:
                    connected_ns = time.time_ns()
                    four_tuple = _tuple(sock)
                    assert _exchange(sock, size) == 2 * size
                clients.append((four_tuple, size, started_ns, connected_ns))
            server.join()
            _check_connections(seen, clients, server)
    assert tracer.lost_events == 0
    assert tracer.events_total >= 4 * count


def test_connections_between_namespaces_carry_their_veth_addresses() -> None:
    require_ebpf()
    count = 20
    with veth_pair() as (a, b):
        with b.entered():
            listener = socket.create_server((b.address, 0))
        with listener, _polled(_open()) as seen:
            server = _EchoDouble(listener, count)
            clients = []
            for i in range(count):
                size = 1000 + i
                started_ns = time.time_ns()
                with a.call(socket.create_connection, listener.getsockname(), 5) as sock:
                    connected_ns = time.time_ns()
                    four_tuple = _tuple(sock)
                    assert _exchange(sock, size) == 2 * size
                assert (four_tuple[0], four_tuple[2:]) == (a.address, listener.getsockname())
                clients.append((four_tuple, size, started_ns, connected_ns))
            server.join()
            _check_connections(seen, clients, server)


_DROP_FIRST_SYN = """
table inet prism_first_syn {{
    chain input {{
        type filter hook input priority 0; policy accept;
        tcp dport {port} tcp flags & (syn | ack) == syn quota until 100 bytes counter drop
    }}
}}
"""


@contextmanager
def _client_cpu_apart(server: Namespace) -> Iterator[None]:
    """With two CPUs or more: pin this thread to one and steer the server namespace's packets (RPS) to another.

    Over veth, the server's side of the handshake runs in the same softirq as the client's, on the CPU that
    happens to process the packets, after ESTABLISHED and before the client's thread can run again there;
    a real server is elsewhere. Moving the server's side to another CPU measures the client alone."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        yield
        return
    server.run(["sh", "-c", f"echo {1 << cpus[1]:x} > /sys/class/net/veth0/queues/rx-0/rps_cpus"])
    os.sched_setaffinity(0, {cpus[0]})  # 0: the calling thread
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


def _timed_connect(sock: socket.socket, address: tuple[str, int]) -> float:
    """connect() as the client measures it, in µs: from the call until the socket is writable, spinning so
    that no wake-up latency of a sleeping thread is added."""
    sock.setblocking(False)
    started = time.perf_counter()
    assert sock.connect_ex(address) == errno.EINPROGRESS
    while not select.select([], [sock], [], 0)[1]:
        pass
    elapsed_us = (time.perf_counter() - started) * 1e6
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    return elapsed_us


TOLERANCE_US = 1000.0
"""How far the client's own handshake time may be from the kernel's: 0.1% of the 1 s the dropped SYN costs."""


def _measure_dropped_syn_handshake() -> tuple[float, Connection, Connection]:
    """One connect whose first SYN nftables drops: (client's own µs, kernel's established and closed records)."""
    with veth_pair() as (a, b):
        with b.entered():
            listener = socket.create_server((b.address, 0))
        port = listener.getsockname()[1]
        b.run(["nft", "-f", "-"], stdin=_DROP_FIRST_SYN.format(port=port))
        tracer = _open(ports=(port,))
        with listener, a.call(socket.socket) as sock, _client_cpu_apart(b):
            client_us = _timed_connect(sock, (b.address, port))
            four_tuple = _tuple(sock)
        with _polled(tracer) as seen:
            kernel = seen.one("established", "client", four_tuple)
            closed = seen.one("closed", "client", four_tuple)
        assert "packets 1 " in b.run(["nft", "list", "ruleset"])
    return client_us, kernel, closed


def test_handshake_time_matches_the_clients_own_with_a_dropped_syn() -> None:
    """nftables in namespace b drops the first SYN (60 bytes) to the port; the retransmission after the 1 s
    initial RTO gets through. The kernel's handshake time must match what the client measured itself.
    Nothing polls while the client measures: a poller thread waking on the event would hold the GIL. The
    client's own clock is the noisy one (it can be descheduled on a busy machine), so up to three tries, each
    within `TOLERANCE_US`: on the shared 2-core machine one run's three tries were all 320-580 µs over the kernel's
    figure, while one read from a wrong field would be off by seconds (or be 0)."""
    require_ebpf()
    differences = []
    for _ in range(3):
        client_us, kernel, closed = _measure_dropped_syn_handshake()
        assert kernel.handshake_us is not None
        assert kernel.handshake_us >= 900_000, "the first SYN was not dropped"
        assert closed.retransmits >= 1
        differences.append(client_us - kernel.handshake_us)
        print(
            f"handshake: kernel {kernel.handshake_us:.1f} us, client {client_us:.1f} us, diff {differences[-1]:.1f} us"
        )
        if abs(differences[-1]) <= TOLERANCE_US:
            break
    assert min(abs(d) for d in differences) <= TOLERANCE_US, differences


def test_stats_reads_a_live_connection() -> None:
    require_ebpf()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        tracer = _open(ports=(port,))
        with _polled(tracer) as seen, socket.create_connection(("127.0.0.1", port)) as sock:
            peer, _ = listener.accept()
            with peer:
                sock.sendall(b"x" * 123)
                assert len(peer.recv(1000)) == 123
                client = seen.one("established", "client", _tuple(sock))
                server = seen.one("established", "server", _reverse(_tuple(sock)))
                ports = (client.local_port, client.remote_port)
                assert tracer.stats(client.sock_id, *ports) == (123, 0, 0)
                assert tracer.stats(server.sock_id, server.local_port, server.remote_port) == (0, 123, 0)
                assert tracer.stats(client.sock_id ^ 1, *ports) is None
                assert (
                    tracer.stats(client.sock_id, client.local_port, client.remote_port + 1) is None
                )  # a newer connection
        assert seen.one("closed", "client", client.four_tuple).sock_id == client.sock_id


def _linger_reset(sock: socket.socket) -> None:
    """Make close() send a RST instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _ShortServer:
    """Accepts until closed; reads one byte per connection: b"n" closes normally, b"r" resets."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=512)
        self._thread = threading.Thread(target=self._serve, name="short-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _peer = self.listener.accept()
            except OSError:
                return  # listener closed
            with conn:
                if conn.recv(1) == b"r":
                    _linger_reset(conn)

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(timeout=10)


def _short_connection(address: tuple[str, int], kind: bytes) -> None:
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(kind)
        try:
            sock.recv(1)
        except ConnectionResetError:
            assert kind == b"r"


def test_no_map_entries_leak_after_ten_thousand_connections() -> None:
    """Normal closes, resets by the peer, refused connects, connects abandoned in SYN_SENT and connections
    never accepted: afterwards the map holds what it held before."""
    require_ebpf()
    tracer = _open()
    try:
        server = _ShortServer()
        address = server.listener.getsockname()
        with socket.socket() as unused, socket.socket() as unaccepting:
            unused.bind(("127.0.0.1", 0))  # a port nobody listens on: connects are refused
            refused = unused.getsockname()
            unaccepting.bind(("127.0.0.1", 0))
            # Other processes on the host may open connections meanwhile, or take these ports once freed: count ours.
            ours = (address[1], refused[1], unaccepting.getsockname()[1])
            mine = functools.partial(tracer.live_entries, ours, os.getpid())
            baseline = mine()
            total = 0
            for i in range(9_600):
                if i % 10 == 0:
                    with pytest.raises(ConnectionRefusedError), socket.create_connection(refused, timeout=5):
                        pass
                else:
                    _short_connection(address, b"r" if i % 10 < 3 else b"n")
                total += 1
            held = [socket.create_connection(address, timeout=5) for _ in range(50)]
            assert mine() >= baseline + 100, "open connections are not in the map"
            for sock in held:
                sock.close()
            total += len(held) + _syn_sent_and_unaccepted(unaccepting, 350)
        server.close()
        assert total == 10_000
        assert wait_for(lambda: mine() <= baseline), (mine(), baseline)
    finally:
        tracer.close()


def _listen_overflows() -> int:
    """SYNs this network namespace's kernel dropped because a listener's accept queue was full (TcpExt
    ListenOverflows): one more for each SYN the listener in `_syn_sent_and_unaccepted` turns away."""
    with open("/proc/net/netstat") as netstat:
        names, values = (line.split() for line in netstat if line.startswith("TcpExt:"))
    return int(values[names.index("ListenOverflows")])


def _syn_sent_and_unaccepted(listener: socket.socket, count: int) -> int:
    """`count` connections to `listener` (bound, not listening), which never accepts: the first fills its queue
    (backlog 0) and is never accepted, the rest stay in SYN_SENT (their SYNs dropped) until closed. Returns
    `count`; the listener is closed."""
    with listener:
        listener.listen(0)
        queued = socket.create_connection(listener.getsockname(), timeout=5)
        overflows = _listen_overflows()
        pending = []
        for _ in range(count - 1):
            sock = socket.socket()
            sock.setblocking(False)
            assert sock.connect_ex(listener.getsockname()) == errno.EINPROGRESS
            pending.append(sock)
        wait_for(lambda: _listen_overflows() - overflows >= count - 1, what="the kernel to drop every pending SYN")
        for sock in pending:
            with pytest.raises(OSError):
                sock.getpeername()  # not connected: still in SYN_SENT
            sock.close()
        queued.close()
    return count


def _connect_from_child(address: tuple[str, int]) -> None:
    code = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).sendall(b'c')"
    subprocess.run([sys.executable, "-c", code, address[0], str(address[1])], check=True, timeout=30)


def test_port_filter_keeps_only_the_chosen_port() -> None:
    require_ebpf()
    with socket.create_server(("127.0.0.1", 0)) as wanted, socket.create_server(("127.0.0.1", 0)) as other:
        wanted_port, other_port = wanted.getsockname()[1], other.getsockname()[1]
        with _polled(_open(ports=(wanted_port,))) as seen:
            # The last connection to the wanted port marks the end: the tracer's ring buffer keeps the kernel's
            # order, so once its closes are read, any event of an earlier connection to the other port would be too.
            for listener in (other, wanted, other, wanted):
                with socket.create_connection(listener.getsockname(), timeout=5) as sock:
                    peer, _ = listener.accept()
                    with peer:
                        sock.sendall(b"x")
                        peer.recv(1)
            assert wait_for(lambda: len(seen.closed) >= 4), seen.closed
        assert seen.roles_for_port(wanted_port) == {"client", "server"}
        assert seen.roles_for_port(other_port) == set()
        assert all(wanted_port in key[1] for key in [*seen.established, *seen.closed])


def test_pid_filter_keeps_only_the_chosen_processes() -> None:
    """With pids={ours}: our own client is seen; a child's connection only from our (server) end."""
    require_ebpf()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = listener.getsockname()
        with _polled(_open(pids=(os.getpid(),))) as seen:
            child = threading.Thread(target=_connect_from_child, args=(address,))
            child.start()
            from_child, _ = listener.accept()
            with from_child:
                assert from_child.recv(1) == b"c"
                child.join()
                child_tuple = _reverse(_tuple(from_child))
            with socket.create_connection(address, timeout=5) as ours:
                peer, _ = listener.accept()
                with peer:
                    ours.sendall(b"o")
                    peer.recv(1)
                ours_tuple = _tuple(ours)
            seen.one("closed", "client", ours_tuple)
            seen.one("closed", "server", _reverse(ours_tuple))
            seen.one("closed", "server", _reverse(child_tuple))
        assert ("client", child_tuple) not in seen.established
        assert ("client", child_tuple) not in seen.closed
        assert {conn.pid for conns in seen.established.values() for conn in conns} == {os.getpid()}


def test_lost_events_are_counted_and_tracing_goes_on() -> None:
    """A one-page ring buffer, not polled while 1,500 connections come and go, overflows; every event is either
    delivered or counted as lost, and tracing goes on."""
    require_ebpf()
    count = 1_500
    with socket.create_server(("127.0.0.1", 0), backlog=512) as listener:
        port = listener.getsockname()[1]
        tracer = _open(ports=(port,), page_cnt=1)
        for _ in range(count):
            with socket.create_connection(listener.getsockname(), timeout=5):
                pass
            listener.accept()[0].close()
        while tracer.poll(10):  # drain the full buffer
            pass
        assert tracer.lost_events > 0
        with _polled(tracer) as seen:
            with socket.create_connection(listener.getsockname(), timeout=5) as sock:
                listener.accept()[0].close()
                four_tuple = _tuple(sock)
            seen.one("established", "client", four_tuple)
            seen.one("closed", "client", four_tuple)
            # per connection: the client's ESTABLISHED and CLOSED; the server's side was never read or written
            expected = 2 * (count + 1)
            assert wait_for(lambda: tracer.events_total + tracer.lost_events == expected), (
                tracer.events_total,
                tracer.lost_events,
                expected,
            )
        assert ("server", _reverse(four_tuple)) not in seen.closed


def test_a_server_connection_never_read_or_written_is_counted_without_events() -> None:
    """Accepted and closed at once: the server's side carried nothing a span could join to, so it sends no event,
    yet it counts as opened and ended like the client's side (which has both its events)."""
    require_ebpf()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        tracer = _open(ports=(listener.getsockname()[1],))
        before = tracer.tcp_counts()
        with _polled(tracer) as seen:
            with socket.create_connection(listener.getsockname(), timeout=5) as sock:
                listener.accept()[0].close()
                assert sock.recv(1) == b""
                four_tuple = _tuple(sock)
            assert seen.one("closed", "client", four_tuple).bytes_received == 0
            assert wait_for(lambda: tracer.tcp_counts().ended - before.ended == 2), tracer.tcp_counts()
            assert tracer.tcp_counts().opened - before.opened == 2
        assert seen.roles_for_port(listener.getsockname()[1]) == {"client"}
        assert tracer.events_total == 2 and tracer.lost_events == 0


class _Conn(ctypes.Structure):
    """`struct conn` as bcc describes it (its `conns` leaf), for the layout the loader derives from it."""

    _fields_ = [
        ("sock_id", ctypes.c_ulong),
        ("syn_ns", ctypes.c_ulong),
        ("established_ns", ctypes.c_ulong),
        ("closed_ns", ctypes.c_ulong),
        ("bytes_sent", ctypes.c_ulong),
        ("bytes_received", ctypes.c_ulong),
        ("announced", ctypes.c_ulong),
        ("retransmits", ctypes.c_uint),
        ("pid", ctypes.c_uint),
        ("tid", ctypes.c_uint),
        ("family", ctypes.c_ushort),
        ("lport", ctypes.c_ushort),
        ("rport", ctypes.c_ushort),
        ("kind", ctypes.c_ubyte),
        ("role", ctypes.c_ubyte),
        ("traced", ctypes.c_ubyte),
        ("laddr", ctypes.c_ubyte * 16),
        ("raddr", ctypes.c_ubyte * 16),
        ("comm", ctypes.c_char * 16),
        ("__pad_end", ctypes.c_char * 3),
    ]


def test_event_layout_follows_the_c_struct() -> None:
    """Every field an event is read for comes out of the struct's bytes, those it is not read for are skipped;
    a struct whose fields moved or became signed is refused, not misread."""
    from prismlb.agent._conntrack import EVENT_FIELDS, event_struct

    event = _Conn(sock_id=2**64 - 1, syn_ns=11, established_ns=12, closed_ns=13, bytes_sent=14, bytes_received=15)
    event.announced, event.retransmits, event.pid, event.tid = 1, 16, 17, 18
    event.family, event.lport, event.rport, event.kind, event.role, event.traced = 10, 19, 20, 2, 1, 1
    event.laddr[:] = range(16)
    event.raddr[:] = range(16, 32)
    event.comm = b"worker"
    values = dict(zip(EVENT_FIELDS, event_struct(_Conn).unpack_from(bytes(event)), strict=True))
    assert values == {
        **{name: getattr(event, name) for name in EVENT_FIELDS if name not in ("laddr", "raddr", "comm")},
        "laddr": bytes(range(16)),
        "raddr": bytes(range(16, 32)),
        "comm": b"worker".ljust(16, b"\0"),
    }

    class Moved(ctypes.Structure):
        _fields_ = [(name, kind) for name, kind in reversed(_Conn._fields_)]

    class Signed(ctypes.Structure):
        _fields_ = [(name, ctypes.c_int if name == "pid" else kind) for name, kind in _Conn._fields_]

    with pytest.raises(RuntimeError, match="in this order"):
        event_struct(Moved)
    with pytest.raises(RuntimeError, match="pid is a c_int"):
        event_struct(Signed)


def test_open_without_root_says_run_as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    tracer, detail = ConnectionTracer.open()
    assert tracer is None
    assert "run as root" in detail and "\n" not in detail


@pytest.mark.parametrize(
    ("ports", "pids", "page_cnt"), [((0,), (), 64), ((70_000,), (), 64), ((), (0,), 64), ((), (), 3)]
)
def test_open_rejects_bad_arguments(ports: tuple[int, ...], pids: tuple[int, ...], page_cnt: int) -> None:
    with pytest.raises(ValueError):
        ConnectionTracer.open(ports, pids, page_cnt=page_cnt)


def test_kernel_time_maps_to_epoch_time() -> None:
    clock = UnixClock(refresh_s=0.0)
    for _ in range(3):
        clock.refresh_if_due()
        assert abs(clock.to_unix_ns(time.monotonic_ns()) - time.time_ns()) < 1_000_000
    assert abs(measure_offset_ns() - clock.offset_ns) < 1_000_000


def test_kernel_and_loader_read_their_constants_from_one_header() -> None:
    """bpf/conntrack.h is the one place the event kinds, roles, filters, counter indices and map sizes are written:
    the program bcc compiles has it inlined (no include left for bcc to resolve), and the loader's counters follow
    its indices rather than their own order."""
    from prismlb.agent import _conntrack
    from prismlb.agent._network import TcpCounts
    from prismlb.bpf import constants, program_text

    header = constants("conntrack")
    text = program_text("conntrack")
    assert '#include "conntrack.h"' not in text
    assert "#define COUNT_RETRANSMITS" in text and "FILTER_ENTRIES)" in text
    assert header["COUNTS"] == len(TcpCounts._fields)
    assert _conntrack.MAX_FILTER_ENTRIES == header["FILTER_ENTRIES"]
    assert [_conntrack._COUNT_INDEX[i] for i, _ in enumerate(TcpCounts._fields)] == [
        header[f"COUNT_{name.upper()}"] for name in TcpCounts._fields
    ]
