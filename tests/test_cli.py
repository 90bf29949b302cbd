"""`prism`'s exit statuses, run as the installed command runs: a usage error in any command is status 2 with one
line on stderr (argparse's convention), a failure at run time is status 1 with one line."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from prismlb.cli import main

from .conftest import free_port

USAGE_ERRORS: dict[str, tuple[list[str], str]] = {
    # name: (argv, the start of the one line on stderr)
    "no command": ([], "prism: the following arguments are required: COMMAND"),
    "unknown command": (["nosuch"], "prism: argument COMMAND: invalid choice: 'nosuch'"),
    "agent setting": (["agent", "--period", "0"], "prism agent: --period: period must be a positive number"),
    "agent flag type": (["agent", "--metrics-port", "x"], "prism agent: --metrics-port: metrics port 'x' is not an"),
    "brain setting": (["brain", "--priority", "5000"], "prism brain: --priority: priority must be a whole number"),
    "ctl experiment": (["ctl", "experiment", "set", "canary"], "prism ctl: experiment set needs --slice"),
    "ctl arm": (
        ["ctl", "experiment", "set", "canary", "--slice", "llm", "--arm", "v1"],
        "prism ctl: --arm 'v1': expected VERSION=FRACTION",
    ),
    "ctl slice": (["ctl", "experiment", "set", "c", "--slice", "x"], "prism ctl experiment: argument --slice"),
    "top interval": (["top", "--interval", "0"], "prism top: --interval must be positive"),
    "route nothing": (["route"], "prism route: give keys to route, or --nginx"),
    "route timeout": (["route", "--timeout", "0", "k"], "prism route: --timeout must be positive"),
    "route max fails": (["route", "--nginx", "--max-fails", "-1"], "prism route: max_fails (--max-fails)"),
    "route hash": (["route", "--nginx", "--nginx-hash", "$a;b"], "prism route: hash key (--nginx-hash)"),
    "route keys round robin": (["route", "--nginx", "--nginx-hash", "", "k"], "prism route: with --nginx-hash ''"),
    "route listen": (["route", "--nginx", "--nginx-listen", "99999"], "prism route: listen (--nginx-listen)"),
    "route listen with keys": (["route", "--nginx-listen", "8080", "k"], "prism route: --nginx-listen adds"),
    "keys name": (["keys", "../x"], "prism keys: argument name: '../x' is not a key name"),
    "demo duration": (["demo", "--duration", "500"], "prism demo: --duration must be within 5..90 seconds"),
    "eval traces": (["eval", "--traces", "nope"], "prism eval: unknown traces ['nope']"),
    "eval policies": (["eval", "--policies", "nope"], "prism eval: unknown policies ['nope']"),
    "eval ablations": (["eval", "--ablations", "--policies", "round-robin"], "prism eval: --ablations compares"),
    "eval workload": (["eval", "--workload", "nope"], "prism eval: unknown workload family 'nope'"),
    "eval jobs": (["eval", "--jobs", "0"], "prism eval: argument --jobs: runs need at least 1 process"),
    "eval limit": (["eval", "--limit", "5"], "prism eval: argument --limit: a replay needs at least 10 requests"),
    "train steps": (
        ["train", "failover", "--out", "/tmp/x.pt", "--teacher-steps", "0"],
        "prism train: argument --teacher-steps: must be at least 1",
    ),
    "train model": (["train", "nope", "--out", "/tmp/x.pt"], "prism train: argument model: invalid choice: 'nope'"),
}


def prism_runs(argvs: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """`python -m prismlb.cli ARGV` for each, four at a time."""

    def run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "prismlb.cli", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(argvs, pool.map(run, argvs.values()), strict=True))


IN_A_PROCESS = ("no command", "agent flag type", "eval jobs")
"""The usage errors also run as the installed command runs (a process each); the rest through `main` here."""


def _in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """`prism ARGV` through `main` in this process: its exit status and its stderr lines."""
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    return status, capsys.readouterr().err.splitlines()


def test_a_usage_error_is_status_2_and_one_line_in_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    seen = {name: _in_process(argv, capsys) for name, (argv, _) in USAGE_ERRORS.items()}
    done = prism_runs({name: USAGE_ERRORS[name][0] for name in IN_A_PROCESS})
    seen |= {f"{name} (process)": (run.returncode, run.stderr.splitlines()) for name, run in done.items()}
    for name, (status, lines) in seen.items():
        assert status == 2 and len(lines) == 1, f"{name}: status {status}, stderr {lines}"
        assert lines[0].startswith(USAGE_ERRORS[name.removesuffix(" (process)")][1]), f"{name}: {lines[0]}"
    assert "(see prism eval --help)" in seen["eval jobs (process)"][1][0], "argparse's own errors point at --help"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_failure_at_run_time_is_status_1_and_one_line(taken_port: int) -> None:
    updates, snapshot, admin = (f"127.0.0.1:{free_port()}" for _ in range(3))
    failures = {
        "route without a brain": (
            ["route", "--updates", f"tcp://{updates}", "--snapshot", f"tcp://{snapshot}", "--timeout", "0.2", "k"],
            "prism route: no routing table from",
        ),
        "agent on a taken port": (
            ["agent", "--no-ebpf", "--brain", f"tcp://{updates}", "--otlp-grpc-port", "0", "--otlp-http-port", "0"]
            + ["--metrics-addr", "127.0.0.1", "--metrics-port", str(taken_port)],
            f"prism agent: cannot serve /metrics on 127.0.0.1:{taken_port}",
        ),
        "ctl without a brain": (["ctl", "--admin", f"http://{admin}", "status"], "prism ctl: cannot reach"),
        "eval of a missing trace": (["eval", "--trace", "/nonexistent/t.jsonl"], "prism eval: [Errno 2]"),
    }
    done = prism_runs({name: argv for name, (argv, _) in failures.items()})
    for name, run in done.items():
        lines = run.stderr.splitlines()
        assert run.returncode == 1 and len(lines) == 1, f"{name}: status {run.returncode}, stderr {lines}"
        assert lines[0].startswith(failures[name][1]), f"{name}: {lines[0]}"
