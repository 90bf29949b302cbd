"""`prism eval`: every policy on every workload at named utilisation levels and with a node killed, each
policy's goodput at the TTFT SLO, and the goodput of Prism's ablations, in one run.

A plain `prism eval` replays the shared traces (those a seed changes at two seeds, `SECOND_SEEDS`) and every
workload family preset at two seeds (`EVAL_FAMILIES`); `--goodput`, `--ablations` and the `--no-*` options
narrow it. Clusters (docs/sim.md): text traces run on eight A100-class nodes (the design's LLM pool); the
multimodal workloads run on the design's pools sized to the mix's prefill work (images about 68%, audio and
video about 32%): three H100s (NVLink, HBM3: the image pool) and five L40S (AV1, CUDA Graphs: the audio/video
pool). Load is scaled so the offered prefill work (prompt tokens without any cache reuse, plus media encoders)
is the named share of the cluster's prefill capacity. The kill runs take the 80% load and kill one node half-way
through the workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import cast

from prismlb.semantics import quantile
from prismlb.service import whole_number_at_least

from ._cluster import Degrade, Kill, NodeSpec, Simulation
from ._families import PRESETS, family_workload
from ._model import PROFILES, GpuClass
from ._slo import Goodput, Probe, attainment, format_goodput, pool_classes, search, slo_s, ttft_floors_s
from ._tracefile import load_trace
from ._types import Policy, RunResult, Workload
from ._workload import LEVELS, WORKLOADS, infinite_cache_hit_rate, load, offered_utilisation, scale_to_utilisation

PRISM = "prism"
KILL_LEVEL = 0.8
EVAL_FAMILIES = tuple(f"{name}:{seed}" for name in PRESETS for seed in (1, 2))
"""The workload families a plain `prism eval` adds to the shared traces: every preset, two seeds each."""
SECOND_SEEDS = ("mooncake:2", "mm:2")
"""The shared traces a plain `prism eval` replays again at seed 2: those a seed changes (Mooncake's arrivals
within the 3 s its timestamps round to, the multimodal sample). Azure's timestamps are exact, so a second seed
would replay them as the first does."""
EVAL_WORKLOADS = (*WORKLOADS, *SECOND_SEEDS, *EVAL_FAMILIES)
"""Every workload a plain `prism eval` replays, by name: the shared traces, `SECOND_SEEDS`, then `EVAL_FAMILIES`
(what the benches that measure "the evaluation's workloads" take)."""
SEARCH_LIMIT = 2000
"""Requests per workload in the goodput search unless `--limit` says otherwise: a search replays each workload
seven to ten times per policy."""
GRAY_SLOWDOWN = 3.0
"""How much slower the gray-failure replays' first node runs from a quarter of the way in (`gray_failure`)."""
GRAY_LOSS = 0.05
"""The share of segments lost between the gray-failure replays' last node and its callers, each way, from a quarter
of the way in."""
GRAY_FOREIGN = 0.5
"""The share of its prefill capacity that callers outside Prism take on the gray-failure replays' middle node."""
QUICK_LIMIT = 1000
"""Requests per workload in `prism eval --quick`."""
QUICK_FAMILIES = ("tenants:1", "sessions:1", "agentic:1", "multimodal:1")
"""The workload families `--quick` adds to the shared traces: shared prompts, growing conversations, long
shared contexts and mixed modalities."""

MIN_CLUSTER_NODES = 3
"""The fewest nodes a `--cluster` spec may have: `gray_failure` degrades three different ones."""
MAX_CLUSTER_NODES = 256
"""The most nodes of one class a `--cluster` spec may ask for: a replay's brain and engines run in one process."""
TEXT_CLUSTER = tuple(NodeSpec(f"a100-{i}", "a100", i % 2) for i in range(8))
MM_CLUSTER = (
    *(NodeSpec(f"h100-{i}", "h100", i % 2, {"nvlink": "yes"}) for i in range(3)),
    *(NodeSpec(f"l40s-{i}", "l40s", i % 2, {"cuda_graphs": "yes"}) for i in range(5)),
)


def cluster_for(trace: str | Path, workload: Workload | None = None, cluster: str = "") -> tuple[NodeSpec, ...]:
    """The nodes of a `--cluster` spec when given (`parse_cluster`); else the multimodal pools for `mm` and for a
    workload that carries media, the text pool otherwise."""
    if cluster:
        return parse_cluster(cluster)
    has_media = workload is not None and any(r.media for r in workload.requests)
    return MM_CLUSTER if trace == "mm" or has_media else TEXT_CLUSTER


@lru_cache(maxsize=8)
def parse_cluster(spec: str) -> tuple[NodeSpec, ...]:
    """The nodes of a cluster spec, `CLASS:COUNT[:LABEL=VALUE[+LABEL=VALUE...]]` comma-separated, e.g.
    `h100:2:nvlink=yes,a100:4,l40s:2:cuda_graphs=yes`: COUNT nodes of each GPU class of the engine model
    (`_model.PROFILES`), named `CLASS-i` and alternating between the gateways' two NUMA nodes, each labelled
    with the labels given as its agent would be (`brain/_slices.py` reads them to form the slices' pools)."""
    nodes: list[NodeSpec] = []
    for part in spec.split(","):
        fields = part.strip().split(":")
        if len(fields) not in (2, 3) or fields[0] not in PROFILES:
            raise ValueError(
                f"cluster part {part.strip()!r}: expected CLASS:COUNT[:LABEL=VALUE[+...]] with CLASS one of "
                f"{', '.join(PROFILES)}"
            )
        gpu = cast(GpuClass, fields[0])
        try:
            count = int(fields[1])
        except ValueError:
            count = 0
        if not 1 <= count <= MAX_CLUSTER_NODES:
            raise ValueError(
                f"cluster part {part.strip()!r}: COUNT must be a whole number from 1 to {MAX_CLUSTER_NODES}"
            )
        labels: dict[str, str] = {}
        for pair in fields[2].split("+") if len(fields) == 3 else ():
            key, equals, value = pair.partition("=")
            if not (equals and key and value):
                raise ValueError(f"cluster part {part.strip()!r}: label {pair!r} is not LABEL=VALUE")
            labels[key] = value
        taken = sum(1 for n in nodes if n.gpu_class == gpu)
        nodes += [NodeSpec(f"{gpu}-{taken + i}", gpu, (taken + i) % 2, labels or None) for i in range(count)]
    if len(nodes) < MIN_CLUSTER_NODES:
        raise ValueError(
            f"cluster {spec!r} has {len(nodes)} node(s); a replay needs at least {MIN_CLUSTER_NODES}: the gray failure "
            "puts three different nodes in trouble, and the kill run leaves the others serving"
        )
    return tuple(nodes)


def capacity(nodes: Sequence[NodeSpec]) -> tuple[float, dict[str, float]]:
    """(prefill tokens/s, encoder cluster-seconds per media part) of a cluster: what scaling divides by."""
    profiles = [PROFILES[n.gpu_class] for n in nodes]
    tokens = sum(p.prefill_tokens_per_s for p in profiles)
    media = {m: sum(p.encoder_s[m] for p in profiles) / len(profiles) ** 2 for m in ("image", "audio", "video")}
    return tokens, media


def policy_factories(block_tokens: int) -> dict[str, Callable[[], Policy]]:
    """Prism first, then the baselines, by name."""
    from ._prism import PrismPolicy
    from .policies import BASELINES, AIBrixPrefixCache, DynamoKvRouter, VllmKvAware

    return {
        PRISM: lambda: PrismPolicy(block_tokens=block_tokens),
        **BASELINES,
        "dynamo-kv": lambda: DynamoKvRouter(block_tokens=block_tokens),
        "vllm-kv-aware": VllmKvAware,
        "aibrix-prefix": lambda: AIBrixPrefixCache(block_tokens=block_tokens),
    }


def _policy(name: str, block_tokens: int) -> Policy:
    """A policy of `policy_factories`, or an ablation of Prism (`_ablations.VARIANTS`) by name, which it takes
    as its policy name so that its results are told apart from the full Prism's."""
    from ._ablations import VARIANTS

    factories = policy_factories(block_tokens)
    if name in factories:
        return factories[name]()
    policy = VARIANTS[name](block_tokens)
    policy.name = name
    return policy


@dataclass(frozen=True, slots=True)
class Case:
    trace: str | Path
    """A shared trace or a workload family by name, or a trace file (`--trace`)."""
    policy: str
    utilisation: float
    seed: int
    limit: int | None
    kill: bool = False
    degraded: bool = False
    """With the cluster's `gray_failure`."""
    cluster: str = ""
    """A `--cluster` spec (`parse_cluster`); empty: the workload's default cluster (`cluster_for`)."""


def resolve_workload(trace: str | Path, *, seed: int, limit: int | None) -> Workload:
    """The workload a name or file stands for, wherever one is named (`prism eval`, the live bakeoff): a shared
    trace by `NAME[:seed]` (named `NAME-seed` with a seed of its own, else at `seed`), a workload family by
    `NAME[:seed]` (`--workload`, its own seed), or a trace file (`--trace`, a `Path`). Raises ValueError for a
    name that is neither, OSError for a file that cannot be read."""
    if isinstance(trace, Path):
        return load_trace(trace, limit=limit, seed=seed)
    if (shared := _shared(trace)) is not None:
        name, own = shared
        workload = load(name, seed=seed if own is None else own, limit=limit)
        return workload if own is None else dataclasses.replace(workload, name=f"{name}-{own}")
    return family_workload(trace, limit)


@lru_cache(maxsize=32)
def _workload(trace: str | Path, seed: int, limit: int | None) -> tuple[Workload, float]:
    """`resolve_workload`'s workload and its prefix-hit bound, kept for the replays of one process: every case of a
    workload reads both, and the bound walks every request."""
    workload = resolve_workload(trace, seed=seed, limit=limit)
    return workload, infinite_cache_hit_rate(workload)


def _shared(spec: str) -> tuple[str, int | None] | None:
    """(trace, its own seed or None) for a shared trace's `NAME[:seed]`; None for any other name."""
    name, colon, seed = spec.partition(":")
    if name not in WORKLOADS:
        return None
    try:
        return name, int(seed) if colon else None
    except ValueError:
        raise ValueError(f"trace {spec!r}: the seed after ':' must be a whole number") from None


def run_case(case: Case) -> RunResult:
    """One replay (`replay`); the same case gives the same result."""
    import torch

    torch.set_num_threads(1)
    workload, bound = _workload(case.trace, case.seed, case.limit)
    nodes = cluster_for(case.trace, workload, case.cluster)
    floor = _p99_floor_ms(case.trace, case.seed, case.limit, case.cluster)
    kill = Kill(nodes[len(nodes) // 2 - 1].name) if case.kill else None
    degrade = gray_failure(nodes) if case.degraded else ()
    result = replay(workload, case.policy, nodes, case.utilisation, seed=case.seed, kill=kill, degrade=degrade)
    return dataclasses.replace(result, kv_hit_bound=bound, ttft_p99_floor_ms=floor)


@lru_cache(maxsize=32)
def _p99_floor_ms(trace: str | Path, seed: int, limit: int | None, cluster: str = "") -> float:
    """The TTFT p99 no policy can beat on the workload's cluster (`_slo.ttft_floors_s`), in ms."""
    workload, _ = _workload(trace, seed, limit)
    return 1000 * quantile(list(ttft_floors_s(workload, cluster_for(trace, workload, cluster)).values()), 0.99)


def gray_failure(nodes: Sequence[NodeSpec]) -> tuple[Degrade, ...]:
    """Three nodes in trouble without going down, a quarter of the way in: the first runs `GRAY_SLOWDOWN` times
    slower (a GPU throttled by heat or a failing fan), the last loses `GRAY_LOSS` of the segments to and from it (a
    flaky NIC or cable), the middle one also serves callers that do not go through Prism (`GRAY_FOREIGN` of its
    prefill capacity: another team's gateway, a batch job). Health checks pass on all three; what they cost is
    what the brain's signals are for."""
    return (
        Degrade(nodes[0].name, slowdown=GRAY_SLOWDOWN),
        Degrade(nodes[len(nodes) // 2].name, foreign=GRAY_FOREIGN),
        Degrade(nodes[-1].name, loss=GRAY_LOSS),
    )


def gray_text() -> str:
    """`gray_failure` in words, for the tables that run under it."""
    return (
        f"three nodes in trouble a quarter of the way into every probe (`_eval.gray_failure`): the first "
        f"{GRAY_SLOWDOWN:g} times slower, the middle one serving callers outside Prism ({GRAY_FOREIGN:.0%} of its "
        f"prefill capacity), the last losing {GRAY_LOSS:.0%} of the segments between it and its callers, both ways"
    )


def replay(
    workload: Workload,
    policy: str,
    nodes: Sequence[NodeSpec],
    utilisation: float,
    *,
    seed: int,
    kill: Kill | None = None,
    degrade: Sequence[Degrade] = (),
) -> RunResult:
    """The workload scaled to `utilisation` of the nodes' prefill capacity, replayed through the named policy
    (`policy_factories` or an ablation), its SLO attainment against each request's own SLO (`_slo.slo_s`):
    what every `prism eval` run is, on any cluster. Prism's own logs below ERROR are off while it runs (a
    replay's brain and routers would log every simulated fault and their start-up notes) and back at the caller's
    level after it."""
    scaled = _scaled(workload, nodes, utilisation)
    classes = pool_classes(nodes)
    log = logging.getLogger("prism")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return Simulation(
            scaled,
            _policy(policy, workload.block_tokens),
            nodes,
            utilisation=utilisation,
            seed=seed,
            kill=kill,
            degrade=degrade,
            slo_s=lambda r: slo_s(r, classes),
        ).run()
    finally:
        log.setLevel(level)


def _scaled(workload: Workload, nodes: Sequence[NodeSpec], utilisation: float) -> Workload:
    """The workload's arrivals stretched so its offered work is `utilisation` of the nodes' capacity."""
    tokens, media = capacity(nodes)
    return scale_to_utilisation(workload, utilisation, tokens, encoder_s_per_media=media)


def cases(
    traces: Sequence[str | Path],
    policies: Sequence[str],
    levels: Sequence[float],
    *,
    seed: int,
    limit: int | None,
    kill: bool,
    cluster: str = "",
) -> list[Case]:
    out = [Case(t, p, u, seed, limit, cluster=cluster) for t in traces for u in levels for p in policies]
    if kill:
        out += [Case(t, p, KILL_LEVEL, seed, limit, kill=True, cluster=cluster) for t in traces for p in policies]
    return out


def replay_pool(jobs: int, initializer: Callable[[], None] | None = None) -> ProcessPoolExecutor:
    """`jobs` replay processes (spawned: a fresh interpreter per worker, no forked torch state), kept by callers with
    many small batches, since each new process spends seconds importing the replay. A worker that dies (killed for
    memory) fails every case still due with `BrokenProcessPool` instead of leaving the run waiting for it."""
    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=initializer)


def run_all(
    todo: Sequence[Case],
    jobs: int = 1,
    progress: Callable[[RunResult], None] | None = None,
    pool: Executor | None = None,
) -> list[RunResult]:
    """Every case, in `jobs` processes (or in `pool`, a `replay_pool`); results in the order of `todo`."""
    if pool is None and jobs > 1:
        with replay_pool(jobs) as own:
            return run_all(todo, jobs, progress, own)
    results = []
    for result in map(run_case, todo) if pool is None else pool.map(run_case, todo):
        results.append(result)
        if progress is not None:
            progress(result)
    return results


def request_rate(trace: str | Path, seed: int, limit: int | None, utilisation: float, cluster: str = "") -> float:
    """Requests per second of the trace scaled to `utilisation` on its cluster, as `run_case` scales it."""
    workload, _ = _workload(trace, seed, limit)
    scaled = _scaled(workload, cluster_for(trace, workload, cluster), utilisation).requests
    return len(scaled) / (scaled[-1].arrival_s - scaled[0].arrival_s)


def goodput(
    traces: Sequence[str | Path],
    policies: Sequence[str],
    *,
    seed: int,
    limit: int | None,
    jobs: int = 1,
    progress: Callable[[RunResult], None] | None = None,
    pool: Executor | None = None,
    degraded: bool = False,
    cluster: str = "",
) -> list[Goodput]:
    """Each policy's goodput on each trace (`_slo.search`), its probes run as cases through `run_all` (in
    `pool` when given); `degraded`: with the cluster's `gray_failure`; `cluster`: on a `--cluster` spec's nodes."""
    if pool is None and jobs > 1:
        with replay_pool(jobs) as own:
            return goodput(
                traces,
                policies,
                seed=seed,
                limit=limit,
                jobs=jobs,
                progress=progress,
                pool=own,
                degraded=degraded,
                cluster=cluster,
            )

    def measure(probes: Sequence[Probe]) -> list[float]:
        todo = [
            Case(trace, policy, load, seed, limit, degraded=degraded, cluster=cluster) for trace, policy, load in probes
        ]
        out = []
        for case, result in zip(todo, run_all(todo, jobs, progress, pool), strict=True):
            workload, _ = _workload(case.trace, seed, limit)
            out.append(attainment(workload, result.ttft_s, cluster_for(case.trace, workload, cluster)))
        return out

    pairs = [(t, p) for t in traces for p in policies]
    found = search(pairs, measure)
    rows = []
    for trace, policy in pairs:
        f = found[(trace, policy)]
        workload, _ = _workload(trace, seed, limit)
        rate = request_rate(trace, seed, limit, f.load, cluster) if f.load > 0 else 0.0
        curve = tuple((request_rate(trace, seed, limit, u, cluster), value) for u, value in f.probes)
        rows.append(Goodput(workload.name, policy, f.load, rate, f.attainment, f.above, f.above_attainment, curve))
    return rows


def _cluster(text: str) -> str:
    """A `--cluster` spec, checked by parsing it once; empty: the default clusters."""
    if not text:
        return text
    try:
        parse_cluster(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _levels(text: str) -> list[float]:
    levels = []
    for part in text.split(","):
        name = part.strip()
        value = LEVELS.get(name) if name in LEVELS else float(name.rstrip("%")) / (100 if name.endswith("%") else 1)
        if value is None or not 0 < value <= 2:
            raise argparse.ArgumentTypeError(f"utilisation {name!r} is not a level ({', '.join(LEVELS)}) or in (0, 2]")
        levels.append(value)
    return levels


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="replay traces against Prism and the baselines in a cluster simulation",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--traces",
        default=None,
        help="comma-separated shared traces, NAME[:SEED] (default: all of them at --seed, Mooncake and mm again at "
        "seed 2, with every workload family preset at seeds 1 and 2, unless --workload or --trace is given)",
    )
    parser.add_argument(
        "--policies",
        default=None,
        help="comma-separated policies or ablations of sim/_ablations.py (default: prism and every baseline)",
    )
    parser.add_argument(
        "--cluster",
        type=_cluster,
        default="",
        help="replay every workload on these nodes instead of the default clusters: CLASS:COUNT[:LABEL=VALUE[+...]] "
        f"comma-separated, CLASS one of {', '.join(PROFILES)}, labels as the nodes' agents would carry them "
        "(e.g. h100:2:nvlink=yes,a100:4,l40s:2:cuda_graphs=yes)",
    )
    parser.add_argument("--levels", type=_levels, default=list(LEVELS.values()), help="e.g. 50%%,80%%,95%%")
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seed of the shared traces named without one: the multimodal sample, and Mooncake's arrivals within "
        "its timestamps' resolution (default 1)",
    )
    parser.add_argument(
        "--limit",
        type=whole_number_at_least(10, "a replay needs at least 10 requests, not {value}"),
        default=None,
        help="requests per workload, at least 10 (default: whole traces, mm 6000, families 4000; "
        f"the goodput search {SEARCH_LIMIT})",
    )
    parser.add_argument(
        "--workload",
        action="append",
        metavar="NAME[:SEED]",
        help="a workload family (sim/_families.py), repeatable; the shared traces then run only if --traces names them",
    )
    parser.add_argument(
        "--trace",
        action="append",
        type=Path,
        metavar="FILE",
        help="a trace file, named after its stem, repeatable: Mooncake-format JSON lines, or a .csv in Azure's or "
        "BurstGPT's columns (docs/sim-workloads.md); the shared traces then run only if --traces names them",
    )
    parser.add_argument("--no-kill", action="store_true", help="skip the node-kill runs")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a few minutes' version: every shared trace and the families {', '.join(QUICK_FAMILIES)}, "
        f"{QUICK_LIMIT} requests each, 80%% load, the kill runs, goodput and ablations; no report files",
    )
    parser.add_argument(
        "--jobs",
        type=whole_number_at_least(1, "runs need at least 1 process, not {value}"),
        default=min(2, os.cpu_count() or 1),
    )
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="where the report goes")
    parser.add_argument("--no-report", action="store_true", help="print the tables only")
    parser.add_argument(
        "--goodput",
        action="store_true",
        help="only the goodput search (per workload and policy, the highest load with 90%% of requests within "
        "their TTFT SLO, sim/_slo.py), or with --ablations only those two; prints the tables only",
    )
    parser.add_argument(
        "--ablations",
        action="store_true",
        help="only the ablations (the goodput of the full Prism and of each variant of sim/_ablations.py), or with "
        "--goodput only those two; prints the tables only",
    )
    parser.add_argument("--no-goodput", action="store_true", help="skip the goodput search")
    parser.add_argument("--no-ablations", action="store_true", help="skip the ablations")
    parser.add_argument(
        "--no-gray", action="store_true", help="skip the goodput searches under a gray failure (`gray_failure`)"
    )
    parser.set_defaults(func=_run)


def _traces(args: argparse.Namespace) -> list[str | Path]:
    """The workloads to replay: the named shared traces (all by default), then `--workload` families and
    `--trace` files; with neither of those nor `--traces`, every shared trace, `SECOND_SEEDS` and
    `EVAL_FAMILIES`."""
    shared = (
        [*WORKLOADS, *SECOND_SEEDS] if args.traces is None else [t.strip() for t in args.traces.split(",") if t.strip()]
    )
    try:
        unknown = sorted(t for t in shared if _shared(t) is None)
    except ValueError as e:
        raise argparse.ArgumentError(None, str(e)) from None
    if unknown:
        raise argparse.ArgumentError(None, f"unknown traces {unknown}; known: {', '.join(WORKLOADS)}[:SEED]")
    if args.traces is None and (args.workload or args.trace):
        shared = []
    families = list(args.workload or ())
    if args.traces is None and not args.workload and not args.trace:
        families = list(EVAL_FAMILIES)
    for spec in families:
        try:
            workload, bound = _workload(spec, args.seed, args.limit)
        except ValueError as e:
            raise argparse.ArgumentError(None, str(e)) from None
        print(f"{workload.name}: {len(workload.requests)} requests, prefix-hit bound {bound:.3f}")
    for name in shared:  # a cut that leaves one instant cannot be scaled to a load: say so before any run
        workload, _ = _workload(name, args.seed, args.limit)
        try:
            offered_utilisation(workload, 1.0)
        except ValueError as e:
            cut = f" (--limit {args.limit} keeps only its first requests)" if args.limit is not None else ""
            raise argparse.ArgumentError(None, f"{e}{cut}") from None
    files = _trace_files(args.trace or (), [*shared, *families], args.seed, args.limit)
    return [*shared, *families, *files]


def _run(args: argparse.Namespace) -> int:
    from ._ablations import GRAY_VARIANTS, VARIANTS, format_ablations
    from ._report import format_table, write_report

    if args.quick:
        _quick(args)
    known = [*policy_factories(1), *VARIANTS]
    policies = list(policy_factories(1)) if args.policies is None else [p.strip() for p in args.policies.split(",")]
    policies = [p for p in policies if p]
    if set(policies) - set(known):
        raise argparse.ArgumentError(
            None, f"unknown policies {sorted(set(policies) - set(known))}; known: {', '.join(known)}"
        )
    if args.ablations and PRISM not in policies:
        raise argparse.ArgumentError(
            None, "--ablations compares Prism's variants with Prism; --policies must name prism"
        )
    traces = _traces(args)  # after the checks above: it reads every trace
    levels = not (args.goodput or args.ablations)
    search = (args.goodput or levels) and not args.no_goodput
    ablations = (args.ablations or levels) and not args.no_ablations and PRISM in policies
    started = time.monotonic()

    def progress(r: RunResult) -> None:
        p99 = r.slices["all"].ttft_p99_ms
        kill = f", {r.killed_node} killed" if r.killed_node else ""
        print(
            f"[{time.monotonic() - started:6.1f} s] {r.trace} {r.utilisation:.0%}{kill} {r.policy}: "
            f"TTFT p99 {p99:.0f} ms, KV hit {r.kv_hit_rate:.1%} ({r.wall_s:.1f} s)",
            flush=True,
        )

    level_cases = cases(
        traces, policies, args.levels, seed=args.seed, limit=args.limit, kill=not args.no_kill, cluster=args.cluster
    )
    todo = level_cases if levels else []
    pool = replay_pool(args.jobs) if args.jobs > 1 else None
    limit = SEARCH_LIMIT if args.limit is None else args.limit

    def search_all(names: Sequence[str], degraded: bool) -> list[Goodput]:
        """Every named policy's goodput on every trace, each once, on the sound cluster or under `gray_failure`."""
        unique = list(dict.fromkeys(names))
        if not unique:
            return []
        return goodput(
            traces,
            unique,
            seed=args.seed,
            limit=limit,
            jobs=args.jobs,
            progress=progress,
            pool=pool,
            degraded=degraded,
            cluster=args.cluster,
        )

    try:
        by_case = dict(zip(todo, run_all(todo, args.jobs, progress, pool), strict=True))
        found = search_all([*(policies if search else ()), *((PRISM, *VARIANTS) if ablations else ())], False)
        gray = (
            []
            if args.no_gray
            else search_all([*(policies if search else ()), *((PRISM, *GRAY_VARIANTS) if ablations else ())], True)
        )
    except BrokenProcessPool:
        print(
            f"prism eval: a replay process ended abruptly after {time.monotonic() - started:.0f} s (most often the "
            f"kernel's OOM killer: see dmesg); nothing is written. Free memory or run fewer --jobs than {args.jobs}.",
            file=sys.stderr,
        )
        return 1
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    results = [by_case[c] for c in level_cases] if levels else []
    rows = [r for r in found if r.policy in policies] if search else []
    gray_rows = [r for r in gray if r.policy in policies] if search else []
    ablation = None
    if ablations:
        ablation = format_ablations([r for r in found if r.policy in (PRISM, *VARIANTS)])
        if gray:
            ablation += (
                f"\n\n### Under a gray failure\n\nThe same goodput search with {gray_text()}; Prism's goodput is its "
                "own under the same failure.\n\n"
                + format_ablations([r for r in gray if r.policy in (PRISM, *GRAY_VARIANTS)])
            )
    print()
    if results:
        print(format_table(results) + "\n")
    if search:
        print(format_goodput(rows) + "\n")
        if gray_rows:
            print(f"Goodput under a gray failure, {gray_text()}.\n\n{format_goodput(gray_rows)}\n")
    if ablation is not None:
        print(ablation + "\n")
    if levels and not args.no_report:
        command = " ".join(["prism eval", *_argv_echo(args)])
        paths = write_report(
            results,
            args.out,
            command=command,
            goodput=rows,
            gray_goodput=gray_rows,
            gray=gray_text(),
            ablations=ablation,
        )
        print(f"report: {', '.join(str(p) for p in paths if p.suffix == '.md')}")
    searches = f" and {len(found) + len(gray)} goodput searches" if found or gray else ""
    print(f"{len(by_case)} runs{searches} in {time.monotonic() - started:.0f} s")
    return 0


def _quick(args: argparse.Namespace) -> None:
    """`--quick`: the quick families beside the shared traces, `QUICK_LIMIT` requests and the kill level unless
    the command line says otherwise, and no report files (a short run must not overwrite the full one's)."""
    args.traces = ",".join(WORKLOADS) if args.traces is None else args.traces
    args.workload = [*(args.workload or ()), *(f for f in QUICK_FAMILIES if f not in (args.workload or ()))]
    args.limit = QUICK_LIMIT if args.limit is None else args.limit
    args.levels = [KILL_LEVEL] if args.levels == list(LEVELS.values()) else args.levels
    args.no_report = True


def _argv_echo(args: argparse.Namespace) -> list[str]:
    """The options that differ from the defaults, as they would be typed."""
    out = []
    if args.traces is not None:
        out.append(f"--traces {args.traces}")
    if args.policies is not None:
        out.append(f"--policies {args.policies}")
    if args.levels != list(LEVELS.values()):
        out.append("--levels " + ",".join(f"{v:.0%}" for v in args.levels))
    if args.seed != 1:
        out.append(f"--seed {args.seed}")
    if args.cluster:
        out.append(f"--cluster {args.cluster}")
    if args.limit is not None:
        out.append(f"--limit {args.limit}")
    if args.no_kill:
        out.append("--no-kill")
    if args.no_goodput:
        out.append("--no-goodput")
    if args.no_ablations:
        out.append("--no-ablations")
    if args.no_gray:
        out.append("--no-gray")
    out += [f"--workload {spec}" for spec in args.workload or ()]
    out += [f"--trace {path}" for path in args.trace or ()]
    return out


def _trace_files(paths: Sequence[Path], taken: Sequence[str | Path], seed: int, limit: int | None) -> list[Path]:
    """The `--trace` files, each read once here so that a bad line or two files of one name (results and report
    files are named after the trace) stop `prism eval` before any run."""
    names = {t for t in taken if isinstance(t, str)}
    for path in paths:
        if path.stem in names:
            raise argparse.ArgumentError(None, f"two traces named {path.stem!r}; rename one of the files")
        names.add(path.stem)
        try:
            workload, _ = _workload(path, seed, limit)
            offered_utilisation(workload, 1.0)  # raises when there is no load to scale: no requests, or one instant
        except (OSError, ValueError) as e:
            raise SystemExit(f"prism eval: {e}") from None
    return list(paths)
