"""The design's "semantic affinity" signal, measured by ablation against Prism's placement.

Run: .venv/bin/python bench/semantic_affinity.py [--limit 2000] [--jobs 2] [--workloads tenants:1,rag:1]

The design places a request by `0.6 · cosine(structure embedding of the prompt, the node's summary vector)
+ 0.4 · KV overlap` and credits it with more KV reuse and lower latency than plain text similarity. Prism places
by expected time to first token over an exact prefix index (`Router._by_ttft`): the node holding the longest
cached prefix wins while its expected TTFT is within `Settings.cache_affinity` of the least. This bench asks
whether a structure signal adds anything on top, without touching the library: a feature-hashing encoder of the
prompt's skeleton (`SimRequest.skeleton`, which the workload families fill), a `Router` subclass whose
expected-TTFT choice uses it, and the replay's Prism with that router, registered as ablation variants
(`_ablations.VARIANTS`) so the goodput search of `prism eval --ablations` measures them beside the full Prism in
the same run. Three ways of using the signal (`MODES`), none tuned per workload.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache

import numpy as np
from prometheus_client import CollectorRegistry

from prismlb.router import Router, Settings
from prismlb.router._router import Placement
from prismlb.router._snapshot import Group
from prismlb.sim._ablations import VARIANTS
from prismlb.sim._cluster import Simulation
from prismlb.sim._eval import PRISM, _policy, _scaled, _workload, cluster_for, goodput, replay_pool
from prismlb.sim._families import PRESETS
from prismlb.sim._prism import PrismPolicy
from prismlb.sim._report import MISSING, _md_table, format_pct, geometric_mean
from prismlb.sim._slo import SEARCH_LOW, Goodput, pool_classes, slo_s
from prismlb.sim._types import Policy, SimRequest

DIMS = 128
"""Length of a structure vector: a few dozen distinct features per workload hash into it with few collisions."""
POSITIONS = 8
"""Pieces are position-tagged 0..6; later pieces share the tag 7 (an agent loop's hundredth tool call is 'late')."""
STRUCTURE_WEIGHT = 0.6
"""The design's weights: 0.6 on the cosine, the rest (0.4) on the KV overlap."""
SUMMARY_ALPHA = 0.05
"""Weight of each placed request's vector in its node's summary (an EWMA centroid over about 20 placements)."""
TIE_SHARE = 0.1
"""`tie-break` mode: candidates with the anchor's prefix depth and an expected TTFT within 10% of its count as tied."""
LEVEL = 0.8
"""The utilisation of the per-workload KV hit and TTFT table."""


def _features(skeleton: Sequence[str]) -> Iterator[str]:
    """The hashed features of a skeleton (`kind:log2 length` pieces, media modalities): each piece with its
    length bucket, its kind alone, its kind tagged with its position, kind bigrams with start and end marks,
    and the number of pieces in log2 buckets."""
    previous = "^"
    for i, piece in enumerate(skeleton):
        kind = piece.partition(":")[0]
        yield f"u:{piece}"
        yield f"k:{kind}"
        yield f"p{min(i, POSITIONS - 1)}:{kind}"
        yield f"b:{previous}>{kind}"
        previous = kind
    yield f"b:{previous}>$"
    yield f"n:{len(skeleton).bit_length()}"


@lru_cache(maxsize=1 << 16)
def encode(skeleton: tuple[str, ...]) -> np.ndarray:
    """The skeleton's structure vector: signed feature hashing (blake2b, stable across processes, unlike
    `hash`) into `DIMS` floats, L2-normalised. Read-only: calls with one skeleton share it."""
    vector = np.zeros(DIMS)
    for feature in _features(skeleton):
        digest = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
        vector[digest % DIMS] += 1.0 if (digest >> 32) & 1 else -1.0
    vector /= np.linalg.norm(vector)  # never zero: the end bigram and the count are always there
    vector.flags.writeable = False
    return vector


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity; 0 when either is zero."""
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norms if norms > 0 else 0.0


MODES = ("blend", "tie-break", "cold")
"""How the structure signal enters the expected-TTFT choice (`StructureRouter`)."""


class StructureRouter(Router):
    """A `Router` whose expected-TTFT choice also weighs the prompt's structure against each node's summary.

    `mode`: `blend` (the design's rule): among the candidates whose expected TTFT is within `cache_affinity`
    times the least, the highest `0.6 · cos + 0.4 · overlap` (overlap: cached prefix depth over the prompt's
    blocks), ties to the least expected TTFT; `tie-break`: Prism's choice, unless a candidate of the same prefix
    depth and an expected TTFT within `TIE_SHARE` of it is structurally closer; `cold`: `blend` only for requests
    no candidate holds a prefix of, else Prism's choice. Summaries (`summarise`) are EWMA centroids of the
    structure vectors of the requests placed on each node: what the brain would summarise from routers'
    reports. The caller sets `vector` to the structure of the request about to be placed."""

    def __init__(
        self,
        *,
        mode: str = "blend",
        settings: Settings | None = None,
        clock: Callable[[], float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is none of {MODES}")
        super().__init__(settings=settings, clock=clock, registry=registry)
        self.mode = mode
        self.vector: np.ndarray | None = None
        self.summaries: dict[str, np.ndarray] = {}
        self.decisions = 0
        """Expected-TTFT choices made, and those `changed` from what Prism's rule chose: how often the signal acts."""
        self.changed = 0

    def summarise(self, node_id: str, vector: np.ndarray) -> None:
        """Fold a placed request's structure into its node's summary."""
        before = self.summaries.get(node_id)
        self.summaries[node_id] = vector.copy() if before is None else before + SUMMARY_ALPHA * (vector - before)

    def _by_ttft(self, group: Group, placement: Placement) -> tuple[int | None, float]:
        anchor, anchor_expected = super()._by_ttft(group, placement)
        if anchor is None or self.vector is None:
            return anchor, anchor_expected
        expected = {i: ttft for i, (ttft, _) in self._expected_ttft(group, placement)[0].items()}
        depths = placement.depths
        node_of = {i: group.entries[i][4].node_id for i in expected}
        if self.mode == "tie-break":
            depth = depths.get(node_of[anchor], 0)
            tied = [
                i
                for i, e in expected.items()
                if depths.get(node_of[i], 0) == depth and e <= expected[anchor] * (1 + TIE_SHARE)
            ]
            chosen = max(tied, key=lambda i: (self._closeness(node_of[i]), i == anchor))
        elif self.mode == "cold" and any(depths.get(node_of[i], 0) for i in expected):
            chosen = anchor
        else:
            window = self.settings.cache_affinity * min(expected.values())
            blocks = len(placement.request.blocks)

            def score(i: int) -> tuple[float, float]:
                overlap = depths.get(node_of[i], 0) / blocks
                blended = STRUCTURE_WEIGHT * self._closeness(node_of[i]) + (1 - STRUCTURE_WEIGHT) * overlap
                return blended, -expected[i]

            chosen = max((i for i, e in expected.items() if e <= window), key=score)
        self.decisions += 1
        self.changed += chosen != anchor
        return chosen, expected[chosen]

    def _closeness(self, node_id: str) -> float:
        """Cosine of the request's structure and the node's summary (0 for a node with none yet)."""
        summary = self.summaries.get(node_id)
        return 0.0 if summary is None or self.vector is None else cosine(self.vector, summary)


class StructurePolicy(PrismPolicy):
    """The replay's Prism (brain, one router, library settings) with a `StructureRouter` in `mode`: the structure
    vector of each request is set before placement and folded into the chosen node's summary after it."""

    def __init__(self, *, block_tokens: int, mode: str) -> None:
        super().__init__(block_tokens=block_tokens)
        for router in self.routers:
            router.close()
        self.routers = [
            StructureRouter(mode=mode, settings=router.settings, clock=self._clock) for router in self.routers
        ]

    def choose(self, request: SimRequest, now: float, exclude: frozenset[str]) -> str:
        router = self.routers[request.id % len(self.routers)]
        assert isinstance(router, StructureRouter)
        vector = encode(request.skeleton)
        router.vector = vector
        node = super().choose(request, now, exclude)
        router.vector = None
        router.summarise(node, vector)
        return node


def _factory(mode: str) -> Callable[[int], Policy]:
    def build(block_tokens: int) -> Policy:
        return StructurePolicy(block_tokens=block_tokens, mode=mode)

    build.__doc__ = f"Prism with the structure signal in `{mode}` mode (`StructureRouter`)."
    return build


NAMES = {f"semantic-{mode}": mode for mode in MODES}
"""Each variant's policy name in the replay's results."""


def register() -> None:
    """Add the variants to `_ablations.VARIANTS`, where `_eval._policy` finds them by name; each process of a
    spawn pool must call it (its initializer), as a fresh interpreter starts without them."""
    for name, mode in NAMES.items():
        VARIANTS[name] = _factory(mode)


def at_level(args: tuple[str, str, int]) -> tuple[str, str, float, float, int, int]:
    """(workload, policy, KV hit rate, TTFT p99 ms, choices, changed choices) of one replay at `LEVEL`, as
    `_eval.replay` runs it but keeping the policy, to read how often the structure changed a choice."""
    trace, name, limit = args
    workload, _ = _workload(trace, 1, limit)
    nodes = cluster_for(trace, workload)
    policy = _policy(name, workload.block_tokens)
    classes = pool_classes(nodes)
    scaled = _scaled(workload, nodes, LEVEL)
    result = Simulation(scaled, policy, nodes, utilisation=LEVEL, seed=1, slo_s=lambda r: slo_s(r, classes)).run()
    routers = [r for r in getattr(policy, "routers", ()) if isinstance(r, StructureRouter)]
    decisions = sum(r.decisions for r in routers)
    changed = sum(r.changed for r in routers)
    return workload.name, name, result.kv_hit_rate, result.slices["all"].ttft_p99_ms, decisions, changed


def format_tables(rows: Sequence[Goodput], levels: Sequence[tuple[str, str, float, float, int, int]]) -> str:
    """Two Markdown tables. Goodput: per workload Prism's (utilisation at the SLO) and each variant's over it,
    with the geometric mean (a variant under the search's floor shows as a bound, as in `format_ablations`).
    At `LEVEL`: each policy's KV hit rate and TTFT p99, and the share of expected-TTFT choices the structure
    changed."""
    found = {(r.trace, r.policy): r for r in rows}
    traces = list(dict.fromkeys(r.trace for r in rows))
    ratios: dict[str, list[float]] = {n: [] for n in NAMES}
    bounded: set[str] = set()
    body = []
    for trace in traces:
        reference = found[(trace, PRISM)].utilisation
        cells = []
        for name in NAMES:
            load = found[(trace, name)].utilisation
            if reference <= 0:
                cells.append(MISSING)
                continue
            ratio = max(load, SEARCH_LOW) / reference
            ratios[name].append(ratio)
            if load <= 0:
                bounded.add(name)
            cells.append(f"< {ratio:.2f}" if load <= 0 else f"{ratio:.2f}")
        body.append([trace, format_pct(reference), *cells])
    means = []
    for name in NAMES:
        mean = geometric_mean(ratios[name])
        means.append(MISSING if mean is None else f"≤ {mean:.2f}" if name in bounded else f"{mean:.2f}")
    body.append(["geometric mean", "", *means])
    first = _md_table(["workload", "Prism goodput %", *(f"{n} / Prism" for n in NAMES)], body)
    by = {(w, n): (hit, p99, d, c) for w, n, hit, p99, d, c in levels}
    second_body = []
    for trace in traces:
        cells = [format_pct(by[(trace, PRISM)][0]), f"{by[(trace, PRISM)][1]:.0f}"]
        for name in NAMES:
            hit, p99, decisions, changed = by[(trace, name)]
            share = format_pct(changed / decisions) if decisions else MISSING
            cells += [format_pct(hit), f"{p99 / by[(trace, PRISM)][1]:.2f}", share]
        second_body.append([trace, *cells])
    header = ["workload", "prism KV hit %", "prism p99 ms"]
    for name in NAMES:
        header += [f"{name} KV hit %", f"{name} p99 / Prism", f"{name} changed %"]
    second = _md_table(header, second_body)
    heading = "Goodput (highest load with 90% of requests within their TTFT SLO):"
    return f"{heading}\n\n{first}\n\nAt {LEVEL:.0%} load:\n\n{second}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=2000, help="requests per workload (default 2000)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--workloads",
        default=",".join(f"{name}:1" for name in PRESETS),
        help="comma-separated workload families (default: every preset at seed 1)",
    )
    args = parser.parse_args()
    traces = [t.strip() for t in args.workloads.split(",") if t.strip()]
    register()
    started = time.monotonic()
    policies = [PRISM, *NAMES]
    with replay_pool(args.jobs, initializer=register) as pool:
        rows = goodput(traces, policies, seed=1, limit=args.limit, jobs=args.jobs, pool=pool)
        levels = pool.map(at_level, [(t, p, args.limit) for t in traces for p in policies])
    print(
        f"{args.limit} requests per workload, seed 1; cos/overlap weights "
        f"{STRUCTURE_WEIGHT}/{1 - STRUCTURE_WEIGHT:.1f}, "
        f"summary EWMA {SUMMARY_ALPHA}, {DIMS}-dim structure vectors, cache_affinity {Settings().cache_affinity}\n"
    )
    print(format_tables(rows, levels))
    print(f"\n{len(traces)} workloads × {len(policies)} policies in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
