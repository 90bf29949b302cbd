"""Soak: two brains, simulated agents and routers on loopback under a schedule of faults, for a set time.

Run: .venv/bin/python bench/soak.py [--duration-s 120] [--nodes 6] [--routers 3] [--plaintext]

Real `prism brain` processes (brain-a and brain-b, equal priority: brain-b leads while it lives), simulated
agents pushing real node vectors to both, real routers (`Router.connect` to both brains) probing `route()`
every 2 ms. CURVE is on unless `--plaintext`: the brains share a key pair, each node has its key (and an
`.endpoints` list) in the agents' folder, each router its key in the routers' folder. The fault schedule
repeats every 12 steps of 4 s (at least 48 s):

| step | fault |
|---|---|
| 0 | kill -9 the leading brain (brain-b); restarted 4 s later |
| 2 | poison over a hostile node's own key (bounds, NaN, +10 h sample, other endpoint, other id); junk |
| 3 | a router's key pushing a vector; admin abuse: Content-Length -1, foreign Host, Origin, no token |
| 4 | partition: every agent cut off from brain-a for 8 s |
| 6 | kill -9 brain-a; restarted 4 s later |
| 8 | every agent silent for 8 s (the brains drop every node as stale: routers keep their table, `drop_hold_s` 15 s) |
| 10 | junk on the snapshot sockets |

Printed: routes attempted and failed; the longest a router routed on the table of a brain it had not heard
from (a dead leader's, until it went over to the other brain: at most `brain_timeout_s`, 3 s); tables
published; brain restarts planned and unplanned (a brain that exited without being killed); rejects by kind
on the brains and routers; poison accepted (a table naming an endpoint or node no honest agent reported).
Goal: 0 failed routes, 0 unplanned exits, 0 poison accepted; the exit status is 0 when the goal is met.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import zmq

from prismlb.router import Router
from prismlb.service import wait_until
from prismlb.sim._live import Agents, Keys, LiveBrain, Routes, nodes_of, poison, samples, vector
from prismlb.wire import encode

POLL_S = 0.05
"""How often a condition is asked: several ask a brain's /metrics over HTTP, which a tighter loop would load."""

STEP_S = 4.0


def intrude(ctx: zmq.Context, ingest: str, keys: Keys | None) -> None:
    """A router's key used to push a vector (it may only subscribe): CURVE refuses it at the handshake."""
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    if keys is not None:
        keys.router(0).apply(sock)
    sock.connect(ingest)
    with contextlib.suppress(zmq.Again):
        sock.send_multipart(encode(vector("router-0", 1)), flags=zmq.NOBLOCK)
    time.sleep(0.2)
    sock.close()


def admin_abuse(port: int) -> None:
    """Requests the admin API must refuse, each on its own connection."""
    attempts = [
        ("POST", "/v1/nodes/n0/drain", {"Content-Length": "-1"}),
        ("GET", "/v1/status", {"Host": "evil.example:80"}),
        ("POST", "/v1/nodes/n0/drain", {"Origin": "http://evil.example", "Content-Length": "0"}),
        ("POST", "/v1/nodes/n0/drain", {"Content-Length": "0"}),
    ]
    for method, path, headers in attempts:
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.putrequest(method, path, skip_host="Host" in headers)
            for name, value in headers.items():
                conn.putheader(name, value)
            conn.endheaders()
            conn.getresponse().read()
            conn.close()


def junk_snapshots(address: str) -> None:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1) as sock:
        sock.sendall(b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--routers", type=int, default=3)
    parser.add_argument("--plaintext", action="store_true", help="run without CURVE (keys, roles, endpoint lists)")
    args = parser.parse_args()
    honest = [f"n{i}" for i in range(args.nodes)]
    root = Path(tempfile.mkdtemp(prefix="prism-soak-"))
    keys = None if args.plaintext else Keys.create(root / "keys", honest, args.routers)
    extra = [] if keys is None else keys.brain_args()
    brains = [LiveBrain(name, root, holddown_s=10.0, extra=extra) for name in ("brain-a", "brain-b")]
    for brain in brains:
        brain.start()
    ctx = zmq.Context()
    agents = Agents(ctx, [b.ingest for b in brains], honest, keys=keys, raw_as=honest[1])
    routers = [
        Router.connect([b.address for b in brains], curve=None if keys is None else keys.router(i))
        for i in range(args.routers)
    ]
    planned = Counter[str]()
    unplanned = Counter[str]()
    published: dict[tuple[str, int], float] = {}
    rejects: dict[tuple[str, int], Counter[str]] = {}
    poison_seen: set[str] = set()
    try:
        if not all(wait_until(lambda r=r: nodes_of(r) == set(honest), 60.0, POLL_S) for r in routers):
            print("the routers never got a full table; see the logs in", root, file=sys.stderr)
            return 1
        probes = [Routes(r) for r in routers]
        started = time.monotonic()
        step = 0
        restart_at: dict[str, float] = {}
        while time.monotonic() - started < args.duration_s:
            phase = step % 12
            by_name = {b.name: b for b in brains}
            if phase in (0, 6):
                victim = by_name["brain-b" if phase == 0 else "brain-a"]
                scrape(victim, published, rejects)
                victim.kill()
                planned[victim.name] += 1
                restart_at[victim.name] = time.monotonic() + STEP_S
            elif phase == 2:
                agents.inject(poison(honest[1], identity=keys is not None))
            elif phase == 3:
                for brain in brains:
                    intrude(ctx, brain.ingest, keys)
                    admin_abuse(brain.admin_port)
            elif phase == 4:
                agents.cut = {0}
            elif phase == 8:
                agents.paused.set()
            elif phase == 10:
                for brain in brains:
                    junk_snapshots(brain.address.snapshot)
            deadline = time.monotonic() + STEP_S
            while time.monotonic() < deadline:
                for name, when in list(restart_at.items()):
                    if time.monotonic() >= when:
                        by_name[name].start()
                        del restart_at[name]
                for brain in brains:
                    if brain.name not in restart_at and not brain.alive():
                        unplanned[brain.name] += 1
                        brain.start()
                    scrape(brain, published, rejects)
                for router in routers:
                    table = router.table
                    for node in [] if table is None else [n for s in table.slices for n in s.nodes]:
                        if node.node_id not in honest or node.endpoint != f"http://{node.node_id}:8000":
                            poison_seen.add(f"{node.node_id} {node.endpoint}")
                time.sleep(0.5)
            if phase == 5:
                agents.cut = set()
            if phase == 9:
                agents.paused.clear()
            step += 1
        for name, _ in list(restart_at.items()):
            by_name[name].start()
        for probe in probes:
            probe.close()
        report(probes, routers, brains, planned, unplanned, published, rejects, poison_seen, time.monotonic() - started)
        failed = sum(len(p.failed) for p in probes)
        return 0 if failed == 0 and not unplanned and not poison_seen else 1
    finally:
        for router in routers:
            router.close()
        agents.close()
        ctx.destroy(linger=0)
        for brain in brains:
            brain.stop()


def scrape(
    brain: LiveBrain, published: dict[tuple[str, int], float], rejects: dict[tuple[str, int], Counter[str]]
) -> None:
    """Keep the latest counters of this run of the brain (they start again at every restart)."""
    text = brain.metrics()
    if text is None:
        return
    key = (brain.name, brain.starts)
    published[key] = sum(samples(text, "prism_brain_tables_published_total").values())
    counts: Counter[str] = Counter()
    for labels, value in samples(text, "prism_rejected_messages_total").items():
        label = dict(labels)
        counts[f"{label.get('receiver')}:{label.get('kind')}"] += int(value)
    for labels, value in samples(text, "prism_brain_curve_refused_total").items():
        counts[f"curve:{dict(labels).get('domain')}"] += int(value)
    rejects[key] = counts


def report(
    probes: list[Routes],
    routers: list[Router],
    brains: list[LiveBrain],
    planned: Counter[str],
    unplanned: Counter[str],
    published: dict[tuple[str, int], float],
    rejects: dict[tuple[str, int], Counter[str]],
    poison_seen: set[str],
    elapsed_s: float,
) -> None:
    total: Counter[str] = Counter()
    for counts in rejects.values():
        total.update(counts)
    for router in routers:
        total.update({f"router:{k}": v for k, v in router.rejects.counts().items()})
    rows = [
        ("run", f"{elapsed_s:.0f} s, {len(brains)} brains, {len(routers)} routers"),
        ("routes attempted", f"{sum(p.attempted for p in probes):,}"),
        ("routes failed", f"{sum(len(p.failed) for p in probes):,}"),
        ("max stale-table age", f"{max(p.max_stale_s for p in probes):.1f} s (the followed brain unheard)"),
        ("tables published", f"{sum(published.values()):,.0f}"),
        ("brain restarts", f"{sum(planned.values())} planned (kill -9), {sum(unplanned.values())} unplanned exits"),
        ("poison accepted", f"{len(poison_seen)}" + (f" ({', '.join(sorted(poison_seen))})" if poison_seen else "")),
    ]
    rows += [(f"rejects {kind}", f"{count:,}") for kind, count in sorted(total.items())]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name.ljust(width)} | {value}")


if __name__ == "__main__":
    sys.exit(main())
