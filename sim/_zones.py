"""A fluid model of serving zones for the cross-zone failover scheduler (`prismlb.brain._failover`): fast
enough (numpy, queue level, no requests) to train a policy on hundreds of thousands of brain cycles.

The cluster (`Layout`, from a seed): zones of 3-6 nodes, each node with its own capacity (requests/s, 20-45:
a mix of GPU generations) and base P99 (50-70 ms); a round trip between zones of `rtt_ms` (2-40 ms by
default, symmetric; 0.5 ms within a zone); each zone's callers bring a share of the cluster's demand that
follows its capacity loosely (× lognormal, σ 0.25), so some zones bring more than they can serve.

Time moves in the brain's cycle (STEP_S = 0.2 s): the split is decided once a cycle, and a finer step would
only resolve queue dynamics the policy cannot act on.

Per step, the split sends caller zone c's demand D_c × S[c, z] to zone z, and within z the routers spread it
over the nodes the brain counts alive, by capacity × reported weight (what the routing table's weights say).
A node is a fluid queue: capacity μ × speed per second; the backlog grows by (arrivals - capacity) × dt and
is bounded by MAX_WAIT_S of work (the overflow fails, as a server sheds load); its P99 is
base × (1 + ρ² / (1 - ρ)) (ρ = utilisation, capped at RHO_CAP = 0.9) plus the backlog's wait. A request's latency adds
the round trip between its caller's zone and the serving zone. P99 over a mixture of flows: each flow's tail
taken as exponential through its P99 (P(X > x) = 0.01^(x / p99)), and the mixture's P99 solved by Newton's
method: a small flow with a long tail moves the P99 as much as it would in requests.

The brain's view (`observations`): every node sends a vector once an agent period (AGENT_PERIOD_S = 1 s, each
node at its own phase) with its P99, backlog and weight averaged over the period just ended (so reported
values lag up to a period), and the brain counts a node alive while its last vector is at most
ALIVE_PERIODS = 1.5 periods old. A node that is down sends nothing: in a zone outage its requests fail at once,
while `alive` falls only as each node's last vector goes stale (0.5-1.5 s later), exactly what the brain sees.
The reported weight follows health × tail (health = 1 - (1 - speed) / 2: throttling shows in the health signals,
half of it; tail = min(1, SLO / P99)) smoothed over WEIGHT_SMOOTHING_S = 5 s, as the brain smooths its weights.
Callers' demand shares are reported once a period, over the period.

Events: `Outage` (all nodes of a zone down; their backlog fails), `Brownout` (a zone's nodes at a fraction of
their speed, and/or one node down), `Surge` (a zone's callers bring × factor). Demand varies slowly (± 10%,
a sine with a 20-60 s period per zone) and in bursts (× 1.3 for 2-4 s, about one per zone per 30 s).

Reward per step (the design's): r = -0.1 - 0.3 × imbalance - 0.5 × min(1, P99 / SLO) - 5 × is_failure, with
imbalance = Σ_z |routed_z - D_z| / Σ D (routed_z: the requests sent to zone z's nodes; D_z: what zone z's own
callers bring: 0 when every zone serves its own callers, 2 × the net cross-zone flow otherwise) and is_failure
= more than 1% of the step's requests failed. `ZoneSim.step` also returns the same formula over each caller
zone's own requests (its own P99 and failures), for training.

Metrics per episode (`EpisodeMetrics`): recovery after a zone outage (from its start until the failed share
is under 1% and the P99 under the SLO for RECOVERED_S = 2 s straight; the rest of the episode when that never
comes), cross-zone share, P99, failed share, mean reward. Everything is drawn from the scenario's seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from prismlb.brain._failover import SLO_MS, SplitPolicy, ZoneObservation, ZoneSplit

STEP_S = 0.2
AGENT_PERIOD_S = 1.0
ALIVE_PERIODS = 1.5
MAX_WAIT_S = 3.0
"""A node's backlog holds at most this much of its work; beyond, arrivals fail."""
INTRA_ZONE_RTT_MS = 0.5
FAILURE_SHARE = 0.01
"""A step with more than this share of its requests failed is a failure (the reward's is_failure)."""
RECOVERED_S = 2.0
RHO_CAP = 0.9
"""Utilisation beyond this shows as backlog (its wait), not as a steeper curve."""
WEIGHT_SMOOTHING_S = 5.0
"""A node's reported weight follows health × tail with this time constant (the brain smooths its weights so
that one window's P99 does not swing a node's share and make the next hot spot)."""
LN_100 = math.log(100.0)
WEIGHT_ALPHA = 1.0 - math.exp(-AGENT_PERIOD_S / WEIGHT_SMOOTHING_S)


@dataclass(frozen=True)
class Layout:
    """The cluster: zones, nodes, round trips and each zone's callers' share of the demand."""

    zones: tuple[str, ...]
    node_zone: np.ndarray
    """Zone index per node."""
    capacity: np.ndarray
    """Requests/s per node at full speed."""
    base_ms: np.ndarray
    """P99 per node at no load."""
    phase_s: np.ndarray
    """When in each agent period the node sends its vector."""
    rtt_ms: np.ndarray
    """(zones, zones) round trip."""
    demand_share: np.ndarray
    """Each zone's callers' share of the cluster's demand."""

    def zone_capacity(self) -> np.ndarray:
        return np.bincount(self.node_zone, weights=self.capacity, minlength=len(self.zones))


def make_layout(
    seed: int, zones: int = 3, nodes: tuple[int, int] = (3, 6), rtt_ms: tuple[float, float] = (2.0, 40.0)
) -> Layout:
    """A random cluster of `zones` zones with `nodes` (low, high) nodes each and round trips within `rtt_ms`."""
    rng = np.random.default_rng([seed, 1])
    counts = rng.integers(nodes[0], nodes[1] + 1, size=zones)
    node_zone = np.repeat(np.arange(zones), counts)
    n = len(node_zone)
    capacity = rng.uniform(20.0, 45.0, size=n)
    rtt = np.full((zones, zones), INTRA_ZONE_RTT_MS)
    for a in range(zones):
        for b in range(a + 1, zones):
            rtt[a, b] = rtt[b, a] = rng.uniform(*rtt_ms)
    share = np.bincount(node_zone, weights=capacity, minlength=zones) * rng.lognormal(0.0, 0.25, size=zones)
    return Layout(
        zones=tuple(f"zone-{chr(ord('a') + i)}" for i in range(zones)),
        node_zone=node_zone,
        capacity=capacity,
        base_ms=rng.uniform(50.0, 70.0, size=n),
        phase_s=rng.uniform(0.0, AGENT_PERIOD_S, size=n),
        rtt_ms=rtt,
        demand_share=share / share.sum(),
    )


@dataclass(frozen=True)
class Outage:
    """All nodes of zone `zone` (index) down from `start_s` to `end_s`."""

    zone: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Brownout:
    """Zone `zone`'s nodes at `speed` of their capacity, and its first node down when `node_down`."""

    zone: int
    start_s: float
    end_s: float
    speed: float
    node_down: bool = False


@dataclass(frozen=True)
class Surge:
    """Zone `zone`'s callers bring `factor` × their demand."""

    zone: int
    start_s: float
    end_s: float
    factor: float


Event = Outage | Brownout | Surge


@dataclass(frozen=True)
class Scenario:
    """One episode: a cluster, its load (the cluster's mean demand over its total capacity), events, a seed for
    the demand's variation."""

    name: str
    seed: int
    layout: Layout
    load: float
    duration_s: float = 60.0
    events: tuple[Event, ...] = ()

    def outage_start(self) -> float | None:
        starts = [e.start_s for e in self.events if isinstance(e, Outage)]
        return min(starts) if starts else None


EVALUATION = ("outage", "brownout", "surge", "calm")
"""The fixed evaluation scenarios, by name."""


def evaluation_scenario(name: str, seed: int) -> Scenario:
    """A fixed scenario of EVALUATION on a 3-zone cluster drawn from `seed` (60 s, events at 20 s):
    outage: the largest zone (by capacity) down until the end, load 0.4 (the others can carry it);
    brownout: the largest zone at 40% speed and one node down for 25 s, load 0.55;
    surge: the smallest zone's callers × 2.5 for 20 s, load 0.5; calm: nothing happens, load 0.55."""
    layout = make_layout(seed)
    largest = int(np.argmax(layout.zone_capacity()))
    smallest = int(np.argmin(layout.zone_capacity()))
    if name == "outage":
        return Scenario(name, seed, layout, 0.4, events=(Outage(largest, 20.0, 60.0),))
    if name == "brownout":
        return Scenario(name, seed, layout, 0.55, events=(Brownout(largest, 20.0, 45.0, 0.4, node_down=True),))
    if name == "surge":
        return Scenario(name, seed, layout, 0.5, events=(Surge(smallest, 20.0, 40.0, 2.5),))
    if name == "calm":
        return Scenario(name, seed, layout, 0.55)
    raise ValueError(f"unknown evaluation scenario {name!r}; known: {', '.join(EVALUATION)}")


def random_scenario(seed: int, duration_s: float = 40.0) -> Scenario:
    """A training scenario: 3-5 zones, load 0.35-0.7, and an outage (45%), a brownout (25%), a surge (15%) or
    nothing (15%) starting 6-20 s in, lasting 10-30 s."""
    rng = np.random.default_rng([seed, 2])
    layout = make_layout(seed, zones=int(rng.integers(3, 6)))
    zone = int(rng.integers(len(layout.zones)))
    start = float(rng.uniform(6.0, 20.0))
    end = start + float(rng.uniform(10.0, 30.0))
    kind = rng.choice(4, p=[0.45, 0.25, 0.15, 0.15])
    load = float(rng.uniform(0.35, 0.7))
    events: tuple[Event, ...] = ()
    if kind == 0:
        events = (Outage(zone, start, end),)
        load = min(load, 0.55)
    elif kind == 1:
        events = (Brownout(zone, start, end, float(rng.uniform(0.3, 0.7)), node_down=bool(rng.random() < 0.5)),)
    elif kind == 2:
        events = (Surge(zone, start, end, float(rng.uniform(1.5, 2.5))),)
    return Scenario(("outage", "brownout", "surge", "calm")[kind], seed, layout, load, duration_s, events)


@dataclass(frozen=True)
class StepOutcome:
    """One step: requests, how they ended, where they went, and the reward."""

    requests: float
    served: float
    failed: float
    cross_zone: float
    """Requests sent to a zone other than their caller's."""
    imbalance: float
    p99_ms: float
    caller_p99_ms: np.ndarray
    caller_failed_share: np.ndarray
    reward: float
    caller_reward: np.ndarray
    """The reward's formula over each caller zone's own requests (the imbalance term is the cluster's)."""

    @property
    def failed_share(self) -> float:
        return self.failed / self.requests if self.requests > 0 else 0.0


def reward(imbalance: float, p99_ms: float, failed_share: float) -> float:
    """The design's reward for one step."""
    return -0.1 - 0.3 * imbalance - 0.5 * min(1.0, p99_ms / SLO_MS) - 5.0 * float(failed_share > FAILURE_SHARE)


def mixture_p99(weights: np.ndarray, p99: np.ndarray) -> np.ndarray:
    """Per row, the P99 of a mixture of flows with `weights` (requests) and P99s `p99` (rows × flows), each
    flow's tail exponential through its P99; 0 for a row without requests. Newton's method from the smallest
    P99 of the row's flows (the function is convex and decreasing there, so it converges from the left)."""
    total = weights.sum(axis=1)
    out = np.zeros(weights.shape[0])
    rows = total > 0
    if not rows.any():
        return out
    w = weights[rows] / total[rows, None]
    p = np.maximum(p99[rows], 1e-6)
    present = w > 0
    x = np.where(present, p, np.inf).min(axis=1)
    k = LN_100 / p
    for _ in range(30):
        terms = w * np.exp(-k * x[:, None])
        g = terms.sum(axis=1) - 0.01
        slope = -(terms * k).sum(axis=1)
        move = g / np.minimum(slope, -1e-12)
        x = x - move
        if np.all(np.abs(move) <= 1e-6 * x):
            break
    out[rows] = x
    return out


@dataclass
class EpisodeMetrics:
    """What one episode measured."""

    scenario: str
    seed: int
    recovery_s: float | None
    """Outage start to recovery; None without an outage."""
    recovered: bool
    cross_zone_share: float
    p99_ms: float
    failed_share: float
    mean_reward: float
    steps: int


@dataclass
class _Totals:
    """The episode's steps summed (requests are rates × step length, so not whole), for `ZoneSim.metrics`."""

    requests: float = 0.0
    failed: float = 0.0
    cross_zone: float = 0.0
    reward: float = 0.0
    steps: int = 0
    bad: list[bool] = field(default_factory=list)
    """Per step: whether it failed too many requests or missed the SLO; recovery is a run of good steps."""
    weights: list[np.ndarray] = field(default_factory=list)
    latencies: list[np.ndarray] = field(default_factory=list)
    """Per step: the requests served on each (caller zone, node) flow and that flow's P99, whose mixture over
    the episode is its P99."""


class ZoneSim:
    """One episode of a scenario: `observations()` (the brain's view now), `step(split)` (one brain cycle)."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        layout = scenario.layout
        self.layout = layout
        self.t = 0.0
        n, z = len(layout.capacity), len(layout.zones)
        self._zone_index = {name: i for i, name in enumerate(layout.zones)}
        self._nodes_per_zone = np.bincount(layout.node_zone, minlength=z)
        self._backlog = np.zeros(n)
        self._up = np.ones(n, dtype=bool)
        self._speed = np.ones(n)
        self._base_demand = scenario.load * layout.capacity.sum() * layout.demand_share
        rng = np.random.default_rng([scenario.seed, 3])
        self._wave_period = rng.uniform(20.0, 60.0, size=z)
        self._wave_phase = rng.uniform(0.0, 2 * math.pi, size=z)
        self._bursts = [
            [(s, s + rng.uniform(2.0, 4.0)) for s in np.cumsum(rng.exponential(30.0, size=8))] for _ in range(z)
        ]
        # The vectors sent just before the start, at no load: every node alive, weight 1.
        self._last_report = layout.phase_s - AGENT_PERIOD_S
        self._next_report = layout.phase_s.copy()
        self._reported_p99 = layout.base_ms.copy()
        self._reported_queue = np.zeros(n)
        self._reported_weight = np.ones(n)
        self._sum_p99 = np.zeros(n)
        self._sum_queue = np.zeros(n)
        self._sum_s = np.zeros(n)
        self._demand_sum = np.zeros(z)
        self._reported_demand = layout.demand_share.copy()
        self._next_demand_report = AGENT_PERIOD_S
        self._totals = _Totals()
        self._apply_events()

    def done(self) -> bool:
        return self.t >= self.scenario.duration_s - 1e-9

    def alive(self) -> np.ndarray:
        """Nodes whose last vector is at most ALIVE_PERIODS periods old."""
        return self.t - self._last_report <= ALIVE_PERIODS * AGENT_PERIOD_S + 1e-9

    def observations(self) -> list[ZoneObservation]:
        """The brain's view of every zone now."""
        alive = self.alive()
        zone = self.layout.node_zone
        zones = len(self.layout.zones)
        count = np.bincount(zone, weights=alive, minlength=zones)
        weight = np.bincount(zone, weights=alive * self._reported_weight, minlength=zones)
        queue = np.bincount(zone, weights=alive * self._reported_queue, minlength=zones)
        out = []
        for i, name in enumerate(self.layout.zones):
            members = alive & (zone == i)
            n_alive = int(count[i])
            out.append(
                ZoneObservation(
                    zone=name,
                    nodes=int(self._nodes_per_zone[i]),
                    alive=n_alive,
                    weight=float(weight[i] / n_alive) if n_alive else 0.0,
                    p99_ms=float(self._reported_p99[members].max()) if n_alive else 0.0,
                    queue=float(queue[i] / n_alive) if n_alive else 0.0,
                    demand=float(self._reported_demand[i]),
                )
            )
        return out

    def _apply_events(self) -> None:
        """Node states and speeds at time t from the scenario's events; a node going down loses its backlog
        (counted as failed by `step`)."""
        up = np.ones_like(self._up)
        speed = np.ones_like(self._speed)
        zone = self.layout.node_zone
        for event in self.scenario.events:
            if not event.start_s <= self.t < event.end_s:
                continue
            if isinstance(event, Outage):
                up &= zone != event.zone
            elif isinstance(event, Brownout):
                members = zone == event.zone
                speed[members] *= event.speed
                if event.node_down:
                    up[int(np.argmax(members))] = False
        self._up, self._speed = up, speed

    def demand(self) -> np.ndarray:
        """Requests/s each zone's callers bring now."""
        t = self.t
        d = self._base_demand * (1.0 + 0.1 * np.sin(2 * math.pi * t / self._wave_period + self._wave_phase))
        for i, bursts in enumerate(self._bursts):
            if any(a <= t < b for a, b in bursts):
                d[i] *= 1.3
        for event in self.scenario.events:
            if isinstance(event, Surge) and event.start_s <= t < event.end_s:
                d[event.zone] *= event.factor
        return d

    def split_matrix(self, split: ZoneSplit) -> np.ndarray:
        """(callers, zones) fractions; a caller zone without a row keeps all its traffic local, serving zones
        the cluster does not have are ignored."""
        z = len(self.layout.zones)
        matrix = np.zeros((z, z))
        for c, name in enumerate(self.layout.zones):
            row = split.get(name)
            if row is None:
                matrix[c, c] = 1.0
                continue
            for serving, fraction in row.items():
                j = self._zone_index.get(serving)
                if j is not None:
                    matrix[c, j] = fraction
        return matrix

    def step(self, split: ZoneSplit) -> StepOutcome:
        """One brain cycle under `split`; then the clock, events and vectors move on."""
        layout, dt = self.layout, STEP_S
        zone = layout.node_zone
        matrix = self.split_matrix(split)
        demand = self.demand()
        flow = demand[:, None] * matrix
        alive = self.alive()
        route = layout.capacity * np.maximum(self._reported_weight, 1e-3) * alive
        zone_route = np.bincount(zone, weights=route, minlength=len(layout.zones))
        has_alive = zone_route > 0
        fraction = np.where(has_alive[zone], route / np.where(zone_route[zone] > 0, zone_route[zone], 1.0), 0.0)
        to_node = flow[:, zone] * fraction[None, :] * dt
        unroutable = (flow[:, ~has_alive].sum(axis=1)) * dt
        arrivals = to_node.sum(axis=0)
        service = layout.capacity * self._speed
        backlog_before = np.where(self._up, self._backlog, 0.0)
        lost_backlog = np.where(self._up, 0.0, self._backlog).sum()
        backlog = np.maximum(0.0, backlog_before + arrivals - service * dt)
        limit = MAX_WAIT_S * service
        overflow = np.maximum(0.0, backlog - limit)
        backlog = np.minimum(backlog, limit)
        fail_node = np.where(self._up, overflow / np.maximum(arrivals, 1e-12), 1.0)
        fail_node = np.minimum(fail_node, 1.0)
        rho = np.minimum(arrivals / (service * dt), RHO_CAP)
        wait_ms = 1000.0 * 0.5 * (backlog_before + backlog) / service
        node_p99 = layout.base_ms * (1.0 + rho * rho / (1.0 - rho)) + wait_ms
        served = to_node * (1.0 - fail_node)[None, :]
        failed_caller = (to_node * fail_node[None, :]).sum(axis=1) + unroutable
        latency = node_p99[None, :] + layout.rtt_ms[:, zone]
        p99_callers = mixture_p99(served, latency)
        p99 = float(mixture_p99(served.reshape(1, -1), latency.reshape(1, -1))[0])
        requests_caller = demand * dt
        requests = float(requests_caller.sum())
        failed = float(failed_caller.sum()) + lost_backlog
        routed = flow.sum(axis=0)
        imbalance = float(np.abs(routed - demand).sum() / demand.sum())
        cross = float((flow.sum() - np.trace(flow)) * dt)
        caller_failed = failed_caller / np.maximum(requests_caller, 1e-12)
        step_reward = reward(imbalance, p99, failed / requests if requests > 0 else 0.0)
        caller_reward = (
            -0.1 - 0.3 * imbalance - 0.5 * np.minimum(1.0, p99_callers / SLO_MS) - 5.0 * (caller_failed > FAILURE_SHARE)
        )
        outcome = StepOutcome(
            requests=requests,
            served=float(served.sum()),
            failed=failed,
            cross_zone=cross,
            imbalance=imbalance,
            p99_ms=p99,
            caller_p99_ms=p99_callers,
            caller_failed_share=caller_failed,
            reward=step_reward,
            caller_reward=caller_reward,
        )
        self._record(outcome, served.ravel(), latency.ravel())
        self._advance(node_p99, backlog, demand)
        return outcome

    def _record(self, outcome: StepOutcome, weights: np.ndarray, latencies: np.ndarray) -> None:
        totals = self._totals
        totals.requests += outcome.requests
        totals.failed += outcome.failed
        totals.cross_zone += outcome.cross_zone
        totals.reward += outcome.reward
        totals.steps += 1
        totals.bad.append(outcome.failed_share > FAILURE_SHARE or outcome.p99_ms > SLO_MS)
        totals.weights.append(weights)
        totals.latencies.append(latencies)

    def _advance(self, node_p99: np.ndarray, backlog: np.ndarray, demand: np.ndarray) -> None:
        """Accumulate this step into the nodes' next vectors, move the clock, send the vectors that are due."""
        dt = STEP_S
        self._backlog = np.where(self._up, backlog, 0.0)
        self._sum_p99 += node_p99 * dt
        self._sum_queue += self._backlog * dt
        self._sum_s += dt
        self._demand_sum += demand * dt
        self.t = round(self.t + dt, 9)
        due = self._next_report <= self.t + 1e-9
        if due.any():
            sending = due & self._up
            span = np.maximum(self._sum_s, 1e-9)
            p99 = self._sum_p99 / span
            health = 1.0 - (1.0 - self._speed) / 2.0
            self._reported_p99 = np.where(sending, p99, self._reported_p99)
            self._reported_queue = np.where(sending, self._sum_queue / span, self._reported_queue)
            target = health * np.minimum(1.0, SLO_MS / np.maximum(p99, 1e-9))
            smoothed = self._reported_weight + (target - self._reported_weight) * WEIGHT_ALPHA
            self._reported_weight = np.where(sending, smoothed, self._reported_weight)
            self._last_report = np.where(sending, self._next_report, self._last_report)
            self._next_report = np.where(due, self._next_report + AGENT_PERIOD_S, self._next_report)
            for array in (self._sum_p99, self._sum_queue, self._sum_s):
                array[due] = 0.0
        if self.t >= self._next_demand_report - 1e-9:
            self._reported_demand = self._demand_sum / self._demand_sum.sum()
            self._demand_sum[:] = 0.0
            self._next_demand_report += AGENT_PERIOD_S
        self._apply_events()

    def metrics(self) -> EpisodeMetrics:
        """The episode so far."""
        totals = self._totals
        start = self.scenario.outage_start()
        recovery_s: float | None = None
        recovered = False
        if start is not None:
            first = int(round(start / STEP_S))
            need = int(round(RECOVERED_S / STEP_S))
            run = 0
            recovery_s = self.t - start
            for i in range(first, totals.steps):
                run = 0 if totals.bad[i] else run + 1
                if run >= need:
                    recovery_s = (i - need + 1) * STEP_S - start
                    recovered = True
                    break
        weights = np.concatenate(totals.weights).reshape(1, -1) if totals.weights else np.zeros((1, 0))
        latencies = np.concatenate(totals.latencies).reshape(1, -1) if totals.latencies else np.zeros((1, 0))
        return EpisodeMetrics(
            scenario=self.scenario.name,
            seed=self.scenario.seed,
            recovery_s=recovery_s,
            recovered=recovered,
            cross_zone_share=totals.cross_zone / totals.requests if totals.requests else 0.0,
            p99_ms=float(mixture_p99(weights, latencies)[0]) if weights.size else 0.0,
            failed_share=float(totals.failed / totals.requests) if totals.requests else 0.0,
            mean_reward=totals.reward / totals.steps if totals.steps else 0.0,
            steps=totals.steps,
        )


def run_episode(scenario: Scenario, policy: SplitPolicy) -> EpisodeMetrics:
    """`policy` decides every cycle of `scenario` from the observations and its own previous split."""
    sim = ZoneSim(scenario)
    previous: ZoneSplit = {}
    while not sim.done():
        previous = policy.split(sim.observations(), previous)
        sim.step(previous)
    return sim.metrics()
