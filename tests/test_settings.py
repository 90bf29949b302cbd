"""The one settings mechanism: a table of settings resolves flag > variable > file > default, refuses a bad value
with one ConfigError naming where it came from, makes the argparse flags, and renders the documentation's
tables, which must match the docs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from prismlb.agent import AgentConfig
from prismlb.agent import resolve_config as agent_config
from prismlb.agent._config import SETTINGS as AGENT_SETTINGS
from prismlb.brain import BrainConfig
from prismlb.brain import resolve_config as brain_config
from prismlb.brain._config import SETTINGS as BRAIN_SETTINGS
from prismlb.router._cli import GATEWAY_SETTINGS
from prismlb.service import BRAIN_UPDATES, Setting, SettingTable, parse_port, parse_zmq_endpoint
from prismlb.wire import ConfigError

DOCS = Path(__file__).resolve().parent.parent / "docs"

CONFIG = Setting("config", "the settings file", flag="--config", variable="TEST_CONFIG")
TABLE = SettingTable(
    "test",
    [
        CONFIG,
        Setting("port", "a port", parse_port("port"), 80, flag="--port", variable="TEST_PORT", key="port"),
        Setting("name", "a name", default=lambda: "computed", flag="--name", key="name", shown="computed"),
        Setting("hidden", "no flag", parse_port("hidden port"), 1, variable="TEST_HIDDEN"),
        Setting("on", "a switch", lambda raw: raw, False, flag="--on", action="store_true", key="on"),
        Setting("tag", "repeatable", lambda raw: raw, flag="--tag", action="append", key="tag"),
    ],
    file=CONFIG,
)


def parse(table: SettingTable, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    table.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def settings_file(tmp_path: Path) -> Path:
    path = tmp_path / "test.toml"
    path.write_text('port = 8080\nname = "from-file"\non = true\ntag = ["a", "b"]\n')
    return path


def test_flag_beats_variable_beats_file_beats_default(settings_file: Path) -> None:
    defaults = TABLE.resolve(parse(TABLE), {})
    assert (defaults["port"], defaults["name"], defaults["on"], defaults["tag"]) == (80, "computed", False, None)
    assert not defaults.given("port") and defaults.source("port") == "default of --port"
    from_file = TABLE.resolve(parse(TABLE), {"TEST_CONFIG": str(settings_file)})
    assert (from_file["port"], from_file["name"], from_file["on"], from_file["tag"]) == (
        8080,
        "from-file",
        True,
        ["a", "b"],
    )
    assert from_file.source("port") == f"{settings_file}: port"
    from_env = TABLE.resolve(parse(TABLE, "--config", str(settings_file)), {"TEST_PORT": "81"})
    assert (from_env["port"], from_env.source("port"), from_env["name"]) == (81, "TEST_PORT", "from-file")
    from_flag = TABLE.resolve(parse(TABLE, "--config", str(settings_file), "--port", "82"), {"TEST_PORT": "81"})
    assert (from_flag["port"], from_flag.source("port")) == (82, "--port")


def test_an_empty_variable_counts_as_unset() -> None:
    resolved = TABLE.resolve(parse(TABLE), {"TEST_PORT": "", "TEST_CONFIG": "", "TEST_HIDDEN": "7"})
    assert (resolved["port"], resolved["hidden"]) == (80, 7)


@pytest.mark.parametrize(
    ("argv", "environ", "text", "message"),
    [
        (["--port", "x"], {}, "", "--port: port 'x' is not an integer"),
        ([], {"TEST_PORT": "70000"}, "", "TEST_PORT: port must be 0 (off) to 65535, got 70000"),
        ([], {}, 'port = "x"\n', "test.toml: port: port 'x' is not an integer"),
        ([], {}, "port = true\n", "test.toml: port: port True is not an integer"),
        ([], {}, "prot = 1\n", "test.toml: unknown setting(s) prot; known: name, on, port, tag"),
        ([], {}, "port = [\n", "test.toml is not valid TOML"),
    ],
)
def test_a_bad_value_is_one_config_error_naming_its_source(
    tmp_path: Path, argv: list[str], environ: dict[str, str], text: str, message: str
) -> None:
    path = tmp_path / "test.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        TABLE.resolve(parse(TABLE, "--config", str(path), *argv), environ)
    assert message in str(refused.value)


def test_a_bad_computed_default_names_the_default() -> None:
    table = SettingTable("test", [Setting("port", "a port", parse_port("port"), lambda: 99999, flag="--p", shown="x")])
    with pytest.raises(ConfigError, match=r"^default of --p: port must be 0 \(off\) to 65535"):
        table.resolve(argparse.Namespace(), {})


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read test config"):
        TABLE.resolve(parse(TABLE), {"TEST_CONFIG": str(tmp_path / "nope.toml")})


def test_the_flags_come_from_the_table() -> None:
    parser = argparse.ArgumentParser()
    TABLE.add_arguments(parser)
    assert parser.parse_args([]).port is None  # not given, so the variable, the file and the default apply
    assert parser.parse_args(["--on", "--tag", "a", "--tag", "b"]).tag == ["a", "b"]
    help_text = " ".join(parser.format_help().split())
    assert "a port (TEST_PORT; default: 80)" in help_text
    assert "a switch (default: off)" in help_text
    assert "hidden" not in help_text  # no flag: a variable only
    with pytest.raises(ValueError, match="computed default needs `shown`"):
        Setting("x", "x", default=lambda: 1)


@pytest.mark.parametrize(
    ("table", "doc"),
    [(AGENT_SETTINGS, "agent.md"), (BRAIN_SETTINGS, "operations.md"), (GATEWAY_SETTINGS, "router.md")],
    ids=["agent", "brain", "gateway"],
)
def test_the_docs_list_every_setting_as_declared(table: SettingTable, doc: str) -> None:
    text = (DOCS / doc).read_text()
    assert table.markdown() in text, (
        f"docs/{doc}: replace its settings table with {table.service}'s:\n{table.markdown()}"
    )


def test_nothing_given_resolves_to_the_configs_own_defaults() -> None:
    """The tables take their defaults from the config classes, so a service started bare runs as one made in code."""
    assert agent_config(argparse.Namespace(), {}) == AgentConfig()
    assert brain_config(argparse.Namespace(), {}) == BrainConfig()


@dataclass(frozen=True)
class _Config:
    port: int
    label: str
    tag: list[str] | None
    on: bool = True
    unset: int = 7


def test_a_config_is_built_from_the_settings_of_its_fields() -> None:
    """Each field takes its setting (or the one it is renamed from) unless derived; a field without one keeps its
    default, and a setting without a field is left out."""
    resolved = TABLE.resolve(parse(TABLE, "--port", "82", "--tag", "a"), {})
    assert resolved.build(_Config, {"label": "name"}, on=False) == _Config(82, "computed", ["a"], on=False, unset=7)
    with pytest.raises(ValueError, match="unknown field nope, setting missing"):
        resolved.build(_Config, {"nope": "name", "label": "missing"})


def test_services_sharing_a_variable_share_its_declaration() -> None:
    """A variable names one setting: where two services read it, both take the one declaration's default."""
    agent_brain = AGENT_SETTINGS["brain"]
    assert (agent_brain.variable, agent_brain.default) == (
        BRAIN_SETTINGS["ingest"].variable,
        BRAIN_SETTINGS["ingest"].default,
    )
    assert BRAIN_SETTINGS["updates"] is BRAIN_UPDATES
    variables = [s.variable for s in (*AGENT_SETTINGS, *BRAIN_SETTINGS) if s.variable]
    assert all(v.startswith("PRISM_") for v in variables)
    assert parse_zmq_endpoint(BRAIN_UPDATES.default) == "tcp://127.0.0.1:5556"


def prism(argv: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "prismlb.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=os.environ | environ, check=False)


@pytest.mark.parametrize(
    ("argv", "environ", "line"),
    [
        (
            ["agent"],
            {"PRISM_PERIOD_S": "soon"},
            "prism agent: PRISM_PERIOD_S: period 'soon' is not a number of seconds",
        ),
        (["brain"], {"PRISM_BRAIN_PRIORITY": "1.5"}, "prism brain: PRISM_BRAIN_PRIORITY: priority must be a whole"),
        (["route", "k"], {"PRISM_BRAIN_UPDATES": "bogus"}, "prism route: PRISM_BRAIN_UPDATES: must be a ZeroMQ"),
        (["gateway"], {"PRISM_GATEWAY_PORT": "http"}, "prism gateway: PRISM_GATEWAY_PORT: port 'http' is not an"),
    ],
    ids=["agent", "brain", "route", "gateway"],
)
def test_a_bad_variable_is_a_usage_error_in_every_service(argv: list[str], environ: dict[str, str], line: str) -> None:
    run = prism(argv, environ)
    assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith(line), run.stderr


def test_every_prism_variable_is_named_once_in_the_code() -> None:
    """One declaration per `PRISM_*` variable: a second spelling is a second place to forget when it changes."""
    import re
    from collections import Counter
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    named: Counter[str] = Counter()
    for package in ("agent", "brain", "router", "otel", "wire", "cli", "demo", "sim", "service"):
        for path in (root / package).rglob("*.py"):
            named.update(re.findall(r"[\"'](PRISM_[A-Z0-9_]+)[\"']", path.read_text(encoding="utf-8")))
    assert len(named) > 20, "the search found the settings"
    assert [name for name, count in named.items() if count > 1] == []
