"""One emulated engine per process: `python -m prismlb.demo._engine --gpu ...` serves one `EmulatedEngine`
until SIGTERM or SIGINT. The demo's cluster starts one per node, so that a node can be killed as a machine is."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from prismlb.sim import PROFILES, EmulatedEngine


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m prismlb.demo._engine")
    parser.add_argument("--gpu", choices=sorted(PROFILES), default="a100")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kv-events")
    parser.add_argument("--otlp")
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    engine = EmulatedEngine(
        args.gpu, port=args.port, kv_events_endpoint=args.kv_events, time_scale=args.time_scale, otlp_endpoint=args.otlp
    )
    engine.start()
    print(f"emulated {args.gpu} engine on {engine.url} (time_scale {args.time_scale:g})", flush=True)
    stopped.wait()
    engine.close()
    print("emulated engine stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
