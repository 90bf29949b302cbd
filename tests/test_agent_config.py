"""Agent settings from a TOML file, overridden by environment variables and flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prismlb.agent import resolve_config
from prismlb.wire import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def test_file_then_env_then_flag(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'node_id = "from-file"\nzone = "z-file"\nperiod = 2.5\nlabels = { gpu = "h100", nvlink = "yes" }\n'
        'engine_url = "http://127.0.0.1:8000/metrics"\nkv_events = "tcp://127.0.0.1:5557"\nebpf = false\n',
    )
    config = resolve_config(argparse.Namespace(config=str(path), zone="z-flag"), {"PRISM_NODE_ID": "from-env"})
    assert config.node_id == "from-env"
    assert config.zone == "z-flag"
    assert config.period_s == 2.5
    assert config.labels == {"gpu": "h100", "nvlink": "yes"}
    assert config.engine_url == "http://127.0.0.1:8000/metrics" and config.kv_events == "tcp://127.0.0.1:5557"
    assert config.ebpf is False
    via_env = resolve_config(argparse.Namespace(), {"PRISM_AGENT_CONFIG": str(path)})
    assert via_env.node_id == "from-file"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('nodeid = "x"\n', "unknown setting"),
        ("node_id = [\n", "not valid TOML"),
        ('period = "soon"\n', "period"),
        ('ebpf = "yes"\n', "true or false"),
        ('kv_replay = "tcp://127.0.0.1:1"\n', "without --kv-events"),
        ('engine_url = "ftp://x"\n', "http://HOST:PORT"),
        ("kv_full_every = 0\n", "positive number of seconds"),
    ],
)
def test_bad_files_are_config_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_config(argparse.Namespace(config=str(write(tmp_path, text))), {})


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_config(argparse.Namespace(config=str(tmp_path / "nope.toml")), {})


def test_kv_full_every_from_file_env_and_flag(tmp_path: Path) -> None:
    assert resolve_config(argparse.Namespace(), {}).kv_full_every_s == 60.0
    path = write(tmp_path, "kv_full_every = 30\n")
    assert resolve_config(argparse.Namespace(config=str(path)), {}).kv_full_every_s == 30.0
    env = {"PRISM_KV_FULL_EVERY_S": "15"}
    assert resolve_config(argparse.Namespace(config=str(path)), env).kv_full_every_s == 15.0
    flag = argparse.Namespace(config=str(path), kv_full_every="5")
    assert resolve_config(flag, env).kv_full_every_s == 5.0
