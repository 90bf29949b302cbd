"""Gradient-aware offload bandwidth for training and fine-tuning jobs that share GPU hosts with inference.

A job that offloads gradients to host memory (ZeRO-Offload style) shares the host link (PCIe, or RDMA queue
pairs to another host) with the inference traffic around it, so the bytes it may move per second are scarce.
The design's rule: the layers whose gradients change fastest between steps (it expects the embedding
and the output head; which ones they are is measured here, not assumed) are the ones whose late sync costs
most, so they get at least 60% of the link and the other layers share the rest in proportion to how fast
their gradients change.

Three parts, usable on their own:

- `GradientMonitor` measures, per layer and step, the L1 density of the gradient (‖g‖₁ / numel) and its
  change rate: the relative change of that density from the previous step, EWMA-smoothed.
- `BandwidthScheduler` turns the pending bytes per layer and the change rates into a rate per layer; the
  design's RDMA queue-pair rates (800 Mbps urgent, 300 Mbps background) are the default rate classes
  `qp_rate_limits` maps a plan to.
- `EmulatedLink` executes transfers under such rates on an emulated link, a token bucket at PCIe-like rates,
  in simulated time (`SimulatedClock`) or wall time (`WallClock`); `static_equal_share` and `fifo` are the
  static schedules to compare against.

It lives in `prismlb.otel`, not in a package of its own, because like the allocator metrics it is a library
a GPU worker imports to observe itself from inside the process; torch is imported only when a monitor is
made, so importing `prismlb.otel` stays light, and its errors and reject counting are Prism's
(`prismlb.wire`), not a second copy.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Literal, Protocol, TypeGuard

from prismlb.wire import ConfigError, InvalidFieldError, NonFiniteError, RejectCounter

if TYPE_CHECKING:
    import torch

_log = logging.getLogger(__name__)

RateClass = Literal["urgent", "background"]

QP_RATE_MBPS: Final[Mapping[RateClass, float]] = MappingProxyType({"urgent": 800.0, "background": 300.0})
"""The design's RDMA queue-pair rate limits per class, in Mbps: the defaults `qp_rate_limits` maps to."""
URGENT_SHARE: Final = 0.6
"""Share of the link the urgent layers get together while background layers are pending too."""
URGENT_RATE_RATIO: Final = 0.5
"""A layer is urgent when its change rate is at least this fraction of the fastest layer's ..."""
MAX_URGENT_FRACTION: Final = 0.25
"""... and it is among the fastest quarter of the layers (at least one): a few layers, not most of them."""
BACKGROUND_FLOOR: Final = 0.05
"""A background layer's weight is at least this fraction of the fastest background layer's, so none starves."""
EWMA_ALPHA: Final = 0.3
"""Weight of the newest step in the smoothed change rate."""
CHUNK_BYTES: Final = 4096
"""The emulated link moves transfers in chunks of this size (an RDMA MTU, a PCIe-friendly DMA granule)."""
QUEUE_BURST_CHUNKS: Final = 4
"""A transfer's own token bucket holds at most this many chunks."""
WAIT_SPIN_S: Final = 200e-6
"""`WallClock` spins through the last this-many seconds of a wait instead of sleeping."""

LinkPolicy = Callable[[Mapping[str, int]], Mapping[str, float]]
"""Rates (bytes/s) per layer for the layers with bytes left; called again whenever that set changes."""


def _number(value: object) -> TypeGuard[int | float]:
    """An int or a float (a bool is neither here), finite or not."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _checked(value: object, what: str, rejects: RejectCounter) -> float:
    """`value` as a finite number ≥ 0, or a counted `InvalidFieldError` / `NonFiniteError` naming `what`."""
    error: InvalidFieldError | NonFiniteError | None = None
    if not _number(value):
        error = InvalidFieldError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    elif not math.isfinite(value):
        error = NonFiniteError(f"{what} must be finite, got {value!r}")
    elif value < 0:
        error = InvalidFieldError(f"{what} must not be negative, got {value!r}")
    if error is not None:
        rejects.record(error)
        raise error
    return float(value)


def _checked_name(name: object, rejects: RejectCounter) -> str:
    if not isinstance(name, str) or not name:
        error = InvalidFieldError(f"a layer name must be a non-empty string, got {name!r}")
        rejects.record(error)
        raise error
    return name


def _positive(value: float, what: str) -> float:
    if not _number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def _fraction(value: float, what: str, *, closed_low: bool = False) -> float:
    ok = _number(value) and value <= 1
    ok = ok and (value >= 0 if closed_low else value > 0)
    if not ok:
        low = "[0" if closed_low else "(0"
        raise ConfigError(f"{what} must be in {low}, 1], got {value!r}")
    return float(value)


# --- measuring ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LayerGradient:
    """One layer's gradient in one step."""

    name: str
    """The module's name in the model (`named_modules`), "(root)" for the model's own parameters."""
    numel: int
    """Elements of this step's gradients (parameters that got none this step do not count)."""
    grad_bytes: int
    """Bytes of those gradients: what offloading them moves."""
    density: float
    """‖g‖₁ / numel over the layer's parameters."""
    change_rate: float | None
    """EWMA of the relative change of the density per step; None until a second step measured the layer."""
    ready_order: int
    """0 for the first layer whose gradients were complete this step, 1 for the next (backward order)."""


@dataclass(slots=True)
class _Slot:
    """The last gradient one parameter accumulated this step (a 0-dim tensor, read only at `step`)."""

    l1: torch.Tensor
    numel: int
    nbytes: int


@dataclass(slots=True)
class _LayerState:
    name: str
    slots: dict[int, _Slot] = field(default_factory=dict)
    last_sequence: int = -1
    density: float | None = None
    change_rate: float | None = None


class GradientMonitor:
    """Per-layer gradient L1 density and its change rate, measured by torch hooks during backward.

    A layer is a module with trainable parameters of its own (`parameters(recurse=False)`); a parameter shared
    by several modules (tied embedding and head) counts for the first that holds it. Each parameter gets a
    `register_post_accumulate_grad_hook`, which sees `.grad` after accumulation, so gradient accumulation over
    micro-batches measures the gradient the optimizer steps on; `register_full_backward_hook` would see the
    gradients of module inputs and outputs, not of the parameters that are offloaded. The hook keeps one
    0-dim L1 tensor per parameter (no host sync during backward); `step()` reads them once per step. Memory
    is a few numbers per layer, whatever the number of steps.

    Non-finite gradients (an fp16 overflow the loss scaler will skip) are counted, not raised: the layer keeps
    its previous density and change rate for that step.
    """

    def __init__(
        self, model: torch.nn.Module, *, alpha: float = EWMA_ALPHA, rejects: RejectCounter | None = None
    ) -> None:
        import torch

        self.alpha = _fraction(alpha, "the EWMA weight alpha")
        self.rejects = rejects if rejects is not None else RejectCounter("gradient monitor", _log)
        self._torch = torch
        self._layers: list[_LayerState] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._sequence = itertools.count()
        self._lock = threading.Lock()
        self.steps = 0
        seen: set[int] = set()
        for name, module in model.named_modules():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
            if not params:
                continue
            seen.update(id(p) for p in params)
            layer = len(self._layers)
            self._layers.append(_LayerState(name or "(root)"))
            for slot, param in enumerate(params):
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(layer, slot)))
        if not self._layers:
            self.close()
            raise ConfigError("the model has no trainable parameters to monitor")

    @property
    def layers(self) -> tuple[str, ...]:
        """The monitored layers, in the model's module order."""
        return tuple(layer.name for layer in self._layers)

    def _hook(self, layer: int, slot: int) -> Callable[[torch.Tensor], None]:
        torch = self._torch

        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            values = grad.coalesce().values() if grad.is_sparse else grad
            with torch.no_grad():
                l1 = torch.linalg.vector_norm(values.detach(), 1, dtype=torch.float32)
            sequence = next(self._sequence)
            with self._lock:
                state = self._layers[layer]
                state.slots[slot] = _Slot(l1, param.numel(), param.numel() * grad.element_size())
                state.last_sequence = max(state.last_sequence, sequence)

        return hook

    def step(self) -> tuple[LayerGradient, ...]:
        """Close a step: the layers that got gradients since the last call, in the order they became ready."""
        with self._lock:
            fired = [(state, list(state.slots.values()), state.last_sequence) for state in self._layers if state.slots]
            for state, _, _ in fired:
                state.slots = {}
                state.last_sequence = -1
        self.steps += 1
        measured: list[tuple[int, LayerGradient]] = []
        for state, slots, sequence in fired:
            numel = sum(slot.numel for slot in slots)
            l1 = sum(float(slot.l1) for slot in slots)
            density = l1 / numel if numel else 0.0
            if not math.isfinite(density):
                self.rejects.count("non_finite", f"layer {state.name}: gradient L1 norm {l1} in step {self.steps}")
                continue
            self._update(state, density)
            nbytes = sum(slot.nbytes for slot in slots)
            measured.append((sequence, LayerGradient(state.name, numel, nbytes, density, state.change_rate, 0)))
        measured.sort(key=lambda item: item[0])
        return tuple(
            LayerGradient(g.name, g.numel, g.grad_bytes, g.density, g.change_rate, order)
            for order, (_, g) in enumerate(measured)
        )

    def _update(self, state: _LayerState, density: float) -> None:
        """The step's change is |d − d_prev| / max(d, d_prev): relative, in [0, 1], defined when either is 0."""
        previous = state.density
        state.density = density
        if previous is None:
            return
        larger = max(density, previous)
        change = abs(density - previous) / larger if larger > 0 else 0.0
        before = state.change_rate
        state.change_rate = change if before is None else self.alpha * change + (1.0 - self.alpha) * before

    def change_rates(self) -> dict[str, float]:
        """The smoothed change rate of every layer measured in at least two steps."""
        with self._lock:
            return {state.name: state.change_rate for state in self._layers if state.change_rate is not None}

    def close(self) -> None:
        """Remove every hook; the model trains on unobserved. Safe to call more than once."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> GradientMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- scheduling --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BandwidthPlan:
    """Rates for the layers with bytes pending, and each one's class."""

    capacity_bytes_per_s: float
    rates: Mapping[str, float]
    """Bytes per second per layer, in layer-name order; they add up to the capacity."""
    classes: Mapping[str, RateClass]

    @property
    def urgent(self) -> tuple[str, ...]:
        return tuple(name for name, kind in self.classes.items() if kind == "urgent")

    @property
    def urgent_share(self) -> float:
        """Share of the capacity the urgent layers get together."""
        total = sum(rate for name, rate in self.rates.items() if self.classes[name] == "urgent")
        return total / self.capacity_bytes_per_s


def qp_rate_limits(plan: BandwidthPlan, rates_mbps: Mapping[RateClass, float] = QP_RATE_MBPS) -> dict[str, int]:
    """Each planned layer's RDMA queue-pair rate limit in kbps (the unit of `ibv_qp_rate_limit_attr`), from its
    class: by default the design's 800 Mbps for urgent layers and 300 Mbps for the others."""
    kbps = {
        kind: round(_positive(rates_mbps.get(kind, math.nan), f"the {kind} QP rate (Mbps)") * 1000)
        for kind in ("urgent", "background")
    }
    return {name: kbps[kind] for name, kind in plan.classes.items()}


class BandwidthScheduler:
    """Splits a link's capacity among the layers with pending transfers by how fast their gradients change.

    Urgent layers: the layers whose change rate is > 0 and at least `urgent_ratio` of the fastest layer's,
    at most the `max_urgent_fraction` fastest of all layers with a known rate (at least one). While background
    layers are pending too, the urgent ones get `urgent_share` of the link together, split in proportion to
    their pending bytes so that they finish together (the soonest the last of them can finish at that share);
    the background layers share the rest in proportion to their change rate, each weighted at least
    `background_floor` of the fastest background layer, so that none starves. A class with nothing pending
    leaves the whole link to the other. Layers without a known rate are background.

    Plans are deterministic: ties go by layer name, and the input's order does not matter.
    """

    def __init__(
        self,
        capacity_bytes_per_s: float,
        *,
        urgent_share: float = URGENT_SHARE,
        urgent_ratio: float = URGENT_RATE_RATIO,
        max_urgent_fraction: float = MAX_URGENT_FRACTION,
        background_floor: float = BACKGROUND_FLOOR,
        rejects: RejectCounter | None = None,
    ) -> None:
        self.capacity_bytes_per_s = _positive(capacity_bytes_per_s, "the link capacity (bytes/s)")
        self.urgent_share = _fraction(urgent_share, "urgent_share")
        self.urgent_ratio = _fraction(urgent_ratio, "urgent_ratio")
        self.max_urgent_fraction = _fraction(max_urgent_fraction, "max_urgent_fraction")
        self.background_floor = _fraction(background_floor, "background_floor", closed_low=True)
        self.rejects = rejects if rejects is not None else RejectCounter("bandwidth scheduler", _log)

    def urgent_layers(self, change_rates: Mapping[str, float]) -> tuple[str, ...]:
        """The urgent layers for these change rates, fastest first."""
        rates = self._per_layer(change_rates, "change rate")
        ranked = sorted(rates, key=lambda name: (-rates[name], name))
        if not ranked or rates[ranked[0]] <= 0:
            return ()
        limit = max(1, int(self.max_urgent_fraction * len(ranked)))
        threshold = self.urgent_ratio * rates[ranked[0]]
        return tuple(name for name in ranked[:limit] if rates[name] >= threshold)

    def plan(self, pending: Mapping[str, float], change_rates: Mapping[str, float]) -> BandwidthPlan:
        """Rates for the layers in `pending` with bytes left (bytes per layer), given every layer's change rate."""
        left = self._per_layer(pending, "pending bytes")
        rates = self._per_layer(change_rates, "change rate")
        urgent_set = set(self.urgent_layers(rates))
        active = sorted(name for name, nbytes in left.items() if nbytes > 0)
        urgent = [name for name in active if name in urgent_set]
        background = [name for name in active if name not in urgent_set]
        capacity = self.capacity_bytes_per_s
        if urgent and background:
            urgent_total = capacity * self.urgent_share
        else:
            urgent_total = capacity if urgent else 0.0
        planned: dict[str, float] = {}
        urgent_bytes = sum(left[name] for name in urgent)
        for name in urgent:
            planned[name] = urgent_total * left[name] / urgent_bytes
        fastest = max((rates.get(name, 0.0) for name in background), default=0.0)
        weights = {name: max(rates.get(name, 0.0), self.background_floor * fastest) for name in background}
        total_weight = sum(weights.values())
        for name in background:
            share = weights[name] / total_weight if total_weight > 0 else 1.0 / len(background)
            planned[name] = (capacity - urgent_total) * share
        classes: dict[str, RateClass] = {name: "urgent" if name in urgent_set else "background" for name in active}
        return BandwidthPlan(capacity, MappingProxyType(dict(sorted(planned.items()))), MappingProxyType(classes))

    def policy(self, change_rates: Mapping[str, float]) -> LinkPolicy:
        """This scheduler as an `EmulatedLink` policy, for a step whose change rates are `change_rates`."""
        rates = dict(change_rates)
        return lambda left: self.plan(left, rates).rates

    def _per_layer(self, values: Mapping[str, float], what: str) -> dict[str, float]:
        if not isinstance(values, Mapping):
            error = InvalidFieldError(f"the {what} per layer must be a mapping, got {type(values).__name__}")
            self.rejects.record(error)
            raise error
        return {
            _checked_name(name, self.rejects): _checked(value, f"the {what} of layer {name!r}", self.rejects)
            for name, value in values.items()
        }


def static_equal_share(capacity_bytes_per_s: float, layers: int) -> LinkPolicy:
    """The static schedule: every layer's transfer limited to capacity / `layers` for the whole step, as fixed
    per-queue-pair rate limits would; bandwidth a finished layer leaves stays unused."""
    rate = _positive(capacity_bytes_per_s, "the link capacity (bytes/s)") / max(1, layers)
    return lambda left: dict.fromkeys(left, rate)


def fifo(capacity_bytes_per_s: float, order: Sequence[str]) -> LinkPolicy:
    """The other static schedule: one transfer at a time at the full link, in `order` (the order the gradients
    became ready); layers not in `order` go after, by name."""
    capacity = _positive(capacity_bytes_per_s, "the link capacity (bytes/s)")
    position = {name: index for index, name in enumerate(order)}

    def policy(left: Mapping[str, int]) -> dict[str, float]:
        first = min(left, key=lambda name: (position.get(name, len(position)), name))
        return {name: capacity if name == first else 0.0 for name in left}

    return policy


# --- the emulated link -------------------------------------------------------------------------------------


class Clock(Protocol):
    """Seconds since an arbitrary origin, and a way to let them pass."""

    def now(self) -> float: ...

    def wait_until(self, when: float) -> None: ...


class SimulatedClock:
    """Time that passes only when waited for: a run takes no wall time and gives the same result every time."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def wait_until(self, when: float) -> None:
        self._now = max(self._now, when)


class WallClock:
    """`time.perf_counter`, for transfers that really move bytes. Waits sleep until WAIT_SPIN_S before their
    end and spin the rest: a sleep overshoots by tens of µs, as long as a 4 KiB chunk takes at PCIe rates."""

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    def wait_until(self, when: float) -> None:
        if when - self.now() > WAIT_SPIN_S:
            time.sleep(when - self.now() - WAIT_SPIN_S)
        while self.now() < when:
            pass


def _bucket_rate(rate: float) -> float:
    """A token bucket's rate, checked: a finite number ≥ 0 (0 holds the bucket), else ConfigError."""
    if not (math.isfinite(rate) and rate >= 0):
        raise ConfigError(f"a token bucket's rate must be a finite number ≥ 0, got {rate!r}")
    return float(rate)


class TokenBucket:
    """`rate` bytes of tokens per second, at most `burst` held, `tokens` at the start (full by default). Time is
    passed in, so one bucket serves a simulated clock and the wall clock alike."""

    def __init__(self, rate: float, burst: float, now: float = 0.0, *, tokens: float | None = None) -> None:
        self.rate = _bucket_rate(rate)
        self.burst = _positive(burst, "a token bucket's burst (bytes)")
        self._tokens = self.burst if tokens is None else min(self.burst, max(0.0, tokens))
        self._at = now

    def _settle(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now

    def tokens(self, now: float) -> float:
        self._settle(now)
        return self._tokens

    def set_rate(self, rate: float, now: float) -> None:
        """Change the rate from `now` on (tokens earned so far are kept)."""
        checked = _bucket_rate(rate)
        self._settle(now)
        self.rate = checked

    def ready_at(self, nbytes: float, now: float) -> float:
        """The earliest time ≥ `now` when `nbytes` tokens are there (inf at rate 0 without them)."""
        if nbytes > self.burst:
            raise ConfigError(f"{nbytes} bytes can never pass a bucket of burst {self.burst:g}")
        missing = nbytes - self.tokens(now)
        if missing <= 0:
            return now
        return now + missing / self.rate if self.rate > 0 else math.inf

    def take(self, nbytes: float, now: float) -> None:
        """Spend `nbytes` tokens at `now`; only after `ready_at` said so (a rounding error's debt is kept)."""
        if self.ready_at(nbytes, now) > now + 1e-9:
            raise ConfigError(f"{nbytes} bytes taken before the bucket had them")
        self._tokens -= nbytes


@dataclass(frozen=True, slots=True)
class Transfer:
    """One layer's gradient to move; `release_s` after the run starts it may go."""

    layer: str
    nbytes: int
    release_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LinkRun:
    """What one run of transfers over the emulated link took, in seconds from the run's start."""

    capacity_bytes_per_s: float
    completed_s: Mapping[str, float]
    """When each transfer's last byte arrived."""
    first_release_s: float
    bytes_moved: int
    chunks: int

    @property
    def elapsed_s(self) -> float:
        """First release to last completion."""
        return max(self.completed_s.values(), default=self.first_release_s) - self.first_release_s

    @property
    def utilisation(self) -> float:
        """Bytes moved / bytes the link could have moved in `elapsed_s`."""
        elapsed = self.elapsed_s
        return self.bytes_moved / (self.capacity_bytes_per_s * elapsed) if elapsed > 0 else 0.0

    def completed_by(self, layers: Iterable[str]) -> float:
        """When the last of `layers` completed (0 for none)."""
        return max((self.completed_s[name] for name in layers), default=0.0)


class EmulatedLink:
    """An emulated host link, not a real one: a token bucket of `capacity_bytes_per_s` that chunks of
    `chunk_bytes` pass one after another, each layer's transfer behind a token bucket of its own at the rate
    its policy gives it, as a queue pair's rate limit would hold it.

    A chunk has arrived once the link's bucket has earned its bytes (or, if the bytes really move, when `send`
    returns, if later). The link's bucket starts empty and holds at most one chunk, so bytes never arrive
    faster than the capacity, bar one chunk after the link idled. A transfer's bucket starts empty too, so
    that no byte of it goes faster than its rate, and holds at most QUEUE_BURST_CHUNKS, so that a chunk kept
    waiting by the others' on the link does not cost it its rate. Chunks much smaller than the transfers
    keep the link busy while each transfer's bucket fills for the first time.

    The next chunk is that of the transfer whose bucket let it go first (the one kept waiting longest); ties
    go to the transfer listed first. The policy is asked again whenever a transfer is released or completes.
    """

    def __init__(
        self,
        capacity_bytes_per_s: float,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        clock: Clock | None = None,
        rejects: RejectCounter | None = None,
    ) -> None:
        self.capacity_bytes_per_s = _positive(capacity_bytes_per_s, "the link capacity (bytes/s)")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        self.chunk_bytes = chunk_bytes
        self.clock: Clock = clock if clock is not None else SimulatedClock()
        self.rejects = rejects if rejects is not None else RejectCounter("emulated link", _log)

    def run(
        self,
        transfers: Sequence[Transfer],
        policy: LinkPolicy,
        send: Callable[[Transfer, int, int], None] | None = None,
    ) -> LinkRun:
        """Move every transfer under `policy`; `send(transfer, offset, nbytes)` moves each chunk for real."""
        self._check(transfers)
        clock, capacity, chunk = self.clock, self.capacity_bytes_per_s, self.chunk_bytes
        start = clock.now()
        waiting = sorted(range(len(transfers)), key=lambda index: transfers[index].release_s)
        left: dict[int, int] = {}
        buckets: dict[int, TokenBucket] = {}
        link = TokenBucket(capacity, chunk, start, tokens=0.0)
        ready: list[tuple[float, int]] = []  # (when its bucket lets the next chunk go, transfer), one per transfer
        completed: dict[str, float] = {}
        moved = chunks = 0
        replan = False
        while waiting or left:
            now = clock.now()
            while waiting and start + transfers[waiting[0]].release_s <= now:
                index = waiting.pop(0)
                if transfers[index].nbytes == 0:
                    completed[transfers[index].layer] = transfers[index].release_s
                    continue
                left[index] = transfers[index].nbytes
                buckets[index] = TokenBucket(0.0, QUEUE_BURST_CHUNKS * chunk, now, tokens=0.0)
                replan = True
            if replan and left:
                rates = policy({transfers[index].layer: nbytes for index, nbytes in left.items()})
                for index, bucket in buckets.items():
                    layer = transfers[index].layer
                    bucket.set_rate(_checked(rates.get(layer, 0.0), f"the rate of layer {layer!r}", self.rejects), now)
                ready = [(bucket.ready_at(min(chunk, left[index]), now), index) for index, bucket in buckets.items()]
                heapq.heapify(ready)
            replan = False
            next_release = start + transfers[waiting[0]].release_s if waiting else math.inf
            when, best = ready[0] if ready else (math.inf, -1)
            if best >= 0:
                when = max(when, link.ready_at(min(chunk, left[best]), now))
            if next_release <= when:
                if math.isinf(next_release):
                    break
                clock.wait_until(next_release)
                continue
            if math.isinf(when):
                break
            heapq.heappop(ready)
            clock.wait_until(when)
            at = max(clock.now(), when)
            size = min(chunk, left[best])
            buckets[best].take(size, at)
            link.take(size, at)
            transfer = transfers[best]
            if send is not None:
                send(transfer, transfer.nbytes - left[best], size)
            arrived = max(clock.now(), at)
            moved, chunks = moved + size, chunks + 1
            left[best] -= size
            if left[best] == 0:
                del left[best], buckets[best]
                completed[transfer.layer] = arrived - start
                replan = True
            else:
                heapq.heappush(ready, (buckets[best].ready_at(min(chunk, left[best]), at), best))
        if left:
            stuck = ", ".join(sorted(transfers[index].layer for index in left))
            raise ConfigError(f"the policy gives no bandwidth to the pending transfers of {stuck}")
        first = min((transfer.release_s for transfer in transfers), default=0.0)
        return LinkRun(capacity, MappingProxyType(completed), first, moved, chunks)

    def _check(self, transfers: Sequence[Transfer]) -> None:
        names: set[str] = set()
        for transfer in transfers:
            name = _checked_name(transfer.layer, self.rejects)
            if name in names:
                error = InvalidFieldError(f"layer {name!r} has two transfers in one run")
                self.rejects.record(error)
                raise error
            names.add(name)
            _checked(transfer.nbytes, f"the bytes of layer {name!r}", self.rejects)
            if not isinstance(transfer.nbytes, int):
                error = InvalidFieldError(f"the bytes of layer {name!r} must be an integer, got {transfer.nbytes!r}")
                self.rejects.record(error)
                raise error
            _checked(transfer.release_s, f"the release time of layer {name!r}", self.rejects)
