"""The systemd units and the `prism` user: hardening directives present, exposure measured by systemd itself."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import free_port, require_ebpf, wait_for

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNITS = ("prism-agent.service", "prism-brain.service", "prism-gateway.service")
HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectHostname": "yes",
    "LockPersonality": "yes",
    "RestrictSUIDSGID": "yes",
    "RestrictRealtime": "yes",
    "RestrictNamespaces": "yes",
    "SystemCallArchitectures": "native",
    "PrivateMounts": "yes",
    "RemoveIPC": "yes",
    "UMask": "0077",
    "User": "prism",
}
MAX_EXPOSURE = 30
"""`systemd-analyze security` exposure × 10 that the units must stay at or under (3.0)."""


def directives(unit: str) -> dict[str, str]:
    text = (DEPLOY / "systemd" / unit).read_text()
    section = text.split("[Service]", 1)[1].split("\n[", 1)[0]
    pairs = (line.split("=", 1) for line in section.splitlines() if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


@pytest.mark.parametrize("unit", UNITS)
def test_units_carry_every_hardening_directive(unit: str) -> None:
    found = directives(unit)
    assert {key: found.get(key) for key in HARDENING} == HARDENING


def test_the_agent_keeps_the_gpus_when_the_clock_is_protected() -> None:
    # ProtectClock= implies DeviceAllow=char-rtc, which shuts every other device unless the unit lists them: the
    # agent reads the GPUs through NVML's /dev/nvidia*, so its unit lists them; the brain has none at all.
    agent = (DEPLOY / "systemd" / "prism-agent.service").read_text()
    assert "ProtectClock=yes" in agent and "DeviceAllow=char-nvidia-frontend rw" in agent
    brain = directives("prism-brain.service")
    assert brain["ProtectClock"] == "yes" and brain["PrivateDevices"] == "yes"


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_rates_the_units_exposure_ok(unit: str) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: the systemd package)")
    path = DEPLOY / "systemd" / unit
    result = subprocess.run(
        [analyze, "security", "--offline=yes", f"--threshold={MAX_EXPOSURE}", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout[-400:] + result.stderr[-400:]


def test_sysusers_creates_the_prism_user(tmp_path: Path) -> None:
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed (Debian: the systemd package)")
    (tmp_path / "etc").mkdir()
    conf = DEPLOY / "sysusers.d" / "prism.conf"
    subprocess.run([sysusers, f"--root={tmp_path}", str(conf)], check=True, capture_output=True, timeout=60)
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc" / "passwd").read_text().splitlines()}
    assert users["prism"][6] == "/usr/sbin/nologin"
    assert "prism" in {line.split(":")[0] for line in (tmp_path / "etc" / "group").read_text().splitlines()}


def _syscall_groups(analyze: str) -> dict[str, list[str]]:
    """Every `@group` of `systemd-analyze syscall-filter` with its members (system calls and nested groups)."""
    listing = subprocess.run([analyze, "syscall-filter"], capture_output=True, text=True, timeout=60, check=True)
    groups: dict[str, list[str]] = {}
    current: list[str] = []
    for line in listing.stdout.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif line.startswith("    ") and not line.strip().startswith("#") and line.strip():
            current.append(line.strip())
    return groups


def _allowed(filter_line: str, groups: dict[str, list[str]]) -> set[str]:
    """The system calls an allow-list `SystemCallFilter=` line admits, its groups expanded."""
    out: set[str] = set()
    todo = filter_line.split()
    while todo:
        name = todo.pop()
        if name.startswith("@"):
            todo += groups[name]
        else:
            out.add(name)
    return out


SECCOMP_EXEC = """
import ctypes, errno, os, sys
lib = ctypes.CDLL("libseccomp.so.2")
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
ctx = lib.seccomp_init(0x00050000 | errno.EPERM)  # SCMP_ACT_ERRNO(EPERM): SystemCallErrorNumber=EPERM
allowed = sys.argv[1].split(",")
for name in allowed:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0 and lib.seccomp_rule_add(ctx, 0x7FFF0000, nr, 0) != 0:  # SCMP_ACT_ALLOW
        raise SystemExit(f"cannot allow {name}")
if lib.seccomp_load(ctx) != 0:
    raise SystemExit("seccomp_load failed")
os.execv(sys.argv[2], sys.argv[2:])
"""


def test_the_agent_runs_its_ebpf_path_under_the_units_system_call_filter() -> None:
    """The unit's `SystemCallFilter=` allow list, with its groups expanded by systemd itself, installed by
    libseccomp before the agent starts (as systemd installs it before exec), EPERM for the rest: the agent
    loads its BPF program, attaches its tracepoints, counts connect() calls and sends vectors."""
    require_ebpf()
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: the systemd package)")
    line = directives("prism-agent.service")["SystemCallFilter"]
    allowed = _allowed(line, _syscall_groups(analyze))
    assert {"bpf", "perf_event_open", "execve", "socket"} <= allowed and "reboot" not in allowed
    port = free_port()
    agent = [sys.executable, "-m", "prismlb.cli", "agent", "--period", "1", "--brain", f"tcp://127.0.0.1:{free_port()}"]
    agent += ["--metrics-addr", "127.0.0.1", "--metrics-port", str(port), "--otlp-grpc-port", "0"]
    agent += ["--otlp-http-port", "0", "--engine-url", f"http://127.0.0.1:{free_port()}/metrics"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SECCOMP_EXEC, ",".join(sorted(allowed)), *agent],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def metrics() -> dict[str, float]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return {}
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    try:
        seen = wait_for(
            lambda: (
                (m := metrics()).get("prism_agent_ebpf_up") == 1.0
                and m.get("prism_agent_vectors_sent_total", 0) >= 2
                and m.get("prism_agent_node_connect_calls_total", 0) > 0
            ),
            timeout_s=120,
            what="the agent's eBPF path and vectors under the system call filter",
        )
        assert seen, metrics()
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert "Operation not permitted" not in err, err[-2000:]
