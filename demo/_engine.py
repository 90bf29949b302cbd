"""One emulated engine per process: `python -m prismlb.demo._engine --gpu ...` serves one `EmulatedEngine`
until SIGTERM or SIGINT. The demo's cluster starts one per node, so that a node can be killed as a machine is;
`bench/batch_window_live.py` starts one per batching window (`--batch-window`), `bench/version_switch.py` engines of
two model versions sharing a session snapshot directory (`--model-version`, `--snapshot-dir`)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from prismlb.otel import BatchWindowSettings, DirectorySnapshotStore
from prismlb.sim import PROFILES, EmulatedEngine
from prismlb.wire import ConfigError

_WINDOW_DEFAULTS = BatchWindowSettings()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m prismlb.demo._engine")
    parser.add_argument("--gpu", choices=sorted(PROFILES), default="a100")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kv-events")
    parser.add_argument("--otlp")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument(
        "--batch-window",
        choices=("off", "fixed", "adaptive"),
        default="off",
        help="admit requests as they arrive (off, the default), after a fixed window, or through the adaptive window",
    )
    parser.add_argument(
        "--batch-window-max",
        type=float,
        default=_WINDOW_DEFAULTS.max_window_s,
        help="the fixed window, or the adaptive window's maximum and start, in model seconds "
        f"(default {_WINDOW_DEFAULTS.max_window_s:g})",
    )
    parser.add_argument(
        "--batch-window-target",
        type=float,
        default=_WINDOW_DEFAULTS.p99_target_s,
        help="the adaptive window's P99 target for each request's wait before its prefill, in model seconds "
        f"(default {_WINDOW_DEFAULTS.p99_target_s:g})",
    )
    parser.add_argument(
        "--model-version",
        default="v1",
        help="the model version this engine serves (its answers' X-Emulated-Model-Version, its snapshots; default v1)",
    )
    parser.add_argument(
        "--snapshot-dir",
        help="a directory shared with the other version's engines for session snapshots: the engine writes one after "
        "each answer to a request with X-Session-Token and loads a moved session's context from it (default: none)",
    )
    args = parser.parse_args(argv)
    window: BatchWindowSettings | float | None = None
    try:
        if args.batch_window == "adaptive":
            window = BatchWindowSettings(p99_target_s=args.batch_window_target, max_window_s=args.batch_window_max)
        elif args.batch_window == "fixed":
            window = args.batch_window_max
        engine = EmulatedEngine(
            args.gpu,
            port=args.port,
            kv_events_endpoint=args.kv_events,
            time_scale=args.time_scale,
            otlp_endpoint=args.otlp,
            batch_window=window,
            model_version=args.model_version,
            snapshots=DirectorySnapshotStore(args.snapshot_dir) if args.snapshot_dir else None,
        )
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    engine.start()
    scale, window_name = f"{args.time_scale:g}", args.batch_window
    snapshots = f"snapshots in {args.snapshot_dir}" if args.snapshot_dir else "no snapshots"
    print(
        f"emulated {args.gpu} engine on {engine.url} (model {args.model_version}, time_scale {scale}, batch window "
        f"{window_name}, {snapshots})",
        flush=True,
    )
    stopped.wait()
    engine.close()
    print("emulated engine stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
