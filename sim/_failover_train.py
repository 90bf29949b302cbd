"""Training the cross-zone failover student: a PPO teacher in the zone simulator, distilled into a small LSTM.

Teacher: PPO over the discrete LEVELS (the local share per caller zone), an MLP (2 × 64, tanh) over the last
TEACHER_FRAMES cycles' features, with a separate value MLP. PPO rather than DQN: the action is categorical
and the student is distilled from the teacher's action distribution, which PPO has by construction (DQN's
Q-values would need a temperature to become one); the reward is dense and every caller zone acts each cycle,
so on-policy batches fill quickly; and clipped updates stay stable with the -5 failure spikes that would make
Q-targets swing. The teacher starts from the rule's behaviour (a few epochs of cross-entropy on LocalFirst's
choices, rounded to the nearest level), so the minutes on one core go to improving on the rule rather than
rediscovering zone-local routing. Each caller zone is one agent of the shared network; its reward is the
reward's formula (`_zones.reward`) over its own callers' requests, with the cluster's imbalance term
(`StepOutcome.caller_reward`): the step's reward alone, shared by every agent, left the one decision that failed
its zone's requests lost in the others' noise (measured: a teacher on the shared reward ended below the rule).
Rewards are divided by REWARD_SCALE for the value function; advantages by GAE (γ 0.97, λ 0.95: a horizon of
about 6 s, longer than an outage takes to show).

Student: `StudentNetwork` (LSTM, hidden 32, over HISTORY cycles -> logits over LEVELS), distilled by minimising
KL(teacher || student) on states from DAgger rounds: the first round's states come from the teacher acting,
later rounds' from a mix where each cycle the teacher acts with probability β (1/2, 1/4, ...) and the student
otherwise, so the data covers the states the student's own mistakes lead to. The teacher labels every state.
The KL before and after distillation is measured on states of the final student's own rollouts, held out.

Held out: episodes of seeds never trained on score the teacher (its mode), the student and LocalFirst by the
mean step reward.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from prismlb.brain._failover import (
    FEATURES,
    HISTORY,
    LEVELS,
    FeatureHistory,
    LocalFirst,
    SplitPolicy,
    StudentNetwork,
    StudentPolicy,
    ZoneObservation,
    ZoneSplit,
    features,
    local_share,
    save_student,
    split_from_local,
)

from ._zones import StepOutcome, ZoneSim, random_scenario

TEACHER_FRAMES = 4
"""Cycles the teacher sees: 0.8 s, enough to see an outage's nodes go stale one after another."""
DEFAULT_TEACHER_STEPS = 120_000
"""Simulator steps of PPO by default: about 2.5 minutes of one core, all stages included."""
EPISODE_S = 40.0
REWARD_SCALE = 5.0
GAMMA = 0.97
LAMBDA = 0.95
ROLLOUT_AGENT_STEPS = 3000
PPO_EPOCHS = 4
MINIBATCH = 256
CLIP = 0.2
ENTROPY = 0.003
HELD_OUT_SEED = 1_000_000
"""Held-out episodes' seeds start here (training draws below it)."""
LEVEL_VALUES = np.asarray(LEVELS)

Actor = Callable[[np.ndarray], np.ndarray]
"""Windows (callers, HISTORY, FEATURES) -> a level index per caller."""


class TeacherNetwork(nn.Module):
    """Policy MLP and value MLP over the last TEACHER_FRAMES cycles' features."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        width = TEACHER_FRAMES * FEATURES
        self.policy = nn.Sequential(
            nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, len(LEVELS))
        )
        self.value = nn.Sequential(
            nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, TEACHER_FRAMES × FEATURES) -> logits (batch, len(LEVELS)), value (batch,)."""
        return self.policy(x), self.value(x)[:, 0]


def teacher_input(windows: np.ndarray) -> torch.Tensor:
    """The teacher's input from student windows: the last TEACHER_FRAMES frames, flattened."""
    return torch.from_numpy(windows[:, -TEACHER_FRAMES:, :].reshape(len(windows), -1)).float()


class TeacherPolicy:
    """The teacher as a SplitPolicy: its most likely level per caller zone."""

    def __init__(self, network: TeacherNetwork) -> None:
        self.network = network
        self._history = FeatureHistory(HISTORY)

    def split(self, zones: Sequence[ZoneObservation], previous: ZoneSplit) -> ZoneSplit:
        windows = _windows(self._history, zones, previous)
        with torch.inference_mode():
            choice = self.network(teacher_input(windows))[0].argmax(dim=1).numpy()
        return _split(zones, choice)


def _windows(history: FeatureHistory, zones: Sequence[ZoneObservation], previous: ZoneSplit) -> np.ndarray:
    callers = [z.zone for z in zones]
    history.retain(callers)
    return np.stack([history.push(c, features(c, zones, local_share(previous, c))) for c in callers])


def _split(zones: Sequence[ZoneObservation], choice: np.ndarray) -> ZoneSplit:
    return {z.zone: split_from_local(z.zone, LEVELS[int(i)], zones) for z, i in zip(zones, choice, strict=True)}


def nearest_level(share: float) -> int:
    return int(np.abs(LEVEL_VALUES - share).argmin())


@dataclass
class Episode:
    """One episode's record: per step, every caller's window and level, and the rewards."""

    windows: list[np.ndarray] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)
    rewards: list[np.ndarray] = field(default_factory=list)
    """Per step, per caller: the training reward (the reward's formula over the caller's own requests)."""
    step_rewards: list[float] = field(default_factory=list)
    extras: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    """PPO's (log-probability, value) per step, when the actor gives them."""


class Ranges:
    """The lowest and highest value of every feature seen."""

    def __init__(self) -> None:
        self.low = np.full(FEATURES, np.inf)
        self.high = np.full(FEATURES, -np.inf)

    def add(self, windows: np.ndarray) -> None:
        last = windows[:, -1, :]
        self.low = np.minimum(self.low, last.min(axis=0))
        self.high = np.maximum(self.high, last.max(axis=0))

    def array(self) -> np.ndarray:
        return np.stack([self.low, self.high])


def run(seed: int, actor: Callable[[np.ndarray, Sequence[ZoneObservation]], np.ndarray], ranges: Ranges) -> Episode:
    """One training episode of `random_scenario(seed)`: `actor(windows, zones)` picks a level per caller."""
    sim = ZoneSim(random_scenario(seed, EPISODE_S))
    history = FeatureHistory(HISTORY)
    previous: ZoneSplit = {}
    episode = Episode()
    while not sim.done():
        zones = sim.observations()
        windows = _windows(history, zones, previous)
        ranges.add(windows)
        choice = actor(windows, zones)
        previous = _split(zones, choice)
        outcome: StepOutcome = sim.step(previous)
        episode.windows.append(windows)
        episode.actions.append(choice)
        episode.rewards.append(outcome.caller_reward)
        episode.step_rewards.append(outcome.reward)
    return episode


@dataclass(frozen=True)
class _Training:
    """What every stage of one training run draws on: its generator (episode seeds come from it too, so the run's
    seed fixes them all), the feature ranges every training episode widens, and the progress log."""

    rng: np.random.Generator
    ranges: Ranges
    log: Callable[[str], None]

    def next_seed(self) -> int:
        """A training episode's seed, below the held-out ones."""
        return int(self.rng.integers(HELD_OUT_SEED))

    def episode(self, actor: Callable[[np.ndarray, Sequence[ZoneObservation]], np.ndarray]) -> Episode:
        """`run` on the next seed."""
        return run(self.next_seed(), actor, self.ranges)


class _PpoActor:
    """Samples from the teacher and keeps each step's log-probability and value for the update."""

    def __init__(self, network: TeacherNetwork, rng: np.random.Generator) -> None:
        self.network = network
        self.rng = rng
        self.extras: list[tuple[np.ndarray, np.ndarray]] = []

    def __call__(self, windows: np.ndarray, zones: Sequence[ZoneObservation]) -> np.ndarray:
        with torch.inference_mode():
            logits, value = self.network(teacher_input(windows))
            probs = torch.softmax(logits, dim=1).double().numpy()
        cumulative = probs.cumsum(axis=1)
        draws = self.rng.random((len(probs), 1)) * cumulative[:, -1:]
        choice = np.minimum((cumulative < draws).sum(axis=1), len(LEVELS) - 1)
        logp = np.log(np.maximum(probs[np.arange(len(choice)), choice], 1e-12))
        self.extras.append((logp, value.numpy().copy()))
        return choice


def _advantages(episode: Episode) -> tuple[np.ndarray, np.ndarray]:
    """GAE advantages and returns, per step and caller, flattened step-major (the episode ends the trajectory)."""
    rewards = np.stack(episode.rewards) / REWARD_SCALE
    values = np.stack([v for _, v in episode.extras])
    advantages = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[1])
    for t in range(len(rewards) - 1, -1, -1):
        following = values[t + 1] if t + 1 < len(rewards) else np.zeros_like(running)
        delta = rewards[t] + GAMMA * following - values[t]
        running = delta + GAMMA * LAMBDA * running
        advantages[t] = running
    return advantages.ravel(), (advantages + values).ravel()


def _behaviour_clone(network: TeacherNetwork, seeds: Sequence[int], ranges: Ranges, epochs: int) -> None:
    """Start the teacher from LocalFirst: cross-entropy on the rule's local shares rounded to levels, in states
    where the rounded rule acts."""
    rule = LocalFirst()

    def rounded_rule(windows: np.ndarray, zones: Sequence[ZoneObservation]) -> np.ndarray:
        rows = rule.split(zones, {})
        return np.asarray([nearest_level(rows[z.zone].get(z.zone, 0.0)) for z in zones])

    episodes = [run(seed, rounded_rule, ranges) for seed in seeds]
    x = teacher_input(np.concatenate([w for e in episodes for w in e.windows]))
    y = torch.from_numpy(np.concatenate([a for e in episodes for a in e.actions])).long()
    optimizer = torch.optim.Adam(network.policy.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(len(seeds))
    for _ in range(epochs):
        for batch in torch.randperm(len(x), generator=generator).split(MINIBATCH):
            loss = nn.functional.cross_entropy(network.policy(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def _ppo(network: TeacherNetwork, steps: int, training: _Training) -> int:
    """PPO on `steps` simulator steps (whole episodes; at least one); the steps taken."""
    optimizer = torch.optim.Adam(network.parameters(), lr=3e-4)
    generator = torch.Generator().manual_seed(int(training.rng.integers(2**31)))
    taken = 0
    while taken < max(1, steps):
        episodes: list[Episode] = []
        agent_steps = 0
        while agent_steps < ROLLOUT_AGENT_STEPS and taken < max(1, steps):
            actor = _PpoActor(network, training.rng)
            episode = training.episode(actor)
            episode.extras = actor.extras
            episodes.append(episode)
            taken += len(episode.windows)
            agent_steps += sum(len(a) for a in episode.actions)
        x = teacher_input(np.concatenate([w for e in episodes for w in e.windows]))
        actions = torch.from_numpy(np.concatenate([a for e in episodes for a in e.actions])).long()
        old_logp = torch.from_numpy(np.concatenate([lp for e in episodes for lp, _ in e.extras])).float()
        computed = [_advantages(e) for e in episodes]
        advantages = torch.from_numpy(np.concatenate([a for a, _ in computed])).float()
        returns = torch.from_numpy(np.concatenate([r for _, r in computed])).float()
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        for _ in range(PPO_EPOCHS):
            for batch in torch.randperm(len(x), generator=generator).split(MINIBATCH):
                logits, value = network(x[batch])
                logp_all = torch.log_softmax(logits, dim=1)
                logp = logp_all.gather(1, actions[batch, None])[:, 0]
                ratio = torch.exp(logp - old_logp[batch])
                a = advantages[batch]
                policy_loss = -torch.min(ratio * a, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * a).mean()
                entropy = -(logp_all.exp() * logp_all).sum(dim=1).mean()
                loss = policy_loss + 0.5 * ((value - returns[batch]) ** 2).mean() - ENTROPY * entropy
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(network.parameters(), 0.5)
                optimizer.step()
        mean_reward = float(np.mean([r for e in episodes for r in e.step_rewards]))
        training.log(f"teacher: {taken} steps, mean step reward {mean_reward:.3f}")
    return taken


def _teacher_probs(teacher: TeacherNetwork, windows: np.ndarray) -> torch.Tensor:
    with torch.inference_mode():
        return torch.softmax(teacher(teacher_input(windows))[0], dim=1)


def _kl(teacher_probs: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || student) over the batch."""
    p = teacher_probs.clamp_min(1e-8)
    return (p * (p.log() - torch.log_softmax(student_logits, dim=1))).sum(dim=1).mean()


def _mixed_actor(
    teacher: TeacherNetwork, student: StudentNetwork, beta: float, rng: np.random.Generator
) -> Callable[[np.ndarray, Sequence[ZoneObservation]], np.ndarray]:
    """Each cycle the teacher's mode with probability `beta`, else the student's."""

    def act(windows: np.ndarray, zones: Sequence[ZoneObservation]) -> np.ndarray:
        if rng.random() < beta:
            return _teacher_probs(teacher, windows).argmax(dim=1).numpy()
        with torch.inference_mode():
            return student(torch.from_numpy(windows).float()).argmax(dim=1).numpy()

    return act


def _distil(
    teacher: TeacherNetwork, student: StudentNetwork, rounds: int, episodes_per_round: int, training: _Training
) -> tuple[float, float, int]:
    """DAgger rounds of distillation; (KL before, KL after) on held-out states of the final student's own
    rollouts, and the states trained on."""
    initial = copy.deepcopy(student)
    optimizer = torch.optim.Adam(student.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(int(training.rng.integers(2**31)))
    windows: list[np.ndarray] = []
    for r in range(rounds):
        actor = _mixed_actor(teacher, student, 1.0 if r == 0 else 0.5**r, training.rng)
        windows += [w for _ in range(episodes_per_round) for w in training.episode(actor).windows]
        x = torch.from_numpy(np.concatenate(windows)).float()
        target = _teacher_probs(teacher, np.concatenate(windows))
        for _ in range(6):
            for batch in torch.randperm(len(x), generator=generator).split(MINIBATCH):
                loss = _kl(target[batch], student(x[batch]))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        training.log(f"distillation round {r + 1}/{rounds}: {len(x)} states, KL {loss.item():.4f}")
    own = _mixed_actor(teacher, student, 0.0, training.rng)
    held = np.concatenate([w for _ in range(episodes_per_round) for w in training.episode(own).windows])
    target = _teacher_probs(teacher, held)
    x = torch.from_numpy(held).float()
    with torch.inference_mode():
        return float(_kl(target, initial(x))), float(_kl(target, student(x))), sum(len(w) for w in windows)


def mean_reward(policy_factory: Callable[[], SplitPolicy], seeds: Sequence[int]) -> float:
    """Mean step reward of a fresh policy from `policy_factory` over the episodes of `seeds`."""
    rewards = []
    for seed in seeds:
        sim = ZoneSim(random_scenario(seed, EPISODE_S))
        policy = policy_factory()
        previous: ZoneSplit = {}
        while not sim.done():
            previous = policy.split(sim.observations(), previous)
            rewards.append(sim.step(previous).reward)
    return float(np.mean(rewards))


@dataclass(frozen=True)
class TrainReport:
    """What a training run measured."""

    path: Path
    teacher_steps: int
    """Simulator steps of PPO."""
    teacher_reward: float
    """Mean step reward on held-out episodes (and below for the student and the rule)."""
    student_reward: float
    rule_reward: float
    kl_initial: float
    """KL(teacher || student) before distillation, on held-out states of the final student's own rollouts."""
    kl_final: float
    distill_states: int
    held_out_episodes: int
    seconds: float


@dataclass(frozen=True)
class Trained:
    """A training run's report and policies (the bench evaluates the teacher too; the file has the student)."""

    report: TrainReport
    teacher: TeacherNetwork
    student: StudentNetwork


def train(out: Path, *, seed: int = 0, teacher_steps: int | None = None, log: Callable[[str], None] = print) -> Trained:
    """`train_failover`, also returning the networks."""
    started = time.perf_counter()
    steps = DEFAULT_TEACHER_STEPS if teacher_steps is None else teacher_steps
    if steps < 0:
        raise ValueError(f"teacher_steps must be at least 0, got {steps}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        training = _Training(np.random.default_rng([seed, 7]), Ranges(), log)
        # Budgets follow the teacher's: a few seconds for a tiny run, minutes for the default.
        episodes = steps / (EPISODE_S / 0.2)
        bc_episodes = int(np.clip(episodes / 60, 1, 10))
        per_round = int(np.clip(episodes / 80, 1, 8))
        held_out = int(np.clip(episodes / 60, 2, 12))
        teacher = TeacherNetwork()
        _behaviour_clone(teacher, [training.next_seed() for _ in range(bc_episodes)], training.ranges, epochs=8)
        log(f"teacher starts from LocalFirst ({bc_episodes} episodes cloned)")
        taken = _ppo(teacher, steps, training)
        student = StudentNetwork()
        kl_initial, kl_final, states = _distil(teacher, student, 3, per_round, training)
        save_student(out, student, training.ranges.array())
        seeds = [HELD_OUT_SEED + seed * 1000 + i for i in range(held_out)]
        teacher_reward = mean_reward(lambda: TeacherPolicy(teacher), seeds)
        student_reward = mean_reward(lambda: StudentPolicy.load(out), seeds)
        rule_reward = mean_reward(LocalFirst, seeds)
        report = TrainReport(
            path=out,
            teacher_steps=taken,
            teacher_reward=teacher_reward,
            student_reward=student_reward,
            rule_reward=rule_reward,
            kl_initial=kl_initial,
            kl_final=kl_final,
            distill_states=states,
            held_out_episodes=held_out,
            seconds=time.perf_counter() - started,
        )
        log(
            f"held out ({held_out} episodes), mean step reward: teacher {teacher_reward:.3f}, student "
            f"{student_reward:.3f}, LocalFirst {rule_reward:.3f}; KL {kl_initial:.3f} -> {kl_final:.4f}; "
            f"{report.seconds:.0f} s; written {out}"
        )
        return Trained(report, teacher, student)
    finally:
        torch.set_num_threads(threads)


def train_failover(
    out: Path, *, seed: int = 0, teacher_steps: int | None = None, log: Callable[[str], None] = print
) -> TrainReport:
    """Train a teacher (PPO) and distil the student; write the student to `out` (atomically) and report.

    `teacher_steps`: simulator steps of PPO (DEFAULT_TEACHER_STEPS: a few minutes on one core); the other
    stages' episodes scale with it, so a few hundred make a run of seconds. Uses one torch thread."""
    return train(out, seed=seed, teacher_steps=teacher_steps, log=log).report
