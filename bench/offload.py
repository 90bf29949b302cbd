"""Gradient-aware offload bandwidth against static schedules, on a real torch model's gradients.

Run: .venv/bin/python bench/offload.py [--steps 20] [--link-gbps 31.5] [--quick]

A small causal transformer (embedding, `--blocks` encoder blocks, final norm, output head; one torch thread,
CPU) trains on next-token prediction over a seeded bigram source. `GradientMonitor` measures every layer's
gradient in every step; after each backward, the step's gradients are offloaded over `EmulatedLink`, an
emulated link (a token bucket at PCIe 4.0 x16 rate by default, the host link of an 8×A100 server) in
simulated time, under three schedules, same bytes, same step:

- static equal share: every layer's transfer limited to capacity / layers (fixed queue-pair rate limits);
- static FIFO: one layer at a time at the full link, in the order backward made the gradients ready;
- gradient-aware: `BandwidthScheduler` with the change rates measured up to the step before.

Gradient sync latency: from the end of backward until the urgent layers' gradients (the scheduler's urgent
class, the same layers for every schedule) are on the host, and until all are. Link utilisation: bytes moved /
(capacity × time until all are). The first two steps only measure (a change rate needs two densities).
The design's figures (8×A100, real PCIe) are printed beside Prism's; the ratios compare.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from prismlb.agent._gpu import PCIE_GBPS_PER_LANE
from prismlb.otel import (
    CHUNK_BYTES,
    BandwidthScheduler,
    EmulatedLink,
    GradientMonitor,
    LayerGradient,
    LinkPolicy,
    LinkRun,
    Transfer,
    fifo,
    static_equal_share,
)

SCHEDULES = ("static equal share", "static FIFO", "gradient-aware")
BASELINES = SCHEDULES[:2]
WARMUP_STEPS = 2
PCIE4_X16_GBPS = PCIE_GBPS_PER_LANE[4] * 16
ARTICLE_SYNC_MS = (42.3, 18.7)
"""The design's gradient sync latency, static → gradient-aware (8×A100)."""
ARTICLE_UTILISATION = (0.51, 0.79)
"""The design's PCIe utilisation, static → gradient-aware (8×A100)."""


@dataclass(frozen=True)
class Shape:
    """The model and batch sizes."""

    vocab: int
    dim: int
    heads: int
    blocks: int
    ff: int
    batch: int
    seq: int


FULL = Shape(vocab=1024, dim=256, heads=4, blocks=4, ff=1024, batch=8, seq=64)
QUICK = Shape(vocab=256, dim=64, heads=2, blocks=2, ff=256, batch=4, seq=32)
GPU_SHAPE = Shape(vocab=32000, dim=1024, heads=16, blocks=4, ff=4096, batch=8, seq=256)
"""bench/gpu_check.py's size: about 440 MiB of gradients per step, 57% of them the embedding's and the head's."""


class TinyLM(nn.Module):
    """Embedding → causal transformer blocks → norm → output head; no positions (the bigram needs none)."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(shape.dim, shape.heads, shape.ff, dropout=0.0, batch_first=True)
            for _ in range(shape.blocks)
        )
        self.norm = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


class BigramSource:
    """Token sequences where each token is followed by one of 4 fixed successors: learnable, seeded."""

    def __init__(self, shape: Shape, seed: int, device: str) -> None:
        self.shape = shape
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, shape.vocab, (shape.vocab, 4), generator=self.generator)

    def batch(self) -> torch.Tensor:
        rows, length = self.shape.batch, self.shape.seq + 1
        tokens = torch.empty(rows, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.shape.vocab, (rows,), generator=self.generator)
        for i in range(1, length):
            pick = torch.randint(0, 4, (rows,), generator=self.generator)
            tokens[:, i] = self.successors[tokens[:, i - 1], pick]
        return tokens.to(self.device)


OnGradients = Callable[[int, Sequence[LayerGradient], Mapping[str, float], nn.Module], None]


def train(shape: Shape, steps: int, on_gradients: OnGradients, *, seed: int = 0, device: str = "cpu") -> list[float]:
    """`steps` AdamW steps; after each backward (gradients still in `.grad`), `on_gradients(step, layers, the
    change rates known before this step, model)`. The losses."""
    torch.manual_seed(seed)
    model = TinyLM(shape).to(device)
    source = BigramSource(shape, seed + 1, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with GradientMonitor(model) as monitor:
        for step in range(steps):
            rates = monitor.change_rates()
            tokens = source.batch()
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, shape.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            layers = monitor.step()
            on_gradients(step, layers, rates, model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    return losses


@dataclass(frozen=True)
class StepResult:
    """One step's offload under every schedule."""

    step: int
    urgent: tuple[str, ...]
    urgent_bytes: int
    total_bytes: int
    runs: Mapping[str, LinkRun]

    def urgent_s(self, schedule: str) -> float:
        return self.runs[schedule].completed_by(self.urgent)


def policies(capacity: float, layers: Sequence[LayerGradient], rates: Mapping[str, float]) -> dict[str, LinkPolicy]:
    ready = [layer.name for layer in sorted(layers, key=lambda layer: layer.ready_order)]
    return {
        "static equal share": static_equal_share(capacity, len(layers)),
        "static FIFO": fifo(capacity, ready),
        "gradient-aware": BandwidthScheduler(capacity).policy(rates),
    }


def offload(
    step: int,
    layers: Sequence[LayerGradient],
    rates: Mapping[str, float],
    link: EmulatedLink,
    send: Callable[[Transfer, int, int], None] | None = None,
) -> StepResult:
    """The step's gradients over `link` under every schedule, in the order backward made them ready."""
    ordered = sorted(layers, key=lambda layer: layer.ready_order)
    transfers = [Transfer(layer.name, layer.grad_bytes) for layer in ordered]
    urgent = BandwidthScheduler(link.capacity_bytes_per_s).urgent_layers(rates)
    runs = {
        name: link.run(transfers, policy, send)
        for name, policy in policies(link.capacity_bytes_per_s, ordered, rates).items()
    }
    sizes = {layer.name: layer.grad_bytes for layer in layers}
    return StepResult(step, urgent, sum(sizes.get(name, 0) for name in urgent), sum(sizes.values()), runs)


@dataclass(frozen=True)
class Summary:
    """Means over the measured steps for one schedule."""

    urgent_ms: float
    all_ms: float
    utilisation: float


def summarise(results: Sequence[StepResult]) -> dict[str, Summary]:
    return {
        schedule: Summary(
            statistics.fmean(result.urgent_s(schedule) * 1e3 for result in results),
            statistics.fmean(result.runs[schedule].elapsed_s * 1e3 for result in results),
            statistics.fmean(result.runs[schedule].utilisation for result in results),
        )
        for schedule in SCHEDULES
    }


def table(results: Sequence[StepResult], unit: str = "ms") -> list[str]:
    """Markdown: each schedule's means, its ratios to each static baseline, then the design's figures."""
    summary = summarise(results)
    scale = {"ms": 1.0, "µs": 1e3}[unit]
    rows = [
        f"| schedule | urgent sync {unit} | all sync {unit} | link utilisation | urgent sync / equal | all sync / equal"
        " | utilisation / equal | urgent sync / FIFO | all sync / FIFO | utilisation / FIFO |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for schedule in SCHEDULES:
        mine = summary[schedule]
        cells = [schedule, f"{mine.urgent_ms * scale:.3f}", f"{mine.all_ms * scale:.3f}", f"{mine.utilisation:.1%}"]
        for baseline in BASELINES:
            base = summary[baseline]
            cells += [
                _ratio(mine.urgent_ms, base.urgent_ms),
                _ratio(mine.all_ms, base.all_ms),
                _ratio(mine.utilisation, base.utilisation),
            ]
        rows.append("| " + " | ".join(cells) + " |")
    aware = summary["gradient-aware"]
    rows += [
        "",
        "| measure | design: static → gradient-aware (8×A100) | ratio "
        "| Prism: static equal share → gradient-aware | ratio | Prism: static FIFO → gradient-aware | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    before, after = ARTICLE_SYNC_MS
    for label, pick in (("gradient sync, urgent layers", "urgent_ms"), ("gradient sync, all layers", "all_ms")):
        cells = [label, f"{before} → {after} ms", _ratio(after, before)]
        for baseline in BASELINES:
            old, new = getattr(summary[baseline], pick) * scale, getattr(aware, pick) * scale
            cells += [f"{old:.3f} → {new:.3f} {unit}", _ratio(new, old)]
        rows.append("| " + " | ".join(cells) + " |")
    before, after = ARTICLE_UTILISATION
    cells = ["link utilisation", f"{before:.0%} → {after:.0%}", _ratio(after, before)]
    for baseline in BASELINES:
        old = summary[baseline].utilisation
        cells += [f"{old:.1%} → {aware.utilisation:.1%}", _ratio(aware.utilisation, old)]
    rows.append("| " + " | ".join(cells) + " |")
    return rows


def _ratio(new: float, old: float) -> str:
    return f"{new / old:.2f}" if old > 0 else "n/a"


def layer_lines(results: Sequence[StepResult], shape: Shape) -> list[str]:
    """Which layers were urgent how often, and the bytes they held."""
    counts: dict[str, int] = {}
    for result in results:
        for name in result.urgent:
            counts[name] = counts.get(name, 0) + 1
    share = statistics.fmean(result.urgent_bytes / result.total_bytes for result in results)
    ranked = ", ".join(
        f"{name} {count}/{len(results)}" for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    layers = len(results[0].runs["static FIFO"].completed_s)
    return [
        f"model: vocab {shape.vocab}, dim {shape.dim}, {shape.blocks} blocks, ff {shape.ff}; "
        f"{results[0].total_bytes / 2**20:.2f} MiB of gradients per step in {layers} layers",
        f"urgent layers (steps urgent / measured steps): {ranked or 'none'}",
        f"urgent layers' share of the step's gradient bytes: {share:.1%} on average",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (the first two only measure)")
    parser.add_argument("--link-gbps", type=float, default=PCIE4_X16_GBPS, help="emulated link, GB/s")
    parser.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help="the link's chunk size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smaller model and 5 steps (for the tests)")
    args = parser.parse_args(argv)
    shape, steps = (QUICK, 5) if args.quick else (FULL, args.steps)
    if steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than {WARMUP_STEPS}")
    torch.set_num_threads(1)
    link = EmulatedLink(args.link_gbps * 1e9, chunk_bytes=args.chunk_bytes)
    results: list[StepResult] = []

    def on_gradients(step: int, layers: Sequence[LayerGradient], rates: Mapping[str, float], _: nn.Module) -> None:
        if step >= WARMUP_STEPS:
            results.append(offload(step, layers, rates, link))

    started = time.perf_counter()
    losses = train(shape, steps, on_gradients, seed=args.seed)
    print(f"emulated link (token bucket, simulated time): {args.link_gbps:.1f} GB/s, {args.chunk_bytes} B chunks")
    print(*layer_lines(results, shape), sep="\n")
    print(f"loss {losses[0]:.3f} → {losses[-1]:.3f} over {steps} steps; means over the last {len(results)} steps")
    print()
    print(*table(results, "µs"), sep="\n")
    print(f"\ndone in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
