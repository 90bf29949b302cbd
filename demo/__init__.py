"""`prism demo`: a whole Prism cluster on loopback, loaded by a replayed trace, watched live.

Processes (`_processes`): one brain (`prism brain`), per node an emulated engine (`python -m prismlb.demo._engine`,
an `EmulatedEngine` of a GPU class) and its agent (`prism agent`: scrapes the engine's `/metrics`, subscribes to
its KV events, receives its OTLP spans, eBPF when this host allows it). In the demo's own process: a router
(`Router.connect`) behind the httpx transport, and a load generator (`_load`) that replays the first requests
of the Mooncake conversation trace (`_workload`), time-compressed, as streamed OpenAI chat completions, with a
live view and a closing summary (`_view`).

Every engine admits requests into its batch through the adaptive batch window (`--batch-window`; a fixed window
or none to compare with); the view and the summary show what each engine's window and breaker did, read from the
engine's own `/metrics` (`_window`).

Half-way through one node (engine and agent) is killed with SIGKILL: the brain drops it after three missed
periods, and the demo counts which of the prefix keys seen so far moved (`_results`). Every child is stopped on
exit, on Ctrl-C and on SIGTERM (and gets SIGTERM from the kernel if the demo process dies).

The benches reuse the parts: the cluster and the load generator to run other routers on the same engines and
requests, the process helpers to start and stop their own children.
"""

from ._cli import add_parser
from ._load import DRAIN_LIMIT_S, Demo
from ._processes import (
    Cluster,
    die_with_parent,
    free_port,
    log_tails,
    metric,
    signals_interrupt,
    spawn,
    stop,
    wait_healthy,
)
from ._results import UNFINISHED, llm_nodes, moved_keys
from ._run import DEFAULT_LOAD, DEFAULT_NODES, TIME_SCALE_RANGE
from ._view import percentile
from ._window import BATCH_WINDOWS, DEFAULT_BATCH_WINDOW, WindowReport, read_window
from ._workload import BLOCK_CHARS, TOKEN_SCALE, TRACE, DemoRequest, load_requests, prefill_work_s, prefix_cache_bound

__all__ = [
    "BATCH_WINDOWS",
    "BLOCK_CHARS",
    "DEFAULT_BATCH_WINDOW",
    "DEFAULT_LOAD",
    "DEFAULT_NODES",
    "DRAIN_LIMIT_S",
    "TIME_SCALE_RANGE",
    "TOKEN_SCALE",
    "TRACE",
    "UNFINISHED",
    "WindowReport",
    "Cluster",
    "Demo",
    "DemoRequest",
    "add_parser",
    "die_with_parent",
    "free_port",
    "llm_nodes",
    "load_requests",
    "log_tails",
    "metric",
    "moved_keys",
    "percentile",
    "prefill_work_s",
    "prefix_cache_bound",
    "read_window",
    "signals_interrupt",
    "spawn",
    "stop",
    "wait_healthy",
]
