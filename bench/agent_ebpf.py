"""The node agent's kernel path under loopback connection load, against bcc's own tcplife and tcpconnlat.

Run: .venv/bin/python bench/agent_ebpf.py            (under a minute; root, bcc, cc, bpfcc-tools)
     .venv/bin/python bench/agent_ebpf.py --quick    (one low rate, a short load: what the test runs)

The load: a C program compiled here with `cc` (Python cannot open 20,000 connections a second on 2 cores), a
listener on 127.0.0.1 and `--threads` client threads that open connections at `--rates` a second, each for
`--duration` seconds, open loop at fixed intervals (a thread that falls behind catches up at once; a rate of 0
goes as fast as it can). Each connection: connect(), wait for the server's close (the server accepts and closes
at once, so that the client's ports never wait in TIME_WAIT), close(). Each load run is its own process on a new
listener port, so that every tracer's records of it are told apart by (client pid, server port).

The tracers, each attached alone, one after the other, under the same rates:
  prism agent        the agent's eBPF path in a process of its own: `probe_ebpf` (bpf/conntrack.c on its
                     tracepoints, tracing every connection as the agent does by default), the ring-buffer polling
                     thread of `TracePath` feeding the span-join index and the TCP health window, and the
                     per-period read of the counters (`connect_calls_total`, `tcp_*`) once a second. Seen: the
                     client connections of the load whose ESTABLISHED event arrived (counted by a wrapper around
                     the tracer's callback). Lost: the tracer's `lost_events` (ring buffer overruns).
  tcplife-bpfcc      bcc's tool, one line per closed socket; seen: the lines of the load's client sockets. Lost:
                     bcc's "Possibly lost N samples" on its stderr.
  tcpconnlat-bpfcc   bcc's tool, one line per connect; kprobes, which some kernels lack: then it does not attach and
                     its rows say why.
The bcc tools run under the system Python with their output line-buffered into a file, as on a terminal. Each
tracer runs in a session of its own (its own scheduling autogroup, as a systemd service has a cgroup of its own),
and first idle for `--duration`: a tracer of every connection on the host also reads the host's other traffic.
Per window: connections/s offered (completed connections over the load's seconds), the connections the tracer saw,
the events it lost, and its CPU (user + system of its whole process, from the load's start until it has taken in
the load's events, over the load's seconds) as a percentage of one core, also per 1,000 connections/s. A first
row runs the load with no tracer, for what the machine offers without one. Every process is stopped and every
file removed on every exit path; each load is bounded by its duration and 2 s socket timeouts.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from prismlb.demo import die_with_parent as _die_with_parent
from prismlb.demo import signals_interrupt, spawn, stop

RATES = (2000.0, 10000.0, 20000.0, 0.0)
QUICK_RATES = (1000.0,)
DURATION_S = 3.0
QUICK_DURATION_S = 1.0
THREADS = 16
STARTUP_LIMIT_S = 120.0
"""A tracer's start: bcc compiles its program with clang first (seconds; tens on a busy machine)."""
DRAIN_LIMIT_S = 10.0
STEADY_S = 1.0
"""A tracer has taken in a load's events once its count and CPU time stand still this long: on a shared machine a
runnable tracer can wait on the run queue for most of a second, its backlog still in its buffer."""
REPLY_LIMIT_S = 10.0
LOAD_MARGIN_S = 30.0
SYSTEM_PYTHON = "/usr/bin/python3"
GOAL_RATE = 20_000
GOAL_CORE_PCT = 5.0
GOAL_CORE_RATE = 2000.0
AGENT = "prism agent"

LOAD_SOURCE = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static struct sockaddr_in target;
static double rate, duration_s;
static long threads;
static struct timespec start;
static atomic_long completed, failed;
static int listener;

static double since_start(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - start.tv_sec) + (now.tv_nsec - start.tv_nsec) / 1e9;
}

static void *acceptor(void *unused) {
    (void)unused;
    for (;;) {
        int fd = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (fd >= 0) {
            close(fd);
        } else if (errno != EINTR && errno != ECONNABORTED && errno != EMFILE && errno != ENFILE) {
            return NULL;
        }
    }
}

static void *client(void *arg) {
    long index = (long)arg;
    struct timeval limit = {2, 0};
    char byte;
    for (long k = 0;; k++) {
        double due = rate > 0 ? (k * threads + index) / rate : 0;
        if (due >= duration_s || since_start() >= duration_s) {
            return NULL;
        }
        if (rate > 0) {
            struct timespec at = start;
            at.tv_sec += (time_t)due;
            at.tv_nsec += (long)((due - (time_t)due) * 1e9);
            if (at.tv_nsec >= 1000000000L) {
                at.tv_sec += 1;
                at.tv_nsec -= 1000000000L;
            }
            while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, NULL) == EINTR) {
            }
        }
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            atomic_fetch_add(&failed, 1);
            continue;
        }
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
        if (connect(fd, (struct sockaddr *)&target, sizeof target) == 0 && read(fd, &byte, 1) == 0) {
            atomic_fetch_add(&completed, 1);
        } else {
            atomic_fetch_add(&failed, 1);
        }
        close(fd);
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s RATE DURATION_S THREADS\n", argv[0]);
        return 2;
    }
    rate = atof(argv[1]);
    duration_s = atof(argv[2]);
    threads = atol(argv[3]);
    if (rate < 0 || duration_s <= 0 || threads < 1 || threads > 256) {
        fprintf(stderr, "rate >= 0, duration > 0 and 1..256 threads\n");
        return 2;
    }
    target.sin_family = AF_INET;
    target.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof target;
    listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listener < 0 || bind(listener, (struct sockaddr *)&target, sizeof target) || listen(listener, 4096) ||
        getsockname(listener, (struct sockaddr *)&target, &size)) {
        perror("listen on 127.0.0.1");
        return 1;
    }
    pthread_t acceptors[2], clients[256];
    for (int i = 0; i < 2; i++) {
        pthread_create(&acceptors[i], NULL, acceptor, NULL);
    }
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long i = 0; i < threads; i++) {
        pthread_create(&clients[i], NULL, client, (void *)i);
    }
    for (long i = 0; i < threads; i++) {
        pthread_join(clients[i], NULL);
    }
    printf("%d %ld %ld %.6f\n", ntohs(target.sin_port), atomic_load(&completed), atomic_load(&failed), since_start());
    return 0;
}
"""

_AGENT = """
import sys
import threading
from collections import Counter

from prometheus_client import CollectorRegistry

from prismlb.agent import AgentConfig, probe_ebpf
from prismlb.agent._signals import SpanSignals
from prismlb.agent._sources import _ebpf
from prismlb.agent._tracing import TracePath

counter, detail = probe_ebpf()
if counter is None:
    print("failed", detail, flush=True)
    sys.exit(1)
tracer = counter.tracer
path = TracePath(AgentConfig(otlp_grpc_port=0, otlp_http_port=0), tracer, SpanSignals(), CollectorRegistry(),
                 counter.network)
path.start()
seen = Counter()
forward = tracer.on_established


def established(connection):
    if connection.role == "client":
        seen[connection.pid, connection.remote_port] += 1
    forward(connection)


tracer.on_established = established
stopped = threading.Event()


def sample():
    while not stopped.wait(1.0):
        _ebpf(counter)


threading.Thread(target=sample, daemon=True).start()
print("ready", detail, flush=True)
for line in sys.stdin:
    pid, port = map(int, line.split())
    print(seen[pid, port], tracer.lost_events, flush=True)
stopped.set()
path.close()
counter.close()
"""

_BCC_TOOL = """
import runpy, sys
sys.stdout.reconfigure(line_buffering=True, write_through=False)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def missing() -> str | None:
    """Why this machine cannot run the bench (root, bcc, tracefs, a C compiler), or None."""
    if os.geteuid() != 0:
        return f"eBPF needs root; running as uid {os.geteuid()}"
    try:
        import bcc  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"bcc is not importable ({exc}); apt-get install python3-bpfcc"
    if not os.path.exists("/sys/kernel/tracing/events/syscalls/sys_enter_connect"):
        return "tracefs is not mounted (make setup mounts it as root)"
    if shutil.which("cc") is None:
        return "no C compiler for the load generator; apt-get install gcc"
    return None


def build_load(workdir: Path) -> Path:
    """The load generator, compiled into `workdir`."""
    source, binary = workdir / "connload.c", workdir / "connload"
    source.write_text(LOAD_SOURCE)
    subprocess.run(["cc", "-O2", "-pthread", "-o", str(binary), str(source)], check=True, timeout=120)
    return binary


@dataclass(frozen=True)
class Load:
    """One run of the load generator: its process, its listener's port, what it completed."""

    rate: float
    """Connections a second asked for; 0: as fast as it goes."""
    pid: int
    port: int
    completed: int
    failed: int
    elapsed_s: float

    @property
    def offered_per_s(self) -> float:
        return self.completed / self.elapsed_s


def offer(binary: Path, rate: float, duration_s: float, threads: int) -> Load:
    """Run the load generator once, to its end (bounded by its duration and its sockets' timeouts)."""
    with subprocess.Popen(
        [str(binary), repr(rate), repr(duration_s), str(threads)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=duration_s + LOAD_MARGIN_S)
        except BaseException:
            proc.kill()
            raise
    if proc.returncode != 0:
        raise RuntimeError(f"load generator exited {proc.returncode}: {err.decode(errors='replace').strip()}")
    port, completed, failed, elapsed = out.split()
    return Load(rate, proc.pid, int(port), int(completed), int(failed), float(elapsed))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


class Tracer(Protocol):
    name: str
    pid: int

    def read(self, pid: int, port: int) -> tuple[int, int]:
        """(client connections of process `pid` to `port` seen so far, events lost since the tracer started)."""
        ...


class _Lines:
    """A child's stdout, one line at a time, each waited for at most REPLY_LIMIT_S."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._fd = proc.stdout.fileno()
        self._pending = b""

    def readline(self) -> str:
        deadline = time.monotonic() + REPLY_LIMIT_S
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                raise TimeoutError(f"no line within {REPLY_LIMIT_S:g} s")
            chunk = os.read(self._fd, 4096)
            if not chunk:
                raise EOFError("the process closed its output")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode(errors="replace")


class AgentTracer:
    """The agent's eBPF path in a child process, asked for its counts over its stdin."""

    name = AGENT

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._lines = _Lines(proc)

    @classmethod
    @contextlib.contextmanager
    def started(cls, log: Path) -> Iterator[AgentTracer | str]:
        """The attached tracer, or why it did not attach; stopped on the way out."""
        with log.open("wb") as errors:
            proc = subprocess.Popen(
                [sys.executable, "-c", _AGENT],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        try:
            tracer = cls(proc)
            try:
                first = tracer._lines.readline() if _wait_readable(proc, STARTUP_LIMIT_S) else ""
            except EOFError:
                first = ""
            if first.startswith("ready"):
                yield tracer
            else:
                yield first.removeprefix("failed ") or f"did not start: {_tail(log)}"
        finally:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            stop([proc])

    def read(self, pid: int, port: int) -> tuple[int, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{pid} {port}\n".encode())
        self.proc.stdin.flush()
        seen, lost = self._lines.readline().split()
        return int(seen), int(lost)


def _wait_readable(proc: subprocess.Popen[bytes], limit_s: float) -> bool:
    assert proc.stdout is not None
    return bool(select.select([proc.stdout.fileno()], [], [], limit_s)[0])


def _tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


class BccTool:
    """One of bcc's tools in a child process, its output (stdout and stderr) in a file read as it grows.

    `port_field`: where the server's port is in an output line, counted from its end (its command name may hold
    spaces); the first field is the pid."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log: Path, port_field: int) -> None:
        self.name = name
        self.proc = proc
        self.pid = proc.pid
        self._file = log.open("rb")
        self._port_field = port_field
        self._pending = b""
        self._seen: Counter[tuple[int, int]] = Counter()
        self._lost = 0
        self.header = False
        self.problem = ""

    @classmethod
    @contextlib.contextmanager
    def started(cls, name: str, port_field: int, log: Path) -> Iterator[BccTool | str]:
        """The attached tool, or why it did not attach; stopped on the way out."""
        path = shutil.which(name)
        if path is None:
            yield "not installed: apt-get install bpfcc-tools (make setup)"
            return
        proc = spawn(["-c", _BCC_TOOL, path], log, executable=SYSTEM_PYTHON)
        tool = cls(name, proc, log, port_field)
        try:
            deadline = time.monotonic() + STARTUP_LIMIT_S
            while not tool.header and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
                tool._take()
            tool._take()
            if tool.header and proc.poll() is None:
                yield tool
            else:
                yield f"did not attach: {tool.problem or _tail(log)}"
        finally:
            stop([proc])
            tool._file.close()

    def _take(self) -> None:
        self._pending += self._file.read()
        *lines, self._pending = self._pending.split(b"\n")
        for raw in lines:
            fields = raw.decode(errors="replace").split()
            if not fields:
                continue
            if fields[0] == "PID":
                self.header = True
            elif fields[:2] == ["Possibly", "lost"] and fields[2].isdigit():
                self._lost += int(fields[2])
            elif fields[0].isdigit() and len(fields) >= 1 - self._port_field and fields[self._port_field].isdigit():
                self._seen[int(fields[0]), int(fields[self._port_field])] += 1
            elif fields[0] in ("Exception:", "Traceback"):
                self.problem = " ".join(fields)

    def read(self, pid: int, port: int) -> tuple[int, int]:
        self._take()
        return self._seen[pid, port], self._lost


@dataclass(frozen=True)
class Phase:
    """One tracer over one window: under a load, or idle (`load` None); a tracer that did not attach has only
    `problem`."""

    tracer: str
    label: str
    """The rate asked for, "max", or "idle"."""
    elapsed_s: float = 0.0
    load: Load | None = None
    seen: int | None = None
    """The load's connections the tracer reported."""
    lost: int | None = None
    """Events the tracer said it lost over the window."""
    cpu_s: float | None = None
    """The tracer's CPU seconds over the window."""
    problem: str | None = None

    @property
    def seen_ratio(self) -> float | None:
        if self.load is None or self.seen is None or not self.load.completed:
            return None
        return self.seen / self.load.completed

    @property
    def core_pct(self) -> float | None:
        """The tracer's CPU over the window's seconds, in % of one core."""
        if self.cpu_s is None or self.elapsed_s <= 0:
            return None
        return 100.0 * self.cpu_s / self.elapsed_s

    @property
    def core_pct_per_1k(self) -> float | None:
        """% of a core per 1,000 connections a second offered."""
        pct = self.core_pct
        if pct is None or self.load is None or not self.load.completed:
            return None
        return pct / (self.load.offered_per_s / 1000)


def label(rate: float) -> str:
    return "max" if rate == 0 else f"{rate:,.0f}"


def drain(tracer: Tracer, load: Load) -> tuple[int, int]:
    """The tracer's (seen, lost) once it has taken in the load's events: both unchanged for STEADY_S (its CPU time
    is no sign: a tracer of every connection on the host also reads the host's other traffic), or DRAIN_LIMIT_S
    after the load's end."""
    deadline = time.monotonic() + DRAIN_LIMIT_S
    last = tracer.read(load.pid, load.port)
    since = time.monotonic()
    while time.monotonic() - since < STEADY_S and time.monotonic() < deadline:
        time.sleep(0.05)
        state = tracer.read(load.pid, load.port)
        if state != last:
            last, since = state, time.monotonic()
    return last


def measure(tracer: Tracer, binary: Path, rates: Sequence[float], duration_s: float, threads: int) -> list[Phase]:
    """The tracer idle for `duration_s` (the host's other traffic only), then under each rate in turn."""
    lost_before, cpu_before = tracer.read(0, 0)[1], cpu_s(tracer.pid)
    time.sleep(duration_s)
    lost = tracer.read(0, 0)[1]
    phases = [Phase(tracer.name, "idle", duration_s, lost=lost - lost_before, cpu_s=cpu_s(tracer.pid) - cpu_before)]
    for rate in rates:
        lost_before, cpu_before = lost, cpu_s(tracer.pid)
        load = offer(binary, rate, duration_s, threads)
        seen, lost = drain(tracer, load)
        cpu = cpu_s(tracer.pid) - cpu_before
        phases.append(Phase(tracer.name, label(rate), load.elapsed_s, load, seen, lost - lost_before, cpu))
    return phases


BCC_TOOLS = (("tcplife-bpfcc", -4), ("tcpconnlat-bpfcc", -2))
"""bcc's tools and where the server's port is in their lines, from the end: tcplife's RPORT, tcpconnlat's DPORT."""


def run(rates: Sequence[float], duration_s: float, threads: int) -> list[Phase]:
    """The load alone at its fastest, then each tracer alone, idle and under every rate."""
    with tempfile.TemporaryDirectory(prefix="prism-agent-ebpf-") as tmp, signals_interrupt():
        workdir = Path(tmp)
        binary = build_load(workdir)
        alone = offer(binary, 0.0, duration_s, threads)
        phases = [Phase("none (load alone)", "max", alone.elapsed_s, alone)]
        with AgentTracer.started(workdir / "agent.log") as agent:
            if isinstance(agent, str):
                phases.append(Phase(AGENT, "-", problem=agent))
            else:
                phases += measure(agent, binary, rates, duration_s, threads)
        for name, port_field in BCC_TOOLS:
            with BccTool.started(name, port_field, workdir / f"{name}.log") as tool:
                if isinstance(tool, str):
                    phases.append(Phase(name, "-", problem=tool))
                else:
                    phases += measure(tool, binary, rates, duration_s, threads)
        return phases


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(phases: Sequence[Phase]) -> list[str]:
    """Markdown rows: one per tracer and window."""
    rows = [
        "| tracer | rate asked (conn/s) | offered (conn/s) | connections | seen by tracer | seen % | lost events "
        "| tracer CPU (% of a core) | CPU per 1k conn/s (% of a core) |",
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in phases:
        if p.problem is not None:
            rows.append(f"| {p.tracer} | {p.problem} | | | | | | | |")
            continue
        ratio = p.seen_ratio
        offered = _num(p.load.offered_per_s, ",.0f") if p.load is not None else "0"
        completed = f"{p.load.completed:,}" if p.load is not None else "0"
        rows.append(
            f"| {p.tracer} | {p.label} | {offered} | {completed} | {_num(p.seen, ',')} "
            f"| {_num(None if ratio is None else 100 * ratio, '.1f')} | {_num(p.lost, ',')} "
            f"| {_num(p.core_pct, '.1f')} | {_num(p.core_pct_per_1k, '.2f')} |"
        )
    return rows


def ratios(phases: Sequence[Phase]) -> list[str]:
    """Markdown rows: per rate, the agent's CPU (also per 1k conn/s) and share seen over each bcc tool's; one row
    for a tool that did not attach."""
    agent = {p.label: p for p in phases if p.tracer == AGENT and p.load is not None}
    rows = [
        "| rate asked (conn/s) | baseline | agent / baseline CPU | agent / baseline CPU per 1k conn/s "
        "| agent / baseline seen % |",
        "| :--- | :--- | ---: | ---: | ---: |",
    ]
    for name, _field in BCC_TOOLS:
        tool = {p.label: p for p in phases if p.tracer == name}
        problem = next((p.problem for p in tool.values() if p.problem is not None), None)
        if problem is not None:
            rows.append(f"| all | {name} | n/a: {problem.partition(':')[0]} | n/a | n/a |")
            continue
        for key, mine in agent.items():
            theirs = tool.get(key)
            if theirs is None:
                rows.append(f"| {key} | {name} | n/a: not run | n/a | n/a |")
                continue
            cpu = _quotient(mine.core_pct, theirs.core_pct)
            per_1k = _quotient(mine.core_pct_per_1k, theirs.core_pct_per_1k)
            seen = _quotient(mine.seen_ratio, theirs.seen_ratio)
            rows.append(f"| {key} | {name} | {_num(cpu, '.2f')} | {_num(per_1k, '.2f')} | {_num(seen, '.2f')} |")
    return rows


def _quotient(mine: float | None, theirs: float | None) -> float | None:
    return mine / theirs if mine is not None and theirs else None


def goals(phases: Sequence[Phase]) -> list[str]:
    """The agent against its goals: 20,000 connections/s with nothing lost, 5% of a core at 2,000/s."""
    loaded = [(p, p.load) for p in phases if p.tracer == AGENT and p.load is not None]
    best = max((load.offered_per_s for p, load in loaded if p.lost == 0 and p.seen == load.completed), default=None)
    met = best is not None and best >= GOAL_RATE
    lines = [
        f"goal >= {GOAL_RATE:,} conn/s with 0 lost: {'met' if met else 'not met'} (highest offered rate with every "
        f"connection seen and 0 lost: {_num(best, ',.0f')} conn/s)"
    ]
    low = next((p for p, _load in loaded if p.label == label(GOAL_CORE_RATE)), None)
    goal = f"goal <= {GOAL_CORE_PCT:g}% of a core at {GOAL_CORE_RATE:,.0f} conn/s"
    if low is None or low.core_pct is None:
        lines.append(f"{goal}: not measured in this run")
    else:
        lines.append(f"{goal}: {'met' if low.core_pct <= GOAL_CORE_PCT else 'not met'} ({low.core_pct:.1f}%)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", help=f"connections/s, 0 = max (default: {RATES})")
    parser.add_argument("--duration", type=float, help=f"seconds of load per rate (default: {DURATION_S:g})")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"client threads (default: {THREADS})")
    parser.add_argument("--quick", action="store_true", help=f"rates {QUICK_RATES}, {QUICK_DURATION_S:g} s each")
    args = parser.parse_args(argv)
    if not 1 <= args.threads <= 256:
        parser.error("--threads must be 1 to 256")
    rates = args.rates or (QUICK_RATES if args.quick else RATES)
    duration_s = args.duration or (QUICK_DURATION_S if args.quick else DURATION_S)
    if any(rate < 0 or not math.isfinite(rate) for rate in rates) or not 0 < duration_s <= 60:
        parser.error("rates must be >= 0 and the duration 0 to 60 s")
    why = missing()
    if why is not None:
        print(f"agent_ebpf: cannot run: {why}", file=sys.stderr)
        return 2
    started, load_before = time.monotonic(), os.getloadavg()[0]
    try:
        phases = run(rates, duration_s, args.threads)
    except KeyboardInterrupt:
        print("agent_ebpf: interrupted; every process stopped", file=sys.stderr)
        return 130
    print(
        f"kernel {os.uname().release}, {os.cpu_count()} cores, load average {load_before:.1f} before and "
        f"{os.getloadavg()[0]:.1f} after; {args.threads} client threads, {duration_s:g} s a window"
    )
    print("\n".join(table(phases)))
    print()
    print("\n".join(ratios(phases)))
    print()
    print("\n".join(goals(phases)))
    print(f"\n{time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
