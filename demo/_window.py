"""What each engine's batch window did, read from the engine's own `/metrics` (the window's Prometheus series,
docs/batch-window.md), so that the live view and the summary report what the engines measured rather than what the
demo assumes they did; and the demo's `--batch-window` choice, turned into the engine process's flag."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from prismlb.otel import BreakerState

BATCH_WINDOWS = ("adaptive", "fixed", "none")
"""The demo's choices: the adaptive window (the design's), a fixed window of the adaptive one's maximum, or none."""
DEFAULT_BATCH_WINDOW = "adaptive"
_ENGINE_FLAG = {"adaptive": "adaptive", "fixed": "fixed", "none": "off"}
TRANSITION_ORDER = tuple(
    f"{source}->{target}" for source in BreakerState for target in BreakerState if source is not target
)
"""Every breaker transition kind, in the order the summary lists them."""


def engine_batch_window(choice: str) -> str:
    """The engine process's `--batch-window` value for the demo's choice (the engine calls no window `off`)."""
    try:
        return _ENGINE_FLAG[choice]
    except KeyError:
        raise ValueError(f"batch window must be one of {', '.join(BATCH_WINDOWS)}, not {choice!r}") from None


@dataclass(frozen=True)
class WindowReport:
    """One engine's batch window as its `/metrics` showed it: the window a batch opened now would get (model
    seconds; 0 while the breaker is open), the batches handed to the model, and with the adaptive window the
    overrunning batches, the breaker's state and its transitions since the engine started, by kind."""

    window_s: float
    batches: int
    overruns: int | None = None
    state: str | None = None
    transitions: Mapping[str, int] = field(default_factory=dict)

    @property
    def transition_count(self) -> int:
        return sum(self.transitions.values())


def read_window(text: str) -> WindowReport | None:
    """The engine's window from a Prometheus exposition (parsed by prometheus_client's own parser); None when the
    engine runs no window (it exports no window series). Raises ValueError for text that is not an exposition."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    window = samples.get("prism_engine_batch_window_seconds")
    if not window:
        return None
    batches = sum(v for _, v in samples.get("prism_engine_batches_total", []))
    overruns = samples.get("prism_engine_batch_overruns_total")
    states = [labels.get("state", "") for labels, v in samples.get("prism_engine_batch_breaker_state", []) if v == 1]
    transitions = {
        f"{labels.get('from')}->{labels.get('to')}": int(v)
        for labels, v in samples.get("prism_engine_batch_breaker_transitions_total", [])
        if v
    }
    return WindowReport(
        window_s=window[0][1],
        batches=int(batches),
        overruns=int(sum(v for _, v in overruns)) if overruns is not None else None,
        state=states[0] if states else None,
        transitions=transitions,
    )


def describe_transitions(counts: Mapping[str, int]) -> str:
    """`closed->open 2, open->half_open 2, ...` in a fixed order; `none` when the breaker never moved."""
    shown = [f"{kind} {counts[kind]}" for kind in TRANSITION_ORDER if counts.get(kind)]
    shown += [f"{kind} {n}" for kind, n in sorted(counts.items()) if n and kind not in TRANSITION_ORDER]
    return ", ".join(shown) or "none"


def total_transitions(reports: Iterable[WindowReport | None]) -> dict[str, int]:
    """The engines' breaker transitions added up by kind."""
    total: dict[str, int] = {}
    for report in reports:
        if report is not None:
            for kind, n in report.transitions.items():
                total[kind] = total.get(kind, 0) + n
    return total


def window_cell(report: WindowReport | None) -> str:
    """The window and breaker state in a few characters, for the live view: `120ms closed`, `0ms open`, `200ms`."""
    if report is None:
        return "-"
    return f"{report.window_s * 1e3:.0f}ms" + (f" {report.state}" if report.state else "")
