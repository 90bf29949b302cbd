"""The systemd units and the `prism` user: hardening directives present, exposure measured by systemd itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNITS = ("prism-agent.service", "prism-brain.service")
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
MAX_EXPOSURE = 40
"""`systemd-analyze security` exposure × 10 that the units must stay at or under (4.0, "OK")."""


def directives(unit: str) -> dict[str, str]:
    text = (DEPLOY / "systemd" / unit).read_text()
    section = text.split("[Service]", 1)[1].split("\n[", 1)[0]
    pairs = (line.split("=", 1) for line in section.splitlines() if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


@pytest.mark.parametrize("unit", UNITS)
def test_units_carry_every_hardening_directive(unit: str) -> None:
    found = directives(unit)
    assert {key: found.get(key) for key in HARDENING} == HARDENING


def test_only_the_brain_protects_the_clock() -> None:
    # ProtectClock= implies DeviceAllow=char-rtc, which shuts other devices before systemd 253: the agent reads
    # the GPUs through NVML's /dev/nvidia*; the brain has no devices at all (PrivateDevices=).
    assert "ProtectClock" not in directives("prism-agent.service")
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
