"""Cross-zone failover: LocalFirst, spread by capacity, the PPO teacher and the distilled student in the zone
simulator's evaluation scenarios.

Run: .venv/bin/python bench/failover.py [--seeds 5] [--model PATH | --teacher-steps N] [--quick]

Without `--model`, trains first (`prismlb.sim._failover_train.train`, one torch thread, a few minutes) and
evaluates the teacher too; with it, the student in the file only. Every policy runs the same fixed scenarios
(`prismlb.sim._zones.EVALUATION`: outage of the largest zone, brownout, surge, calm; 60 s each, on a 3-zone
cluster drawn from the seed) for seeds 0..N-1:

- LocalFirst: the rule, zone-local first, health-based failover (the baseline);
- spread by capacity: every caller's traffic over all zones by healthy capacity (a zone-blind balancer);
- teacher: the PPO teacher's most likely level;
- student: `FailoverScheduler` with the student's file, as the brain runs it (rule fallbacks included and
  counted).

Recovery after a zone outage: from the outage's start until the failed share is under 1% and the P99 under
200 ms for 2 s straight (an episode that never gets there counts the rest of the episode, 40 s). Cross-zone
share, P99 and failed share are over every request of an episode; the table's are means over episodes (all
scenarios), the reward the mean step reward. The student's inference cost: `FailoverScheduler.split` on 3
zones' observations, wall time per call. The design's figures are printed beside Prism's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prismlb.brain._failover import (
    FailoverScheduler,
    LocalFirst,
    SplitPolicy,
    SpreadByCapacity,
    ZoneObservation,
    ZoneSplit,
)
from prismlb.semantics import quantile
from prismlb.sim._failover_train import TeacherPolicy, train
from prismlb.sim._zones import EVALUATION, STEP_S, EpisodeMetrics, ZoneSim, evaluation_scenario, run_episode

DESIGN_RECOVERY_S = (8.2, 1.7)
"""The design's cross-zone recovery time, rule-based -> learned scheduler."""
DESIGN_CROSS_ZONE = (0.32, 0.19)
"""The design's cross-zone traffic share, rule-based -> learned scheduler."""
BASELINE = "LocalFirst"
QUICK_TEACHER_STEPS = 400


class Scheduled:
    """The student as the brain runs it: a FailoverScheduler whose clock is the simulator's."""

    def __init__(self, path: Path) -> None:
        self.scheduler = FailoverScheduler(path)
        self._now = 0.0

    def split(self, zones: Sequence[ZoneObservation], previous: ZoneSplit) -> ZoneSplit:
        self._now += STEP_S
        return self.scheduler.split(zones, self._now)


@dataclass(frozen=True)
class Summary:
    """One policy over every episode."""

    recovery_mean_s: float
    recovery_p95_s: float
    unrecovered: int
    outages: int
    cross_zone: float
    p99_ms: float
    failed: float
    reward: float


def summarise(episodes: Sequence[EpisodeMetrics]) -> Summary:
    recoveries = sorted(m.recovery_s for m in episodes if m.recovery_s is not None)
    return Summary(
        recovery_mean_s=statistics.fmean(recoveries) if recoveries else float("nan"),
        recovery_p95_s=quantile(recoveries, 0.95, ordered=True),
        unrecovered=sum(1 for m in episodes if m.recovery_s is not None and not m.recovered),
        outages=len(recoveries),
        cross_zone=statistics.fmean(m.cross_zone_share for m in episodes),
        p99_ms=statistics.fmean(m.p99_ms for m in episodes),
        failed=statistics.fmean(m.failed_share for m in episodes),
        reward=statistics.fmean(m.mean_reward for m in episodes),
    )


def evaluate(policies: dict[str, Callable[[], SplitPolicy]], seeds: int) -> dict[str, list[EpisodeMetrics]]:
    """Every policy (a fresh one per episode) on every evaluation scenario and seed."""
    return {
        name: [
            run_episode(evaluation_scenario(scenario, seed), make()) for scenario in EVALUATION for seed in range(seeds)
        ]
        for name, make in policies.items()
    }


def _ratio(new: float, old: float) -> str:
    return f"{new / old:.2f}" if old > 0 else "n/a"


def table(results: dict[str, list[EpisodeMetrics]]) -> list[str]:
    """Markdown: each policy's summary and its ratios to LocalFirst."""
    base = summarise(results[BASELINE])
    rows = [
        "| policy | recovery mean s | recovery p95 s | not recovered | cross-zone share | P99 ms | failed share "
        "| mean reward | recovery / LocalFirst | cross-zone / LocalFirst | P99 / LocalFirst | failed / LocalFirst |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, episodes in results.items():
        s = summarise(episodes)
        rows.append(
            f"| {name} | {s.recovery_mean_s:.2f} | {s.recovery_p95_s:.2f} | {s.unrecovered}/{s.outages} "
            f"| {s.cross_zone:.1%} | {s.p99_ms:.0f} | {s.failed:.3%} | {s.reward:.3f} "
            f"| {_ratio(s.recovery_mean_s, base.recovery_mean_s)} | {_ratio(s.cross_zone, base.cross_zone)} "
            f"| {_ratio(s.p99_ms, base.p99_ms)} | {_ratio(s.failed, base.failed)} |"
        )
    return rows


def scenario_table(results: dict[str, list[EpisodeMetrics]]) -> list[str]:
    """Markdown: per scenario and policy, the means over seeds."""
    rows = [
        "| scenario | policy | recovery mean s | cross-zone share | P99 ms | failed share | mean reward |",
        "|---|---|---|---|---|---|---|",
    ]
    for scenario in EVALUATION:
        for name, episodes in results.items():
            s = summarise([m for m in episodes if m.scenario == scenario])
            recovery = f"{s.recovery_mean_s:.2f}" if s.outages else "-"
            rows.append(
                f"| {scenario} | {name} | {recovery} | {s.cross_zone:.1%} | {s.p99_ms:.0f} | {s.failed:.3%} "
                f"| {s.reward:.3f} |"
            )
    return rows


def verdict(results: dict[str, list[EpisodeMetrics]], name: str) -> list[str]:
    """Where `name` beats LocalFirst and where it does not, metric by metric (lower is better but reward)."""
    mine, base = summarise(results[name]), summarise(results[BASELINE])
    lines = []
    for label, new, old, higher_better in (
        ("recovery after a zone outage (mean)", mine.recovery_mean_s, base.recovery_mean_s, False),
        ("cross-zone traffic share", mine.cross_zone, base.cross_zone, False),
        ("P99", mine.p99_ms, base.p99_ms, False),
        ("failed share", mine.failed, base.failed, False),
        ("mean reward", mine.reward, base.reward, True),
    ):
        better = new > old if higher_better else new < old
        word = "better than" if better else ("same as" if new == old else "NOT better than")
        lines.append(f"{name} {word} LocalFirst on {label}: {new:.4g} vs {old:.4g}")
    return lines


def design_lines(results: dict[str, list[EpisodeMetrics]]) -> list[str]:
    base, student = summarise(results[BASELINE]), summarise(results["student"])
    return [
        "| measure | design: rule -> learned | ratio | Prism: LocalFirst -> student | ratio |",
        "|---|---|---|---|---|",
        f"| cross-zone recovery | {DESIGN_RECOVERY_S[0]} -> {DESIGN_RECOVERY_S[1]} s "
        f"| {_ratio(DESIGN_RECOVERY_S[1], DESIGN_RECOVERY_S[0])} "
        f"| {base.recovery_mean_s:.2f} -> {student.recovery_mean_s:.2f} s "
        f"| {_ratio(student.recovery_mean_s, base.recovery_mean_s)} |",
        f"| cross-zone traffic | {DESIGN_CROSS_ZONE[0]:.0%} -> {DESIGN_CROSS_ZONE[1]:.0%} "
        f"| {_ratio(DESIGN_CROSS_ZONE[1], DESIGN_CROSS_ZONE[0])} "
        f"| {base.cross_zone:.1%} -> {student.cross_zone:.1%} | {_ratio(student.cross_zone, base.cross_zone)} |",
    ]


def inference_cost(path: Path, calls: int) -> tuple[float, float, str]:
    """Microseconds per FailoverScheduler.split on 3 zones (mean, P99) over a calm episode's observations,
    and which decider answered."""
    sim = ZoneSim(evaluation_scenario("calm", 0))
    observations = []
    while not sim.done():
        observations.append(sim.observations())
        sim.step(LocalFirst().split(observations[-1], {}))
    scheduler = FailoverScheduler(path)
    times = []
    for i in range(calls):
        zones = observations[i % len(observations)]
        started = time.perf_counter()
        scheduler.split(zones, i * STEP_S)
        times.append((time.perf_counter() - started) * 1e6)
    sources = ", ".join(f"{k} {v}" for k, v in scheduler.counts.items() if v)
    return statistics.fmean(times), quantile(times, 0.99), sources


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per evaluation scenario (at least 1)")
    parser.add_argument("--model", type=Path, help="a trained student file; without it the bench trains one")
    parser.add_argument("--teacher-steps", type=int, help="PPO simulator steps when training (default: the trainer's)")
    parser.add_argument("--seed", type=int, default=0, help="training seed")
    parser.add_argument("--out", type=Path, help="where to write the trained student (default: a temporary file)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_TEACHER_STEPS} teacher steps and 2 seeds")
    args = parser.parse_args(argv)
    seeds = 2 if args.quick else args.seeds
    if seeds < 1:
        parser.error("--seeds must be at least 1")
    started = time.perf_counter()
    policies: dict[str, Callable[[], SplitPolicy]] = {BASELINE: LocalFirst, "spread by capacity": SpreadByCapacity}
    with tempfile.TemporaryDirectory() as scratch:
        path = args.model
        if path is None:
            path = args.out or Path(scratch) / "failover.pt"
            steps = QUICK_TEACHER_STEPS if args.quick else args.teacher_steps
            trained = train(path, seed=args.seed, teacher_steps=steps, log=lambda line: print(line, file=sys.stderr))
            report = trained.report
            print(
                f"trained: {report.teacher_steps} teacher steps, KL {report.kl_initial:.3f} -> {report.kl_final:.4f}"
                f" on {report.distill_states} states, {report.seconds:.0f} s; held-out mean step reward: teacher "
                f"{report.teacher_reward:.3f}, student {report.student_reward:.3f}, LocalFirst {report.rule_reward:.3f}"
            )
            network = trained.teacher
            policies["teacher"] = lambda: TeacherPolicy(network)
        else:
            print(f"model: {path} (no teacher in the file: the teacher row is left out)")
        model = path
        schedulers: list[Scheduled] = []

        def student() -> SplitPolicy:
            schedulers.append(Scheduled(model))
            return schedulers[-1]

        policies["student"] = student
        results = evaluate(policies, seeds)
        fallbacks = {k: sum(s.scheduler.counts[k] for s in schedulers) for k in schedulers[0].scheduler.counts}
        mean_us, p99_us, sources = inference_cost(model, 300 if args.quick else 3000)
    print(f"\n{len(EVALUATION)} scenarios ({', '.join(EVALUATION)}) x {seeds} seeds, 60 s each, brain cycle {STEP_S} s")
    print(*table(results), sep="\n")
    print()
    print(*scenario_table(results), sep="\n")
    print()
    print(*design_lines(results), sep="\n")
    print()
    print(*verdict(results, "student"), sep="\n")
    print("student decisions: " + ", ".join(f"{k} {v}" for k, v in fallbacks.items() if v))
    print(
        f"student inference (FailoverScheduler.split, 3 zones): {mean_us:.0f} µs mean, {p99_us:.0f} µs P99 ({sources})"
    )
    print(f"\ndone in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
