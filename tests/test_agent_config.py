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


def test_otlp_ports_and_trace_filters_from_file_env_and_flag(tmp_path: Path) -> None:
    path = write(tmp_path, "otlp_grpc_port = 0\notlp_http_port = 14318\ntrace_port = [80, 443]\n")
    config = resolve_config(argparse.Namespace(config=str(path)), {"PRISM_TRACE_PIDS": "7,9"})
    assert (config.otlp_grpc_port, config.otlp_http_port) == (0, 14318)
    assert (config.trace_ports, config.trace_pids) == (frozenset({80, 443}), frozenset({7, 9}))
    flags = argparse.Namespace(config=str(path), otlp_http_port="0", trace_port=["8000,8001", "9000"])
    config = resolve_config(flags, {"PRISM_OTLP_HTTP_PORT": "4000"})
    assert (config.otlp_http_port, config.trace_ports) == (0, frozenset({8000, 8001, 9000}))


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"PRISM_OTLP_HTTP_PORT": "x"}, "PRISM_OTLP_HTTP_PORT: OTLP port 'x' is not an integer"),
        ({"PRISM_OTLP_GRPC_PORT": "-1"}, "PRISM_OTLP_GRPC_PORT: OTLP port must be 0 (off) to 65535, got -1"),
        ({"PRISM_TRACE_PORTS": "80,http"}, "PRISM_TRACE_PORTS: port 'http' is not an integer in 1..65535"),
        ({"PRISM_JOIN_DELAY_S": "11"}, "PRISM_JOIN_DELAY_S: join delay must be 0 to 10 seconds, got '11'"),
        ({"PRISM_OTLP_MAX_CONNECTIONS": "many"}, "PRISM_OTLP_MAX_CONNECTIONS: 'many' is not an integer"),
        ({"PRISM_OTLP_READ_TIMEOUT_S": "-1"}, "PRISM_OTLP_READ_TIMEOUT_S: must be positive, got '-1'"),
        ({"PRISM_OTLP_MAX_GRPC_RPCS": "1.5"}, "PRISM_OTLP_MAX_GRPC_RPCS: '1.5' is not an integer"),
        ({"PRISM_OTLP_MAX_INFLIGHT_BYTES": "0"}, "PRISM_OTLP_MAX_INFLIGHT_BYTES: must be positive, got '0'"),
    ],
)
def test_bad_variables_name_themselves(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        resolve_config(argparse.Namespace(), environ)
    assert str(refused.value) == message
