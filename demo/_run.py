"""The demo from start to end: size the load, start the cluster, wait for a routing table with every node,
replay through an in-process router, stop every child (on exit, on Ctrl-C and on SIGTERM), print the summary.

Arrivals are compressed so the replay lasts `duration_s`, and the engines' `time_scale` is set so that the
offered prefill work is `load` of the cluster's prefill capacity.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from prismlb.router import Router
from prismlb.sim import PROFILES

from ._load import Demo
from ._processes import Cluster, raise_interrupt
from ._results import llm_nodes
from ._view import HIDE_CURSOR, SHOW_CURSOR, summary
from ._window import DEFAULT_BATCH_WINDOW, engine_batch_window
from ._workload import load_requests, prefill_work_s

DEFAULT_NODES = ("h100", "a100", "a100", "l40s")
DEFAULT_REQUESTS = 1800
DEFAULT_DURATION_S = 60.0
DEFAULT_LOAD = 0.6
MAX_WALL_S = 115.0
"""Everything, set-up and tear-down included, ends within this (the demo's promise is two minutes)."""
STARTUP_LIMIT_S = 30.0
TIME_SCALE_RANGE = (0.25, 4.0)


@dataclass(frozen=True)
class Options:
    requests: int = DEFAULT_REQUESTS
    duration_s: float = DEFAULT_DURATION_S
    load: float = DEFAULT_LOAD
    gpus: tuple[str, ...] = DEFAULT_NODES
    kill: bool = True
    ebpf: bool = True
    cpus: int = 2
    live: bool | None = None
    keep_logs: bool = False
    batch_window: str = DEFAULT_BATCH_WINDOW
    """How every engine admits requests into its batch (`BATCH_WINDOWS`)."""


def _pin(cpus: int, out: IO[str]) -> None:
    if cpus <= 0 or not hasattr(os, "sched_setaffinity"):
        return
    available = sorted(os.sched_getaffinity(0))
    if len(available) > cpus:
        os.sched_setaffinity(0, available[:cpus])
        print(f"   pinned to CPUs {available[:cpus]} of {len(available)} (--cpus 0 to use all)", file=out)


def cluster_for(options: Options, time_scale: float, logs: Path) -> Cluster:
    """The demo's cluster for `options`, its engines at `time_scale`, logging into `logs` (not started)."""
    return Cluster(options.gpus, time_scale, logs, options.ebpf, options.batch_window)


def run(options: Options, out: IO[str] = sys.stdout) -> int:
    """The demo; returns the exit status (0 done, 1 a child failed or no table came, 2 bad input, 130 Ctrl-C)."""
    started = time.monotonic()
    deadline = started + MAX_WALL_S
    if not options.gpus:
        print("prism demo: --nodes names no GPU class", file=out)
        return 2
    for gpu in options.gpus:
        if gpu not in PROFILES:
            print(f"prism demo: unknown GPU class {gpu!r} (known: {', '.join(sorted(PROFILES))})", file=out)
            return 2
    try:
        engine_batch_window(options.batch_window)
        requests = load_requests(options.requests)
    except (OSError, ValueError) as exc:
        print(f"prism demo: {exc}", file=out)
        return 2
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("prism demo: the load generator needs httpx (pip install 'prism-lb[test]')", file=out)
        return 2
    work = prefill_work_s(requests, options.gpus)
    low, high = TIME_SCALE_RANGE
    time_scale = min(high, max(low, options.load * options.duration_s / work))
    offered = time_scale * work / options.duration_s  # the load asked for, unless time_scale hit its bounds
    live = out.isatty() if options.live is None else options.live
    logs = Path(tempfile.mkdtemp(prefix="prism-demo-"))
    cluster = cluster_for(options, time_scale, logs)
    victim = None
    if options.kill and len(cluster.nodes) > 1:
        same = [n for n in cluster.nodes if n.gpu == "a100"]
        victim = same[-1] if len(same) > 1 else cluster.nodes[-1]
    print(
        f"prism demo: brain + {len(cluster.nodes)} agents + {len(cluster.nodes)} emulated engines "
        f"({', '.join(options.gpus)}, batch window {options.batch_window}) + router on loopback; "
        f"{len(requests)} Mooncake requests in {options.duration_s:.0f} s; logs in {logs}",
        file=out,
        flush=True,
    )
    _pin(options.cpus, out)
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    status = 0
    demo: Demo | None = None
    try:
        cluster.start()
        print(
            f"   waiting for a routing table with all {len(cluster.nodes)} nodes "
            f"(watch the brain with: prism top --admin http://127.0.0.1:{cluster.admin_port})",
            file=out,
            flush=True,
        )
        with Router.connect(cluster.address) as router:  # the library's defaults, as a caller's router runs
            wanted = {n.node_id for n in cluster.nodes}
            ready_by = min(deadline, time.monotonic() + STARTUP_LIMIT_S)
            while {n.node_id for n in llm_nodes(router.table)} != wanted:
                failed = cluster.failed()
                if failed or time.monotonic() > ready_by:
                    print(f"prism demo: {failed or 'no routing table with every node in time'}", file=out)
                    print(cluster.log_tail(), file=out)
                    return 1
                time.sleep(0.1)
            print(f"   cluster up in {time.monotonic() - started:.1f} s; replaying", file=out, flush=True)
            demo = Demo(cluster, router, requests, options.duration_s, victim, out, live, deadline)
            demo.start = time.monotonic()
            try:
                asyncio.run(_main(demo))
            except RuntimeError as exc:
                print(f"prism demo: {exc}", file=out)
                print(cluster.log_tail(), file=out)
                status = 1
    except KeyboardInterrupt:
        print("\nprism demo: interrupted; stopping every process", file=out, flush=True)
        status = 130
    finally:
        cluster.close()
        signal.signal(signal.SIGTERM, previous)
        if live:
            out.write(SHOW_CURSOR)
    if demo is not None:
        for line in summary(demo, time.monotonic() - started, time_scale, offered):
            print(line, file=out)
    if status in (0, 130) and not options.keep_logs:
        shutil.rmtree(logs, ignore_errors=True)
    else:
        print(f"   logs kept in {logs}", file=out)
    out.flush()
    return status


async def _main(demo: Demo) -> None:
    if demo.view.live:
        demo.view.out.write(HIDE_CURSOR)
    await demo.run()
    await asyncio.sleep(1.0)  # the last spans: the engines export every 0.5 s, the agents join after 0.25 s
    await demo.collect_engines()
    await demo.collect_agents()
