"""Live bakeoff: Prism against the real SGLang gateway, vLLM router and Dynamo KV router, same cluster, same trace.

Run: .venv/bin/python bench/live_routers.py   (about 9 minutes a round; the first run also installs the peers, ~20 s)

The replay (`prism eval`, docs/results/) compares Prism with re-implementations of the other routers'
policies. This runs the routers themselves: their released wheels, pinned below, installed by this script
into their own virtualenv (`--venv`), so a claim against them rests on their code, not on a model of it.

For each contender a fresh cluster of emulated engines (`--nodes`, by default `make demo`'s four: h100, 2 × a100,
l40s; vLLM-format KV events over ZeroMQ, the same `time_scale`) is started with `prismlb.demo.Cluster`, and the
demo's load generator (`prismlb.demo.Demo`) sends the same requests at the same times: the first `--requests` of
each workload in `--traces` (by default the Mooncake conversation trace, whose turns share prefixes, and Azure's
conversation trace, whose prompts share nothing; any text workload `prism eval` names may be given, the families as
`NAME[:SEED]`, and trace files with `--trace`), time-compressed to `--duration` seconds, text only (the SGLang
gateway drops Prism's `X-Modality-Signature` header). Contenders:

- Prism: brain, one agent per engine (eBPF off) and the router in-process, as the demo runs them, with the
  library's default settings as every peer runs with its own (not the demo's 0.3 s slow first token, which
  opens a busy node's circuit under a burst of long prompts).
- The same router with `tokenize=None`: its transport keys each text request by its text blocks, where by default
  it asks an engine's `/tokenize` for the token ids.
- Prism as a gateway (`prism gateway`, its own process, the same brain and agents): the load generator sends to
  it as to a peer, so Prism pays the proxy hop every peer pays; the same with `--tokenize text` (the requests'
  text blocks, no round trip to an engine's `/tokenize` first); and the gateway given the engines' URLs alone
  (`--worker-url`), with no brain and no agents, as the peers are given them: what Prism's router does on its own
  placements and load, with each engine's prefill speed read from its `/metrics`, without the rest of the
  cluster's telemetry.
- Prism as four routers in the load generator (`ROUTERS`), requests dealt among them in turn, as routers
  embedded in four callers share one cluster: each reports its queued prefill, placements and waiting rooms' heads
  to the brain and counts its peers'; and the same four each keeping its own room's order
  (`Settings(share_turns=False)`).
- SGLang Model Gateway (`sglang-router`), policies `cache_aware` and `power_of_two`.
- vLLM router (`vllm-router`), `kv_aware` fed by the engines' KV events (`--kv-event-source`,
  `--kv-event-model`), and `cache_aware`.
- NVIDIA Dynamo (`ai-dynamo`): its frontend with `--router-mode kv`, the KV router on the engines' KV events. Dynamo
  routes to workers registered with its runtime (file discovery, TCP request plane, no etcd or NATS), so each engine
  gets a worker process, `bench/dynamo_worker.py`, that relays the engine's KV events and its answers; the model's
  tokenizer, written for the run (`dynamo_model_dir`), gives the engines' own token ids. That worker's hop is a
  cost a real Dynamo deployment (its engine inside the worker) does not pay.

Reported per contender: the share of requests whose TTFT met their SLO (`slo_ms`: `prism eval`'s rule, on the
engines' slowed clock; a request not answered misses it), TTFT p50/p99 (the load generator's clock, to the first
streamed chunk), the share of
prompt tokens the engines served from their prefix caches (`usage.prompt_tokens_details.cached_tokens`),
errors, requests not sent or unfinished at the time bound, each engine's share of the requests (from its
`/metrics`), and the replay's wall clock. With `--rounds N` every contender runs N times, a round of all after
another, and its row pools the N runs' requests (`pooled`), with each round's p99 beside them: one run's p99 is its
8th slowest request of 800, set largely by where the first seconds' uncached prompts land before any speed is
measured, and the same code's runs differ by up to 2× on eight engines. Then the replay (`prism eval`'s
simulation) runs each contender's model on the same requests, cluster and offered load, and a second table sets
live and replayed TTFT p99 and rank side by side, saying which pairs of contenders the two order differently. A
peer that cannot be installed or started is reported as such and the others still run. Every child process is
stopped on exit, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from prismlb.demo import (
    DEFAULT_LOAD,
    DEFAULT_NODES,
    DRAIN_LIMIT_S,
    TIME_SCALE_RANGE,
    UNFINISHED,
    Cluster,
    Demo,
    DemoRequest,
    free_port,
    llm_nodes,
    load_requests,
    metric,
    percentile,
    prefill_work_s,
    prefix_cache_bound,
    signals_interrupt,
    spawn,
    stop,
    wait_healthy,
)
from prismlb.router import AsyncPrismTransport, Router, Settings
from prismlb.semantics import Slice, ttft_slo_s
from prismlb.service import whole_number_at_least
from prismlb.sim import PROFILES
from prismlb.sim._engine import BLOCK_SIZE_TOKENS, CHARS_PER_TOKEN, MODEL_NAME, prompt_tokens

PINS = {"sglang-router": "0.3.2", "vllm-router": "0.1.17", "ai-dynamo": "1.6.1"}
"""The peers' wheels, pinned: the versions pip found current when this bakeoff was written."""
INSTALLS: dict[str, tuple[tuple[str, ...], ...]] = {
    "ai-dynamo": (
        ("--no-deps", f"ai-dynamo=={PINS['ai-dynamo']}", f"ai-dynamo-runtime=={PINS['ai-dynamo']}"),
        (
            "aiohttp>=3.14.3,<4",
            "msgspec>=0.19",
            "prometheus-client>=0.23.1,<1",
            "pyzmq>=26",
            "redis>=6.2,<9",
            "tqdm",
            "transformers>=4.56",
            "typing-extensions>=4.10",
            "zstandard>=0.23,<1",
            "kubernetes>=32.0.1,<33",
            "pydantic>=2.10.6,<=2.13.5",
            "uvloop>=0.21",
        ),
    ),
}
"""pip runs for a peer that its pin alone does not install. `ai-dynamo` requires `aisimulate`, a placeholder on PyPI
that downloads its wheel from pypi.nvidia.com while installing (unreachable from a host that has PyPI alone) and
that only Dynamo's planner and replay import: the two wheels go in without their requirements, then every other
requirement of theirs as their metadata pins it (the runtime's version is the frontend's, as `ai-dynamo` requires)."""
DEFAULT_VENV = Path.home() / ".cache" / "prism-bench" / "live-routers"
DEFAULT_REQUESTS = 800
DEFAULT_DURATION_S = 40.0
DEFAULT_TRACES = "mooncake,azure-conv"
INSTALL_LIMIT_S = 600.0
TIME_SCALE_MAX = 32.0
"""The slowest the engines may run (wall seconds per emulated second). The demo stops at 4; a trace of short
prompts (Azure's, shrunk 16 times) needs its engines about 23 times slower to be offered 60% of their prefill,
and a uniformly slower engine keeps its profile's ratio of prefill to decode."""
STARTUP_LIMIT_S = 30.0
"""A router, or Prism's first routing table with every node, must be up within this."""
ROUTERS = 4
"""Routers of the "routers" contenders, as the replay's `4-routers` ablation deals requests to."""
DYNAMO_WORKER = Path(__file__).with_name("dynamo_worker.py")
DYNAMO_STARTUP_LIMIT_S = 90.0
"""Dynamo's frontend and its four workers import Dynamo and transformers at once on the host's cores."""


class Dealt(httpx.AsyncBaseTransport):
    """Requests dealt in turn to several transports: callers in several processes, each with its own router."""

    def __init__(self, transports: Sequence[httpx.AsyncBaseTransport]) -> None:
        self._transports = transports
        self._next = itertools.count()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport = self._transports[next(self._next) % len(self._transports)]
        return await transport.handle_async_request(request)

    async def aclose(self) -> None:
        for transport in self._transports:
            await transport.aclose()


@dataclass(frozen=True)
class Contender:
    name: str
    package: str | None
    """The peer's wheel; None for Prism."""
    module: str = ""
    """The peer's module to run; for Prism, "gateway" runs `prism gateway` between the callers and the engines
    (a hop, as every peer is; the words after it are its flags), "gateway --worker-url" the same on the engines'
    URLs alone (no brain, no agents),
    "routers" `ROUTERS` routers inside the load generator ("routers --own-turns": with `share_turns` off),
    "text-blocks" one whose transport asks the engines for no token ids (`tokenize=None`), "" one."""
    policy: str = ""
    replay: str | None = None
    """The `prism eval` policy that models this contender, if any."""


CONTENDERS = (
    Contender("prism", None, policy="expected TTFT, prefix index", replay="prism"),
    Contender("prism", None, "text-blocks", "the same on text blocks, no engine /tokenize"),
    Contender("prism-gateway", None, "gateway", "expected TTFT, prefix index, as a proxy"),
    Contender("prism-gateway", None, "gateway --tokenize text", "the same on text blocks, no engine /tokenize"),
    Contender("prism-gateway", None, "gateway --worker-url", "the same on worker URLs, no brain or agents"),
    Contender("prism-routers", None, "routers", "four in the callers, one order over their rooms", "4-routers"),
    Contender(
        "prism-routers", None, "routers --own-turns", "the same, each its own room's order", "4-routers-own-turns"
    ),
    Contender("sglang", "sglang-router", "sglang_router.launch_router", "cache_aware", "sglang"),
    Contender("sglang", "sglang-router", "sglang_router.launch_router", "power_of_two"),
    Contender("vllm", "vllm-router", "vllm_router.launch_router", "kv_aware", "vllm-kv-aware"),
    Contender("vllm", "vllm-router", "vllm_router.launch_router", "cache_aware", "sglang"),
    Contender("dynamo", "ai-dynamo", "dynamo.frontend", "kv", "dynamo-kv"),
)
"""The vLLM router began as a fork of SGLang's; its `cache_aware` is the same approximate-tree policy, so the
replay's `sglang` model stands for both. `power_of_two` has no replay model."""


@dataclass
class Outcome:
    contender: Contender
    version: str = ""
    problem: str | None = None
    """Why it did not run (install or start-up), else None."""
    answered: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    """Requests not sent, or unfinished, at the time bound."""
    within_slo: int = 0
    """Requests answered with their first token within their SLO (`slo_ms`)."""
    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    shares: dict[str, float] = field(default_factory=dict)
    wall_s: float | None = None
    round_p99_ms: list[float] = field(default_factory=list)
    """Each round's TTFT p99, in the order run, when `--rounds` ran the contender more than once."""


def pooled(runs: Sequence[Outcome]) -> Outcome:
    """One contender's rounds as one outcome: every round's requests counted together (the TTFT percentiles over
    all of them), each engine's share the rounds' mean, the wall clock the longest, and each round's own p99 kept
    beside them. A p99 of 800 requests is their 8th slowest and moves by up to 2× between runs of the same code
    (docs/benchmarks.md, run 29); the pooled p99 of N rounds is their 8N-th slowest."""
    first = runs[0]
    if len(runs) == 1:
        return first
    ran = [o for o in runs if o.ttft_ms]
    merged = Outcome(first.contender, first.version, problem=next((o.problem for o in runs if o.problem), None))
    for o in runs:
        merged.answered += o.answered
        merged.lost += o.lost
        merged.within_slo += o.within_slo
        merged.ttft_ms += o.ttft_ms
        merged.prompt_tokens += o.prompt_tokens
        merged.cached_tokens += o.cached_tokens
        for kind, count in o.errors.items():
            merged.errors[kind] = merged.errors.get(kind, 0) + count
    nodes = {n for o in ran for n in o.shares}
    merged.shares = {n: sum(o.shares.get(n, 0.0) for o in ran) / len(ran) for n in sorted(nodes)} if ran else {}
    walls = [o.wall_s for o in runs if o.wall_s is not None]
    merged.wall_s = max(walls) if walls else None
    merged.round_p99_ms = [percentile(o.ttft_ms, 0.99) or 0.0 for o in ran]
    return merged


# --- the peers --------------------------------------------------------------------------------------------


def install_peers(venv: Path, packages: Sequence[str], out: Path) -> dict[str, str]:
    """Each pinned peer into `venv` (created when missing); its installed version, or why it is missing.

    One `pip install` per peer, so a peer that cannot be installed does not keep the other out."""
    python = venv / "bin" / "python"
    versions: dict[str, str] = {}
    with out.open("ab") as log:
        if not python.exists():
            try:
                made = subprocess.run([sys.executable, "-m", "venv", str(venv)], stdout=log, stderr=log, timeout=120)
                failed = made.returncode != 0
            except subprocess.TimeoutExpired:
                failed = True
            if failed:
                return {p: f"! no virtualenv at {venv} (python -m venv failed)" for p in packages}
        for package in packages:
            pin = f"{package}=={PINS[package]}"
            failed = None
            for run in INSTALLS.get(package, ((pin,),)):
                try:
                    done = subprocess.run(
                        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *run],
                        stdout=log,
                        stderr=log,
                        timeout=INSTALL_LIMIT_S,
                    )
                except subprocess.TimeoutExpired:
                    failed = f"! pip install {pin} ran past {INSTALL_LIMIT_S:.0f} s"
                    break
                if done.returncode != 0:
                    failed = f"! pip install {pin} failed (see {out})"
                    break
            if failed is not None:
                versions[package] = failed
                continue
            shown = subprocess.run(
                [str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            versions[package] = shown.stdout.strip() or f"! {package} not importable after install"
    return versions


def peer_args(contender: Contender, cluster: Cluster, port: int, debug: bool = False) -> list[str]:
    """The peer's command line (after its Python) for the cluster's engines, on loopback `port`; `debug` has it
    log each routing decision (the vLLM router's `KV prefix decision` lines) into its log."""
    urls = [node.url for node in cluster.nodes]
    args = ["-m", contender.module, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    args += ["--policy", contender.policy, "--prometheus-port", str(free_port())]
    if contender.package == "vllm-router":
        args += ["--log-level", "debug" if debug else "warning"]
        if contender.policy == "kv_aware":
            for node in cluster.nodes:
                args += ["--kv-event-source", f"{node.url}=tcp://127.0.0.1:{node.kv_port}"]
            args += ["--kv-event-model", MODEL_NAME]
    else:
        args += ["--log-level", "debug" if debug else "warn"]
    return args


def dynamo_model_dir(requests: Sequence[DemoRequest], out: Path) -> Path:
    """The model directory Dynamo's frontend tokenizes with (`bench/dynamo_worker.py` registers it): a word-level
    tokenizer whose words are the engines' 4-character chunks, each with the id the engines' emulated tokenizer
    gives it (`prompt_tokens`), so that Dynamo's router hashes the ids the engines' KV events carry; and a chat
    template that joins the messages' text as the engines do. Its vocabulary is every chunk of `requests`."""
    vocab = {"<eos>": 0, "tok ": 1}
    for request in requests:
        for start in range(0, len(request.text), CHARS_PER_TOKEN):
            chunk = request.text[start : start + CHARS_PER_TOKEN]
            vocab.setdefault(chunk, prompt_tokens(chunk)[0])
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": "[\\s\\S]{1,%d}" % CHARS_PER_TOKEN},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "tok "},
    }
    template = "{% for m in messages %}{% if not loop.first %}\n{% endif %}{{ m['content'] }}{% endfor %}"
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "eos_token": "<eos>",
        "unk_token": "tok ",
        "bos_token": None,
    }
    model = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 131_072}
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "config.json").write_text(json.dumps({**model, "eos_token_id": 0, "vocab_size": 2**31}))
    return out


def serves_all(port: int, proc: subprocess.Popen[bytes], field: str, nodes: int, deadline: float) -> bool:
    """Whether the router on `port` (`proc`) names all `nodes` in its `GET /health` answer before `deadline`
    (`time.monotonic()`): its `field` counts them (`prism gateway`'s table `endpoints`) or lists them (Dynamo's
    frontend's worker `instances`)."""
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
            named = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).json().get(field)
            if (named if isinstance(named, int) else len(named or [])) == nodes:
                return True
        time.sleep(0.1)
    return False


def log_tail(path: Path, lines: int = 6) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


# --- one contender ----------------------------------------------------------------------------------------


def slo_ms(request: DemoRequest, time_scale: float, gpus: Sequence[str]) -> float:
    """The request's TTFT SLO in wall milliseconds: `prism eval`'s (`semantics.ttft_slo_s`: the text slice's τ0, or 5
    times its prompt's prefill alone on the slowest engine of the pool, which holds every engine here since the demo's
    agents read no GPU class) in the engines' model seconds, times `time_scale`, as the engines run that much slower."""
    slowest = min(gpus, key=lambda g: PROFILES[g].prefill_tokens_per_s)  # type: ignore[index]
    return 1000 * time_scale * ttft_slo_s(Slice.LLM, prefill_work_s([request], [slowest]))


def engine_requests(cluster: Cluster) -> dict[str, float]:
    """Requests each engine finished, from its `/metrics` (the same count whatever router sent them)."""
    counts: dict[str, float] = {}
    for node in cluster.nodes:
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"{node.url}/metrics", timeout=2.0).text
            counts[node.node_id] = metric(text, "vllm:e2e_request_latency_seconds_count") or 0.0
    return counts


def run_one(
    contender: Contender,
    version: str,
    requests: Sequence[DemoRequest],
    duration_s: float,
    time_scale: float,
    logs: Path,
    python: Path,
    debug: bool = False,
    gpus: Sequence[str] = DEFAULT_NODES,
) -> Outcome:
    """One contender on a fresh cluster of `gpus`; every process it started is stopped before it returns."""
    outcome = Outcome(contender, version)
    logs.mkdir(parents=True)
    cluster = Cluster(tuple(gpus), time_scale, logs, ebpf=False)
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: stop([*procs, *cluster.procs()]))
        cluster.start(prism=contender.package is None and "--worker-url" not in contender.module)
        for node in cluster.nodes:
            if not wait_healthy(f"{node.url}/health", node.engine, time.monotonic() + STARTUP_LIMIT_S):
                outcome.problem = f"engine {node.node_id} did not start: {cluster.log_tail(4)}"
                return outcome
        router: Router | None = None
        client: httpx.AsyncClient | None = None
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
        timeout = httpx.Timeout(60.0, connect=2.0)
        if contender.module.startswith("gateway"):
            port = free_port()
            log = logs / "router.log"
            args = ["-m", "prismlb.cli", "gateway", "--port", str(port)]
            flags = contender.module.split()[1:]
            if "--worker-url" in flags:
                flags.remove("--worker-url")
                args += [f"--worker-url={node.url}" for node in cluster.nodes]
            else:
                args += ["--updates", cluster.address.updates, "--snapshot", cluster.address.snapshot]
            args += flags
            proc = spawn(args, log)
            procs.append(proc)
            if not serves_all(port, proc, "endpoints", len(cluster.nodes), time.monotonic() + STARTUP_LIMIT_S):
                outcome.problem = f"no routing table with every node: {log_tail(log)}"
                return outcome
            client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=timeout, limits=limits)
        elif contender.package is None:
            several = contender.module.startswith("routers")
            settings = Settings(share_turns=contender.module != "routers --own-turns")
            routers = [
                stack.enter_context(Router.connect(cluster.address, settings=settings))
                for _ in range(ROUTERS if several else 1)
            ]
            wanted = {n.node_id for n in cluster.nodes}
            ready_by = time.monotonic() + STARTUP_LIMIT_S
            while any({n.node_id for n in llm_nodes(r.table)} != wanted for r in routers):
                if cluster.failed() or time.monotonic() > ready_by:
                    outcome.problem = f"no routing table with every node: {cluster.failed() or 'timed out'}"
                    return outcome
                time.sleep(0.1)
            router = routers[0]
            if contender.module == "text-blocks":
                inner = httpx.AsyncHTTPTransport(limits=limits)
                transport = AsyncPrismTransport(router, transport=inner, tokenize=None)
                client = httpx.AsyncClient(transport=transport, base_url="http://prism", timeout=timeout)
            elif several:
                dealt = Dealt(
                    [AsyncPrismTransport(r, transport=httpx.AsyncHTTPTransport(limits=limits)) for r in routers]
                )
                client = httpx.AsyncClient(transport=dealt, base_url="http://prism", timeout=timeout)
        elif contender.package == "ai-dynamo":
            port = free_port()
            log = logs / "router.log"
            env = {
                "DYN_DISCOVERY_BACKEND": "file",
                "DYN_FILE_KV": str(logs / "dynamo-discovery"),
                "DYN_REQUEST_PLANE": "tcp",
                "DYN_LOG": "debug" if debug else "warn",
            }
            model = dynamo_model_dir(requests, logs / "dynamo-model")
            for node in cluster.nodes:
                worker = [str(DYNAMO_WORKER), "--engine", node.url, "--kv-events", f"tcp://127.0.0.1:{node.kv_port}"]
                worker += ["--model-dir", str(model), "--model-name", MODEL_NAME]
                worker += ["--block-size", str(BLOCK_SIZE_TOKENS)]
                procs.append(spawn(worker, logs / f"dynamo-{node.node_id}.log", executable=str(python), env=env))
            frontend = ["-m", contender.module, "--router-mode", contender.policy, "--http-host", "127.0.0.1"]
            frontend += ["--http-port", str(port), "--kv-cache-block-size", str(BLOCK_SIZE_TOKENS)]
            peer = spawn(frontend, log, executable=str(python), env=env)
            procs.append(peer)
            ready_by = time.monotonic() + DYNAMO_STARTUP_LIMIT_S
            if not serves_all(port, peer, "instances", len(cluster.nodes), ready_by):
                limit = f"{DYNAMO_STARTUP_LIMIT_S:.0f} s"
                outcome.problem = f"no frontend with every worker within {limit}: {log_tail(log)}"
                return outcome
            client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=timeout, limits=limits)
        else:
            port = free_port()
            log = logs / "router.log"
            peer = spawn(peer_args(contender, cluster, port, debug), log, executable=str(python))
            procs.append(peer)
            if not wait_healthy(f"http://127.0.0.1:{port}/health", peer, time.monotonic() + STARTUP_LIMIT_S):
                outcome.problem = f"did not start within {STARTUP_LIMIT_S:.0f} s: {log_tail(log)}"
                return outcome
            client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=timeout, limits=limits)
        with (logs / "replay.log").open("w") as out:
            # engines slowed past the demo's range decode slower too: their last requests get as much longer
            drain_s = DRAIN_LIMIT_S * max(1.0, time_scale / TIME_SCALE_RANGE[1])
            deadline = time.monotonic() + duration_s + drain_s + 5.0
            demo = Demo(cluster, router, requests, duration_s, None, out, False, deadline, drain_s)
            demo.start = time.monotonic()
            try:
                asyncio.run(demo.run(client))
            except RuntimeError as exc:  # a child failed mid-run: the results so far still count
                outcome.problem = f"stopped early: {exc}"
        counts = engine_requests(cluster)
    ok = [r for r in demo.results if r.error is None]
    outcome.answered = len(ok)
    for r in demo.results:
        if r.error is not None and r.error != UNFINISHED:
            outcome.errors[r.error] = outcome.errors.get(r.error, 0) + 1
    outcome.lost = demo.not_sent + sum(1 for r in demo.results if r.error == UNFINISHED)
    outcome.ttft_ms = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    by_index = {req.index: req for req in requests}
    outcome.within_slo = sum(
        1 for r in ok if r.ttft_ms is not None and r.ttft_ms <= slo_ms(by_index[r.index], time_scale, gpus)
    )
    outcome.prompt_tokens = sum(r.prompt_tokens for r in ok)
    outcome.cached_tokens = sum(r.cached_tokens for r in ok)
    total = sum(counts.values())
    outcome.shares = {k: v / total for k, v in counts.items()} if total else {}
    if demo.results:
        outcome.wall_s = max(r.end_s for r in demo.results) - min(r.sent_s for r in demo.results)
    return outcome


# --- the table --------------------------------------------------------------------------------------------


def table(outcomes: Sequence[Outcome], nodes: Sequence[str]) -> list[str]:
    """One markdown row per contender, ranked by TTFT p99 (those that did not run last); with a column of each
    round's p99 when any contender ran more than one (`pooled`)."""
    rounds = any(o.round_p99_ms for o in outcomes)
    head = "| router | version | policy | answered | errors | lost | within SLO | TTFT p50 | TTFT p99 | "
    head += "p99 by round | " * rounds + "cached | " + " | ".join(nodes) + " | wall |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def key(o: Outcome) -> float:
        p99 = percentile(o.ttft_ms, 0.99)
        return float("inf") if o.problem and not o.ttft_ms or p99 is None else p99

    for o in sorted(outcomes, key=key):
        c = o.contender
        if o.problem and not o.ttft_ms:
            lines.append(f"| {c.name} | {o.version} | {c.policy} | did not run: {o.problem.splitlines()[0]} |")
            continue
        p50, p99 = percentile(o.ttft_ms, 0.5), percentile(o.ttft_ms, 0.99)
        cached = f"{o.cached_tokens / o.prompt_tokens:.1%}" if o.prompt_tokens else "-"
        errors = sum(o.errors.values())
        shares = " | ".join(f"{o.shares.get(n, 0.0):.0%}" for n in nodes)
        by_round = f"{', '.join(f'{v:.0f}' for v in o.round_p99_ms) or '-'} ms | " if rounds else ""
        sent = o.answered + errors + o.lost
        within = f"{o.within_slo / sent:.1%}" if sent else "-"
        lines.append(
            f"| {c.name} | {o.version} | {c.policy} | {o.answered} | {errors} | {o.lost} | {within} | {p50:.0f} ms | "
            f"{p99:.0f} ms | {by_round}{cached} | {shares} | {o.wall_s or 0:.1f} s |"
        )
    return lines


def replay_p99_ms(
    contenders: Sequence[Contender],
    requests: int,
    load: float,
    *,
    trace: str | Path = "mooncake",
    gpu_labels: bool = False,
    gpus: Sequence[str] = DEFAULT_NODES,
) -> dict[str, float]:
    """TTFT p99 of each replay model on the same trace prefix, cluster and offered prefill load as the live
    runs (prompts at their trace size, where the live engines shrink them and slow down to match the load).

    The demo's agents report no GPU class (there is no GPU to read through NVML), so Prism's brain puts every
    node in the text pool; the replay's nodes do the same unless `gpu_labels`, which labels each node with its
    class as an agent on a real GPU host would."""
    import torch

    from prismlb.sim import resolve_workload
    from prismlb.sim._cluster import NodeSpec
    from prismlb.sim._eval import replay

    torch.set_num_threads(1)
    workload = resolve_workload(trace, seed=1, limit=requests)
    labels = None if gpu_labels else {"gpu": ""}
    nodes = [NodeSpec(f"{gpu}-{i + 1}", gpu, 0, labels) for i, gpu in enumerate(gpus)]  # type: ignore[arg-type]
    out = {}
    for name in dict.fromkeys(c.replay for c in contenders if c.replay is not None):
        out[name] = replay(workload, name, nodes, load, seed=1).slices["all"].ttft_p99_ms
    return out


def agreement(outcomes: Sequence[Outcome], replayed: dict[str, float]) -> list[str]:
    """A table of each modelled contender's live and replayed TTFT p99 and rank, and whether every pair of
    contenders with different replay models is ordered the same way live and in the replay."""
    modelled = [o for o in outcomes if o.contender.replay in replayed and o.ttft_ms]
    live = {id(o): percentile(o.ttft_ms, 0.99) or 0.0 for o in modelled}
    by_live = sorted(modelled, key=lambda o: live[id(o)])
    by_replay = sorted(modelled, key=lambda o: replayed[o.contender.replay or ""])
    lines = [
        "| contender | live TTFT p99 | live rank | replay model | replay TTFT p99 | replay rank |",
        "|---|---|---|---|---|---|",
    ]
    for o in by_live:
        c = o.contender
        lines.append(
            f"| {c.name} {c.policy} | {live[id(o)]:.0f} ms | {by_live.index(o) + 1} | {c.replay} | "
            f"{replayed[c.replay or '']:.0f} ms | {by_replay.index(o) + 1} |"
        )
    pairs = [
        (a, b) for i, a in enumerate(modelled) for b in modelled[i + 1 :] if a.contender.replay != b.contender.replay
    ]
    disagree = [
        f"{a.contender.name} {a.contender.policy} / {b.contender.name} {b.contender.policy}"
        for a, b in pairs
        if (live[id(a)] < live[id(b)]) != (replayed[a.contender.replay or ""] < replayed[b.contender.replay or ""])
    ]
    verdict = "agree" if not disagree else f"disagree on {len(disagree)} of {len(pairs)}: {'; '.join(disagree)}"
    verdict = verdict if pairs else "have no pair to compare"
    lines.append("")
    lines.append(f"Live and replay orderings of contenders with different models {verdict}.")
    return lines


def bakeoff(
    trace: str | Path,
    args: argparse.Namespace,
    contenders: Sequence[Contender],
    versions: dict[str, str],
    logs: Path,
) -> list[Outcome]:
    """Every contender on the first `args.requests` of `trace`, one after the other; their table and the replay
    check printed."""
    requests = load_requests(args.requests, trace)
    name = trace.stem if isinstance(trace, Path) else trace
    work_s = prefill_work_s(requests, args.nodes)
    time_scale = min(TIME_SCALE_MAX, max(TIME_SCALE_RANGE[0], args.load * args.duration / work_s))
    print(
        f"live bakeoff: {len(requests)} {name} requests (trace 0-{requests[-1].at_s:.0f} s) in "
        f"{args.duration:.0f} s on {', '.join(args.nodes)} at time_scale {time_scale:.2f} "
        f"({time_scale * work_s / args.duration:.0%} of their prefill offered); one infinite "
        f"prefix cache would hit {prefix_cache_bound(requests):.1%}; logs in {logs}",
        flush=True,
    )
    runs: dict[int, list[Outcome]] = {}
    for round_ in range(args.rounds):  # round after round, so that a drift of the host's load falls on every contender
        for i, contender in enumerate(contenders):
            label = f"{contender.name} {contender.policy}" + (f" (round {round_ + 1})" if args.rounds > 1 else "")
            version = versions.get(contender.package, "") if contender.package else "this checkout"
            if version.startswith("!"):
                if round_ == 0:
                    runs[i] = [Outcome(contender, PINS.get(contender.package or "", ""), problem=version[2:])]
                    print(f"   {label}: not installed ({version[2:]})", flush=True)
                continue
            print(f"   {label}: running", flush=True)
            outcome = run_one(
                contender,
                version,
                requests,
                args.duration,
                time_scale,
                logs / f"{name}-{i}-{contender.name}" / f"round-{round_ + 1}",
                args.venv / "bin" / "python",
                args.peer_debug,
                args.nodes,
            )
            runs.setdefault(i, []).append(outcome)
            if outcome.problem:
                print(f"   {label}: {outcome.problem}", flush=True)
    outcomes = [pooled(runs[i]) for i in sorted(runs)]
    nodes = [f"{gpu}-{i + 1}" for i, gpu in enumerate(args.nodes)]
    print(f"\n{name}:")
    for line in table(outcomes, nodes):
        print(line)
    for o in outcomes:
        if o.errors:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(o.errors.items()))
            print(f"   {o.contender.name} {o.contender.policy} errors: {kinds}")
    replayed = replay_p99_ms(contenders, args.requests, args.load, trace=trace, gpus=args.nodes)
    print()
    for line in agreement(outcomes, replayed):
        print(line)
    if "prism" in replayed:
        prism = [c for c in contenders if c.replay == "prism"]
        by_class = replay_p99_ms(prism, args.requests, args.load, trace=trace, gpu_labels=True, gpus=args.nodes)
        print(
            f"Replayed Prism with each node labelled with its GPU class, as agents on GPU hosts report it: "
            f"TTFT p99 {by_class['prism']:.0f} ms (unlabelled {replayed['prism']:.0f} ms).\n",
            flush=True,
        )
    return outcomes


def gpu_classes(text: str) -> tuple[str, ...]:
    """`--nodes`' value: the engines' GPU classes, each one the emulated engine has a profile for."""
    gpus = tuple(g.strip().lower() for g in text.split(",") if g.strip())
    unknown = sorted(set(gpus) - set(PROFILES))
    if not gpus or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown GPU class {', '.join(unknown) or '(none)'}; known: {', '.join(sorted(PROFILES))}"
        )
    return gpus


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="requests per trace")
    parser.add_argument("--duration", type=float, default=DEFAULT_DURATION_S, help="replay seconds per trace")
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD, help="offered share of prefill capacity")
    parser.add_argument(
        "--traces",
        default=DEFAULT_TRACES,
        help=f"comma-separated text workloads to run: shared traces and workload families NAME[:SEED], as prism "
        f"eval names them (default {DEFAULT_TRACES})",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a trace file in prism eval's format to run too (repeatable)",
    )
    parser.add_argument(
        "--nodes",
        type=gpu_classes,
        default=DEFAULT_NODES,
        help=f"GPU class of each engine, comma-separated (default {','.join(DEFAULT_NODES)}; known: "
        f"{', '.join(sorted(PROFILES))})",
    )
    parser.add_argument(
        "--rounds",
        type=whole_number_at_least(1, "--rounds must be at least 1, got {value}"),
        default=1,
        help="runs of each contender per trace, one round of all after another; the table pools their requests "
        "and lists each round's p99",
    )
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the peers' virtualenv")
    parser.add_argument(
        "--only",
        default="",
        help="contenders to run, comma-separated: prism, prism-gateway, prism-routers, sglang, vllm, dynamo (all)",
    )
    parser.add_argument(
        "--peer-debug", action="store_true", help="the peers log every routing decision (in their router.log)"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    only = {name for name in args.only.split(",") if name}
    contenders = [c for c in CONTENDERS if not only or c.name in only]
    traces: list[str | Path] = [*(t for t in args.traces.split(",") if t), *args.trace]
    logs = Path(tempfile.mkdtemp(prefix="prism-live-routers-"))
    status = 0
    with signals_interrupt():
        try:
            for trace in traces:
                load_requests(1, trace)  # an unknown or missing trace stops the bench before any peer runs
            packages = sorted({c.package for c in contenders if c.package is not None})
            versions = install_peers(args.venv, packages, logs / "pip.log") if packages else {}
            for package, version in versions.items():
                print(f"   {package}: {version}", flush=True)
            for trace in traces:
                bakeoff(trace, args, contenders, versions, logs)
        except KeyboardInterrupt:
            print("live bakeoff: interrupted; every process stopped", flush=True)
            status = 130
        except (ValueError, OSError) as exc:
            print(f"live bakeoff: {exc}", file=sys.stderr)
            status = 2
    print(f"   total wall clock {time.monotonic() - started:.0f} s; logs in {logs}")
    return status


if __name__ == "__main__":
    sys.exit(main())
