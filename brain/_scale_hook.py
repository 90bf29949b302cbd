"""Scale-out hooks the SLO guardian calls: a command or a webhook, run off the guardian's thread.

A command gets the event in its environment (`PRISM_SCALE_EVENT` as JSON, plus `PRISM_SCALE_REASON`,
`PRISM_SCALE_LOAD_FACTOR`, `PRISM_SCALE_QPS`, `PRISM_SCALE_BASELINE_QPS`, `PRISM_GUARDIAN_STATE`); a non-zero
exit is a failure, and on timeout its whole process group is killed. A webhook gets the event as a JSON POST;
an HTTP error status is a failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from prometheus_client import Counter

from prismlb.service import BoundedWorker, QueueEntry
from prismlb.wire import ConfigError, PrismError

_log = logging.getLogger("prism.brain")


@dataclass(frozen=True)
class ScaleEvent:
    """Why the guardian asks for capacity."""

    at_s: float
    state: str
    reason: str
    load_factor: float
    qps: float
    baseline_qps: float


ScaleHook = Callable[[ScaleEvent], None]


class HookError(PrismError):
    """A scale-out hook failed; the message says how."""


@dataclass(frozen=True)
class CommandHook:
    argv: tuple[str, ...]
    timeout_s: float = 10.0

    def __call__(self, event: ScaleEvent) -> None:
        env = os.environ | {
            "PRISM_SCALE_EVENT": msgspec.json.encode(event).decode(),
            "PRISM_SCALE_REASON": event.reason,
            "PRISM_SCALE_LOAD_FACTOR": f"{event.load_factor:.3f}",
            "PRISM_SCALE_QPS": f"{event.qps:.3f}",
            "PRISM_SCALE_BASELINE_QPS": f"{event.baseline_qps:.3f}",
            "PRISM_GUARDIAN_STATE": event.state,
        }
        try:
            proc = subprocess.Popen(
                self.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise HookError(f"cannot run {self.argv[0]}: {exc}") from None
        with proc:
            try:
                _, stderr = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise HookError(f"{self.argv[0]} timed out after {self.timeout_s:g} s") from None
        if proc.returncode != 0:
            last = stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise HookError(f"{self.argv[0]} exited with {proc.returncode}: {last[0][:200]}")


@dataclass(frozen=True)
class WebhookHook:
    url: str
    timeout_s: float = 10.0

    def __call__(self, event: ScaleEvent) -> None:
        request = urllib.request.Request(
            self.url,
            data=msgspec.json.encode(event),
            headers={"Content-Type": "application/json", "User-Agent": "prism-brain"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except OSError as exc:  # URLError, HTTPError and timeouts are all OSErrors
            raise HookError(f"POST {self.url}: {exc}") from None


def parse_hook(spec: str, timeout_s: float = 10.0) -> ScaleHook:
    """`http://…` or `https://…` is a webhook; anything else a command line (split like a shell)."""
    if spec.startswith(("http://", "https://")):
        return WebhookHook(spec, timeout_s)
    argv = tuple(shlex.split(spec))
    if not argv:
        raise ConfigError("scale-out hook is empty")
    return CommandHook(argv, timeout_s)


class HookRunner(BoundedWorker[ScaleEvent]):
    """Runs a hook on its own thread (`BoundedWorker`), one call at a time with at most one waiting; the rest are
    skipped, and counted."""

    def __init__(self, hook: ScaleHook, results: Counter) -> None:
        self._hook = hook
        self._results = results
        super().__init__("scale-hook", max_queue=1)

    def submit(self, event: ScaleEvent) -> None:
        if not self._offer([QueueEntry(event)], 1):
            self._results.labels("skipped").inc()
            _log.warning("scale-out hook still busy; request skipped (%s)", event.reason)

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread: a call waiting is not made (the brain is stopping), one running is not waited for
        beyond `timeout_s`."""
        self.shutdown(timeout_s, drain=False)

    def _process(self, batch: list[ScaleEvent], items: int) -> None:
        for event in batch:
            try:
                self._hook(event)
            except Exception as exc:
                self._results.labels("failed").inc()
                _log.warning("scale-out hook failed: %s", exc)
            else:
                self._results.labels("ok").inc()
                _log.info("scale-out hook done (%s)", event.reason)
