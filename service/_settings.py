"""Every service's settings, each declared once and all resolved in one place.

A `Setting` names one setting everywhere it can be given: its command-line flag, its `PRISM_*` environment
variable, its key in the service's TOML file (where the service reads one), with its parser, its default and its
help. A service lists its settings in a `SettingTable`, which adds the argparse flags (their help showing the
variable and the default), renders the documentation's table, and resolves every setting the same way: an
explicit argument (a flag) beats the variable, which beats the file, which beats the default. An empty variable
counts as unset, as OpenTelemetry's own variables do, so a unit file's `PRISM_X=` line leaves the default.

The value found goes through the setting's parser, the default too, so that a default computed at start (the host
name) is checked like a given value. A parser refuses a value by raising ValueError with what is wrong; the
resolver turns that into one ConfigError naming where the value came from (the flag, the variable, or the file
and its key). Components then take the resolved plain values: none reads the environment.
"""

from __future__ import annotations

import argparse
import math
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

from prismlb.wire import ClientCurve, ConfigError

SettingParser = Callable[[Any], Any]
"""A raw value (text from a flag or variable, or what the TOML file holds) to the setting's value; ValueError
says what is wrong with it."""

Action = Literal["store", "append", "store_true", "store_false"]

_Config = TypeVar("_Config")


def parse_text(raw: object) -> str:
    """Any text, as given."""
    if not isinstance(raw, str):
        raise ValueError(f"{raw!r} is not text")
    return raw


def parse_number(raw: object, kind: type[int] | type[float], error: str) -> int | float:
    """`raw` (text, or a TOML number) as a `kind`; ValueError(`error`) for anything else, a boolean too: TOML's
    `true` is no number, though Python's `float(True)` would take it."""
    try:
        if isinstance(raw, bool):
            raise ValueError
        return kind(str(raw))
    except ValueError:
        raise ValueError(error) from None


def parse_positive(kind: type[int] | type[float]) -> SettingParser:
    """A positive, finite number of `kind`."""

    def parse(raw: object) -> int | float:
        value = parse_number(raw, kind, f"{raw!r} is not {'an integer' if kind is int else 'a number'}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"must be positive, got {raw!r}")
        return value

    return parse


def parse_listen_address(raw: object) -> str:
    """A host name or IP address to listen on."""
    if not parse_text(raw):
        raise ValueError("empty address")
    return str(raw)


def parse_port(what: str) -> SettingParser:
    """A TCP port, 0 (off) to 65535, called `what` in errors."""

    def parse(raw: object) -> int:
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ValueError(f"{what} {raw!r} is not an integer")
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{what} {raw!r} is not an integer") from None
        if not 0 <= value <= 65535:
            raise ValueError(f"{what} must be 0 (off) to 65535, got {value}")
        return value

    return parse


def parse_zmq_endpoint(raw: object) -> str:
    """A ZeroMQ endpoint a service binds (tcp://HOST:PORT, ipc://PATH or inproc://NAME)."""
    value = parse_text(raw)
    if not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"must be a ZeroMQ endpoint (tcp://host:port or ipc://path), got {value!r}")
    return value


def parse_key_file(raw: object) -> Path:
    """A CURVE key file that exists."""
    path = Path(parse_text(raw))
    if not path.is_file():
        raise ValueError(f"CURVE key file {path} does not exist")
    return path


@dataclass(frozen=True)
class Setting:
    """One setting and every name it goes by. `name` is its argparse destination and its key among the resolved
    values; a setting without `flag`, `variable` or `key` cannot be given that way."""

    name: str
    help: str
    parse: SettingParser = parse_text
    default: Any = None
    """The value when nothing gives one, written as a flag or the file would give it (it is parsed too); a
    callable is called for it at resolution; None leaves the setting unset (None)."""
    flag: str | None = None
    variable: str | None = None
    key: str | None = None
    """Its key in the service's TOML file."""
    action: Action = "store"
    """How argparse takes the flag: one value, a repeatable value (a list), or a switch with no value."""
    metavar: str | None = None
    shown: str | None = None
    """The default as help and documentation show it, where its value does not say it well."""

    def __post_init__(self) -> None:
        if callable(self.default) and self.shown is None:
            raise ValueError(f"setting {self.name}: a computed default needs `shown`, how help shows it")

    @property
    def label(self) -> str:
        """The flag with its variable, for messages: `--flag (VARIABLE)`."""
        first = self.flag or self.variable or self.key or self.name
        return f"{first} ({self.variable})" if self.flag and self.variable else first

    @property
    def shown_default(self) -> str:
        """The default in words for help and documentation: "none", "empty", "on"/"off", or its value."""
        if self.shown is not None:
            return self.shown
        if self.default is None or self.default in ([], {}):
            return "none"
        if self.default == "":
            return "empty"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return str(self.default)


def _default_source(s: Setting) -> str:
    return f"default of {s.flag or s.variable or s.key or s.name}"


@dataclass(frozen=True)
class ResolvedSettings:
    """A service's resolved settings: each value (None where unset) and where each given one came from."""

    table: SettingTable
    values: Mapping[str, Any]
    sources: Mapping[str, str]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def given(self, name: str) -> bool:
        """Whether a flag, the variable or the file set it (rather than its default)."""
        return name in self.sources

    def source(self, name: str) -> str:
        """Where the value came from: its flag, its variable, `FILE: key`, or its default."""
        return self.sources.get(name) or _default_source(self.table[name])

    def build(self, config: type[_Config], renamed: Mapping[str, str] | None = None, **derived: Any) -> _Config:
        """The dataclass `config` from these values: each field takes the setting of its name, or of the name
        `renamed` maps it to (field: setting), but for the fields in `derived` (worked out from several settings);
        a field no setting names keeps its default. One way from settings to a service's config, not a list by
        hand that a new setting can be left out of."""
        renamed = renamed or {}
        names = {f.name: renamed.get(f.name, f.name) for f in fields(config) if f.init and f.name not in derived}
        wrong = [f"field {n}" for n in renamed if n not in names] + [
            f"setting {s}" for s in renamed.values() if s not in self.values
        ]
        if wrong:
            raise ValueError(f"{config.__name__}: renamed names an unknown {', '.join(wrong)}")
        values = {name: self.values[setting] for name, setting in names.items() if setting in self.values}
        return config(**values, **derived)


@dataclass(frozen=True)
class SettingTable:
    """A service's settings, in the order its help and documentation list them. `file`, one of them, is the
    setting naming the TOML file the others' keys are read from."""

    service: str
    settings: Sequence[Setting]
    file: Setting | None = None
    _by_name: dict[str, Setting] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        by_name = {s.name: s for s in self.settings}
        if len(by_name) != len(self.settings):
            raise ValueError(f"{self.service}: two settings share a name")
        if self.file is not None and by_name.get(self.file.name) is not self.file:
            raise ValueError(f"{self.service}: the file setting {self.file.name} is not in the table")
        object.__setattr__(self, "_by_name", by_name)

    def __getitem__(self, name: str) -> Setting:
        return self._by_name[name]

    def __iter__(self) -> Iterator[Setting]:
        return iter(self.settings)

    @property
    def keys(self) -> frozenset[str]:
        """The keys the service's TOML file may hold."""
        return frozenset(s.key for s in self.settings if s.key)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """A flag for each setting that has one. Every flag defaults to None, "not given", so that the variable,
        the file and the default apply; its help names the variable and the default."""
        for s in self.settings:
            if s.flag is None:
                continue
            where = f"{s.variable}; " if s.variable else ""
            help_text = f"{s.help} ({where}default: {s.shown_default})".replace("%", "%%")
            if s.action in ("store_true", "store_false"):
                parser.add_argument(s.flag, dest=s.name, action=s.action, default=None, help=help_text)
            else:
                parser.add_argument(s.flag, dest=s.name, action=s.action, metavar=s.metavar, help=help_text)

    def resolve(self, args: argparse.Namespace, environ: Mapping[str, str]) -> ResolvedSettings:
        """Every setting from `args` (an attribute per name, None or missing: not given), then `environ`, then
        the TOML file, then its default; ConfigError naming the source of the first value refused."""
        file, path = self._load_file(args, environ)
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for s in self.settings:
            raw, source = self._raw(s, args, environ, file, path)
            if raw is None:
                values[s.name] = None
                continue
            if source:
                sources[s.name] = source
            try:
                values[s.name] = s.parse(raw)
            except ValueError as exc:
                raise ConfigError(f"{source or _default_source(s)}: {exc}") from None
        return ResolvedSettings(self, values, sources)

    def _raw(
        self, s: Setting, args: argparse.Namespace, environ: Mapping[str, str], file: Mapping[str, Any], path: str
    ) -> tuple[Any, str]:
        """(raw value, where it came from); the source is "" for the default."""
        value = getattr(args, s.name, None)
        if value is not None:
            return value, s.flag or "argument"
        if s.variable and environ.get(s.variable):
            return environ[s.variable], s.variable
        if s.key and s.key in file:
            return file[s.key], f"{path}: {s.key}"
        return (s.default() if callable(s.default) else s.default), ""

    def _load_file(self, args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[dict[str, Any], str]:
        if self.file is None:
            return {}, ""
        path, _ = self._raw(self.file, args, environ, {}, "")
        if not path:
            return {}, ""
        try:
            with open(path, "rb") as f:
                file = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read {self.service} config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{self.service} config {path} is not valid TOML: {exc}") from None
        unknown = sorted(set(file) - self.keys)
        if unknown:
            raise ConfigError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(self.keys))}")
        return file, str(path)

    def markdown(self) -> str:
        """The documentation's table of these settings: flag, variable, TOML key (where the service reads a
        file), default and what each does."""
        columns = ["flag", "environment variable", *(["TOML key"] if self.file else []), "default", "what"]
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for s in self.settings:
            flag = "—"
            if s.flag:
                flag = f"`{s.flag} {s.metavar}`" if s.metavar else f"`{s.flag}`"
                flag += " (repeatable)" if s.action == "append" else ""
            cells = [flag, f"`{s.variable}`" if s.variable else "—"]
            if self.file:
                cells.append(f"`{s.key}`" if s.key else "—")
            cells += [s.shown_default, s.help.replace("|", "\\|")]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"


BRAIN_INGEST = Setting(
    "ingest",
    "the brain's endpoint for node vectors (PULL)",
    parse_zmq_endpoint,
    "tcp://127.0.0.1:5555",
    flag="--ingest",
    variable="PRISM_BRAIN_INGEST",
)
"""The brain's three endpoints: it binds them, agents and routers connect to them, under the same variables."""
BRAIN_UPDATES = Setting(
    "updates",
    "the brain's endpoint for routing-table updates (PUB)",
    parse_zmq_endpoint,
    "tcp://127.0.0.1:5556",
    flag="--updates",
    variable="PRISM_BRAIN_UPDATES",
)
BRAIN_SNAPSHOT = Setting(
    "snapshot",
    "the brain's endpoint for routing-table snapshots (ROUTER)",
    parse_zmq_endpoint,
    "tcp://127.0.0.1:5557",
    flag="--snapshot",
    variable="PRISM_BRAIN_SNAPSHOT",
)
CURVE_SECRET = Setting(
    "curve_secret",
    "this service's CURVE secret key file",
    parse_key_file,
    flag="--curve-secret",
    variable="PRISM_CURVE_SECRET",
    metavar="FILE",
    shown="off",
)
"""A service's own CURVE secret key, the agent's or the brain's."""
BRAIN_PUBLIC = Setting(
    "brain_public",
    "the brain's CURVE public key file; needs --curve-secret",
    parse_key_file,
    flag="--brain-public",
    variable="PRISM_BRAIN_PUBLIC",
    metavar="FILE",
    shown="off",
)
"""The brain's CURVE public key, for the services that connect to it (the agent, the gateway)."""


def client_curve(settings: ResolvedSettings) -> ClientCurve | None:
    """CURVE to the brain from `CURVE_SECRET` and `BRAIN_PUBLIC`: both key files, or none; one alone is a mistake,
    not plaintext (ConfigError naming where it was given)."""
    secret, public = settings["curve_secret"], settings["brain_public"]
    if secret is None and public is None:
        return None
    if secret is None or public is None:
        table = settings.table
        given = settings.source("curve_secret" if secret is not None else "brain_public")
        raise ConfigError(
            f"{given} given alone: CURVE needs both {table['curve_secret'].label} and {table['brain_public'].label}"
        )
    return ClientCurve(secret_file=secret, server_public_file=public)
