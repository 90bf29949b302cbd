"""What LSTM-Attention earns in routing over an EWMA, once it is trained as a long-running brain's would be.

Run: .venv/bin/python bench/predictor_routing.py [--jobs 2] [--workload mooncake --workload tenants:1 ...]

`prism eval`'s replays last minutes of simulated time and their brains train 4 minibatches every 30 s, so its
predictor rarely trains enough to beat the EWMA and be chosen (docs/predictor.md): its `ewma` ablation cannot tell
what the model is worth in placement. A production brain trains on every control period and keeps its checkpoint
across restarts. So here each workload is first replayed `--history-runs` times with Prism at other seeds and loads
(the cluster's earlier traffic); the windows its brains observed are pooled, one per node and run, into one
predictor that trains `--steps` minibatches, and the held-out error of all four predictors is printed. Then three
brains serve the workload itself, each with latency weights (`BrainConfig.latency_weights`: the predictions reach
placement only through them; the library's default weighs health alone, docs/eval.md):

- `latency-weights`: the library's predictor (a cold predictor, trained online, the EWMA until a model beats it);
- `ewma`: the EWMA of each series' observed P99 always (`_ablations.ewma`);
- `lstm-attention`: the trained checkpoint loaded, LSTM-Attention forecasting every series that has its 16 windows
  of input whatever `best()` says, online training continuing.

Each is searched for goodput (as `prism eval --goodput`, on a sound cluster and under `_eval.gray_failure`) and
replayed whole at 80% and 95% load for TTFT p99, sound and degraded. Ratios are to `ewma`, measured in the same run.
A workload whose earlier runs leave no series long enough to train on (shorter than the models' input and the
held-out windows together) is reported as such and skipped.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from prismlb.brain import Brain, BrainConfig
from prismlb.brain._features import node_features
from prismlb.brain._predictor import Predictor
from prismlb.sim._ablations import VARIANTS, latency_weighted
from prismlb.sim._eval import SEARCH_LIMIT, Case, goodput, replay_pool, run_all, run_case
from prismlb.sim._prism import PrismPolicy
from prismlb.sim._report import geometric_mean

CHECKPOINT_VARIABLE = "PRISM_BENCH_PREDICTOR_CHECKPOINT"
"""The trained checkpoint's path, for the replay processes (spawned, so they see the environment, not this one's
objects)."""
WORKLOADS = ("mooncake", "azure-conv", "tenants:1", "sessions:1", "agentic:1", "rag:1", "bursty:2", "ramp:1", "mm")
HISTORY_LOADS = (0.5, 0.7, 0.9, 1.0, 0.6, 0.8)
"""The earlier runs' loads, in turn: the history spans quiet and saturated periods."""
P99_LOADS = (0.8, 0.95)
POLICIES = ("latency-weights", "ewma", "lstm-attention")

_recorded: list[tuple[str, list[float], dict[str, float | None]]] = []


class _RecordingBrain(Brain):
    """The default brain that also keeps every predictor window it observes, for the pooled history."""

    def observe_window(self) -> None:
        super().observe_window()
        for node_id, state in self.registry.nodes.items():
            _recorded.append((node_id, node_features(state.vector), self._series(state.vector)))


class _LstmAttentionPredictor(Predictor):
    """The predictor forecasting with LSTM-Attention whatever `best()` says (a series too short for the model's
    input still gets its EWMA, as in `Predictor.predict`)."""

    def predict(self, node_ids: Iterable[str], predictor: str | None = None) -> dict[str, dict[str, float | None]]:
        return super().predict(node_ids, "lstm_attention")


class _TrainedLstmAttentionBrain(Brain):
    """The brain with the bench's trained checkpoint in an `_LstmAttentionPredictor` (as `EwmaBrain` swaps in its
    predictor)."""

    def __init__(self, config: BrainConfig) -> None:
        super().__init__(config)
        self.predictor = _LstmAttentionPredictor()
        self.predictor.load(Path(os.environ[CHECKPOINT_VARIABLE]))


VARIANTS["lstm-attention"] = lambda tokens: PrismPolicy(
    block_tokens=tokens, brain=latency_weighted(_TrainedLstmAttentionBrain)
)
VARIANTS["recording"] = lambda tokens: PrismPolicy(block_tokens=tokens, brain=_RecordingBrain)


def history_trace(trace: str, run: int) -> str:
    """A family preset at another seed for each earlier run (the same trace where a name carries no seed)."""
    name, _, seed = trace.partition(":")
    return f"{name}:{int(seed) + 10 + run}" if seed else trace


def train(trace: str, runs: int, steps: int, limit: int | None, path: Path) -> str | None:
    """Replay `runs` earlier runs, pool their windows, train and checkpoint to `path`; the held-out errors as a
    line, or None when no series is long enough to train on."""
    predictor = Predictor()
    for run in range(runs):
        _recorded.clear()
        load = HISTORY_LOADS[run % len(HISTORY_LOADS)]
        run_case(Case(history_trace(trace, run), "recording", load, 100 + run, limit))
        for node_id, features, series in _recorded:
            predictor.observe(f"run{run}/{node_id}", features, series)
    if not predictor.train_step(math.inf, max_steps=steps):
        return None
    evaluation = predictor.evaluate()
    predictor.checkpoint(path)
    scores = ", ".join(f"{name} {score.mae_ms:,.0f}" for name, score in evaluation.scores.items())
    return f"held-out MAE ms: {scores} (best: {predictor.best()})"


def _ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}" if value > 0 and baseline > 0 else "–"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="replay processes")
    parser.add_argument("--workload", action="append", help=f"workloads (default: {', '.join(WORKLOADS)})")
    parser.add_argument("--history-runs", type=int, default=6, help="earlier runs pooled for training (default 6)")
    parser.add_argument("--steps", type=int, default=1500, help="minibatches of training (default 1500)")
    args = parser.parse_args()
    started = time.monotonic()
    header = (
        "| workload | measure | latency-weights | ewma | lstm-attention "
        "| latency-weights / ewma | lstm-attention / ewma |"
    )
    rows: list[str] = []
    ratios: dict[str, list[float]] = {"goodput": [], "goodput, gray": [], "p99": [], "p99, gray": []}
    with tempfile.TemporaryDirectory() as folder:
        for trace in args.workload or WORKLOADS:
            path = Path(folder, trace.replace(":", "-") + ".pt")
            trained = train(trace, args.history_runs, args.steps, None, path)
            if trained is None:
                print(f"{trace}: no series long enough to train on; skipped", flush=True)
                continue
            print(f"{trace}: {trained}", flush=True)
            os.environ[CHECKPOINT_VARIABLE] = str(path)
            measured: list[tuple[str, str, dict[str, float]]] = []  # (kind, measure, value by policy)
            with replay_pool(args.jobs) as pool:
                for degraded in (False, True):
                    suffix = ", gray" if degraded else ""
                    found = goodput([trace], POLICIES, seed=1, limit=SEARCH_LIMIT, pool=pool, degraded=degraded)
                    measured.append((f"goodput{suffix}", f"goodput{suffix}", {g.policy: g.utilisation for g in found}))
                    cases = [
                        Case(trace, policy, load, 1, None, degraded=degraded)
                        for load in P99_LOADS
                        for policy in POLICIES
                    ]
                    p99: dict[str, dict[str, float]] = {}
                    for case, result in zip(cases, run_all(cases, pool=pool), strict=True):
                        by_policy = p99.setdefault(f"p99 at {case.utilisation:.0%}{suffix}", {})
                        by_policy[case.policy] = result.slices["all"].ttft_p99_ms
                    measured += [(f"p99{suffix}", measure, by_policy) for measure, by_policy in p99.items()]
            for kind, measure, by_policy in measured:
                goodput_row = kind.startswith("goodput")
                cells = " | ".join(
                    f"{by_policy[p] * 100:,.0f}%" if goodput_row else f"{by_policy[p]:,.0f} ms" for p in POLICIES
                )
                base = by_policy["ewma"]
                rows.append(
                    f"| {trace} | {measure} | {cells} | {_ratio(by_policy['latency-weights'], base)} | "
                    f"{_ratio(by_policy['lstm-attention'], base)} |"
                )
                if by_policy["lstm-attention"] > 0 and base > 0:
                    ratios[kind].append(by_policy["lstm-attention"] / base)
            print("\n".join(rows[-len(measured) :]), flush=True)
    print(f"\n{header}\n|---|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows))
    print()
    for kind, values in ratios.items():
        if values:
            print(
                f"lstm-attention / ewma, {kind}: geometric mean {geometric_mean(values):.3f} "
                f"({min(values):.2f}–{max(values):.2f}, {len(values)} cells)"
            )
    print(f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
