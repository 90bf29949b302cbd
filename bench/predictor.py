"""Tail-latency predictor: accuracy of the four predictors on node vectors replayed from real traces, and batched
inference time for 1,000 nodes.

Run: .venv/bin/python bench/predictor.py [--steps 3000] [--nodes 8]
Accuracy: each trace is replayed over `--nodes` nodes in 5 s windows (`prismlb.sim._trace_replay`, a
trace-driven queueing approximation); both models train on the first 60% of the windows for `--steps`
minibatches and all four predictors are scored on the held-out last 40%, the same windows for each.
Baseline (same run): EWMA (α = 0.5, the predictor's default); the best α of a sweep on the held-out windows
themselves is printed too, as the strongest EWMA possible.
Inference: one `predict` call for 1,000 nodes (one series of 16 windows each), one torch thread, best of 5 repeats.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from prismlb.brain._features import NODE_FEATURES, series_p99_ms
from prismlb.brain._predictor import PREDICTORS, Lstm, LstmAttention, Predictor, PredictorConfig, parameter_count
from prismlb.semantics import ENGINE_LATENCY_KEY
from prismlb.sim._trace_replay import (
    AZURE_CONV,
    MOONCAKE_CONVERSATION,
    ReplayConfig,
    TraceRequest,
    read_azure,
    read_mooncake,
    replay,
)
from prismlb.wire import NodeVector

TRACES: dict[str, Callable[[], list[TraceRequest]]] = {
    "Mooncake conversation (12,031 requests)": lambda: read_mooncake(MOONCAKE_CONVERSATION),
    "Azure LLM inference conv (19,366 requests)": lambda: read_azure(AZURE_CONV),
}
HELD_OUT = 0.4


def ewma_sweep(windows: list[list[NodeVector]], config: PredictorConfig) -> tuple[float, float]:
    """(α, MAE ms) of the best EWMA on the predictor's held-out windows, over every series of every node."""
    best = (0.0, float("inf"))
    for alpha in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        errors = []
        for node in range(len(windows[0])):
            ewma: dict[str, float] = {}
            for t, window in enumerate(windows):
                for key, p99 in series_p99_ms(window[node]).items():
                    if p99 is None:
                        continue
                    before = ewma.get(key)
                    if before is not None and t >= max(config.steps, len(windows) - config.holdout):
                        errors.append(abs(p99 - before))
                    ewma[key] = p99 if before is None else alpha * p99 + (1.0 - alpha) * before
        mae = sum(errors) / len(errors)
        if mae < best[1]:
            best = (alpha, mae)
    return best


def accuracy(name: str, requests: list[TraceRequest], nodes: int, steps: int) -> None:
    windows = replay(requests, ReplayConfig(nodes=nodes))
    config = PredictorConfig(history=len(windows), holdout=int(HELD_OUT * len(windows)))
    predictor = Predictor(config)
    for window in windows:
        for vector in window:
            predictor.observe_vector(vector)
    started = time.thread_time()
    predictor.train_step(float("inf"), max_steps=steps)
    trained_s = time.thread_time() - started
    evaluation = predictor.evaluate()
    print(
        f"\n{name}: {nodes} nodes × {len(windows)} windows of 5 s; trained {steps} steps "
        f"({trained_s:.0f} s CPU, one thread) on the first {len(windows) - config.holdout} windows; "
        f"{evaluation.samples} held-out targets"
    )
    print(f"{'predictor':<16} {'MAE ms':>9} {'P99 |err| ms':>13} {'× EWMA':>7}")
    for predictor_name in PREDICTORS:
        score = evaluation.scores[predictor_name]
        print(
            f"{predictor_name:<16} {score.mae_ms:>9.1f} {score.p99_abs_error_ms:>13.1f} "
            f"{evaluation.ratio_to_ewma(predictor_name):>7.3f}"
        )
    alpha, mae = ewma_sweep(windows, config)
    print(
        f"best(): {evaluation.best}; strongest EWMA on these windows: α = {alpha:.1f}, MAE {mae:.1f} ms, "
        f"LSTM-Attention × it = {evaluation.scores['lstm_attention'].mae_ms / mae:.3f}"
    )


def inference(nodes: int = 1000, repeats: int = 20) -> None:
    torch.set_num_threads(1)
    predictor = Predictor()
    generator = torch.Generator().manual_seed(0)
    ids = [f"node-{n}" for n in range(nodes)]
    for _ in range(predictor.config.steps):
        rows = torch.rand(nodes, len(NODE_FEATURES) + 1, generator=generator).tolist()
        for node_id, row in zip(ids, rows, strict=True):
            predictor.observe(node_id, row[:-1], {ENGINE_LATENCY_KEY: 1000.0 * row[-1]})
    print(f"\nInference: one predict() for {nodes:,} nodes × {predictor.config.steps} windows, one torch thread")
    print(f"{'predictor':<16} {'ms / batch':>11} {'µs / node':>10} {'× EWMA':>8}")
    times = {}
    for name in PREDICTORS:
        predictor.predict(ids, name)
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(repeats):
                predictor.predict(ids, name)
            best = min(best, (time.perf_counter() - started) / repeats)
        times[name] = best
    for name in PREDICTORS:
        seconds = times[name]
        print(f"{name:<16} {1e3 * seconds:>11.2f} {1e6 * seconds / nodes:>10.2f} {seconds / times['ewma']:>7.0f}×")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="training minibatches per trace")
    parser.add_argument("--nodes", type=int, default=8, help="simulated nodes per trace")
    args = parser.parse_args()
    print(
        f"Parameters: LSTM-Attention {parameter_count(LstmAttention()):,}, LSTM alone {parameter_count(Lstm()):,} "
        "(design: 127K and 118K)"
    )
    for name, read in TRACES.items():
        accuracy(name, read(), args.nodes, args.steps)
    inference()


if __name__ == "__main__":
    main()
