"""`prism train`: build the models Prism runs from what the command does, never from a committed blob alone."""

from __future__ import annotations

import argparse
from pathlib import Path

from prismlb.service import whole_number_at_least


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model Prism runs (failover: the brain's cross-zone failover student)",
        description="Train a model Prism runs. failover: a PPO teacher in the zone simulator with the design's "
        "reward, distilled into the small LSTM student the brain loads (--failover-model) and reloads on its "
        "schedule.",
    )
    p.add_argument("model", choices=["failover"], help="which model")
    p.add_argument("--out", type=Path, required=True, help="where to write it (replaced atomically)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    p.add_argument(
        "--teacher-steps",
        type=whole_number_at_least(1, "must be at least 1, got {value}"),
        default=None,
        help="environment steps of teacher training (default: the trainer's full budget)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from prismlb.sim import train_failover  # torch and the simulator load only for this command

    train_failover(args.out, seed=args.seed, teacher_steps=args.teacher_steps)  # logs what it measured
    return 0
