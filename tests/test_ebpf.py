"""The real eBPF connect() counter through bcc (the connection tracer's program), the CLI's --print-bpf and the
host check; skipped only without root or bcc."""

from __future__ import annotations

import argparse
import os
import socket

import pytest

from prismlb.agent import ConnectionTracer, add_parser, check, probe_ebpf
from prismlb.bpf import program_text

from .conftest import require_ebpf

pytestmark = pytest.mark.ebpf

TRACEPOINTS = [
    "syscalls:sys_enter_connect",
    "sock:inet_sock_set_state",
    "sock:sock_send_length",
    "sock:sock_recv_length",
    "tcp:tcp_retransmit_skb",
    "tcp:tcp_receive_reset",
    "tcp:tcp_send_reset",
    "tcp:tcp_destroy_sock",
]
CHECK_NAMES = [
    "root",
    "bcc",
    "tracefs",
    "kernel headers",
    *(f"tracepoint {name}" for name in TRACEPOINTS),
    "bpf load",
    "nvml",
]


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prism")
    add_parser(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def test_counter_sees_every_connect() -> None:
    require_ebpf()
    counter, detail = probe_ebpf()
    assert counter is not None, detail
    with counter, socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        address = listener.getsockname()
        before = counter.total()
        for _ in range(20):
            with socket.create_connection(address, timeout=2):
                pass
        after = counter.total()
        assert counter.tracer.connect_calls_total() == counter.total()
    assert after - before >= 20


def test_probe_without_root_says_run_as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    counter, detail = probe_ebpf()
    assert counter is None
    assert "run as root" in detail
    assert "\n" not in detail


def test_print_bpf_prints_the_tracepoint_program(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli(["agent", "--print-bpf"]) == 0
    out = capsys.readouterr().out
    for tracepoint in TRACEPOINTS:
        category, name = tracepoint.split(":")
        assert f"TRACEPOINT_PROBE({category}, {name})" in out
    assert out == program_text("conntrack") == ConnectionTracer.program_text()
    assert "kprobe" not in out.lower()


def test_check_prints_one_aligned_line_per_item(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli(["agent", "--check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    detail_column = len("ok ") + 1 + max(len(name) for name in CHECK_NAMES) + 1
    assert len(lines) == len(CHECK_NAMES)
    for line, name in zip(lines, CHECK_NAMES, strict=True):
        assert line[:3] in ("ok ", "no ")
        assert line[4:detail_column].rstrip() == name
        assert line[detail_column] != " "


def test_unknown_program_is_an_error() -> None:
    with pytest.raises(FileNotFoundError):
        program_text("no_such_program")


def test_check_lists_every_item() -> None:
    rows = check()
    assert [name for name, _ok, _detail in rows] == CHECK_NAMES
    for _name, ok, detail in rows:
        assert isinstance(ok, bool)
        assert detail and "\n" not in detail
    _name, nvml_ok, nvml_detail = rows[-1]
    assert nvml_ok or nvml_detail.startswith("no NVIDIA driver")


def test_check_as_root_loads_the_program() -> None:
    require_ebpf()
    rows = {name: (ok, detail) for name, ok, detail in check()}
    for name in CHECK_NAMES[:-1]:
        ok, detail = rows[name]
        assert ok, f"{name}: {detail}"
