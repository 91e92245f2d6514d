"""Loading the settings: the TOML file (``default.toml`` when none is named), then
``IDEMPROXY_*`` environment variables, then CLI overrides, each value coerced to its
field's type; then validation.py checks the whole."""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import re
import tomllib
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from .masking import Secret
from .settings import ENV_PREFIX, NAMED_SECTIONS, SECTIONS, ConfigError, Settings
from .validation import validate


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like ``"250ms"``, ``"30s"``, ``"5m"``, ``"7d"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", str(value))
    if not m:
        raise ValueError(f"not a duration: {value!r}")
    unit = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"]
    return float(m.group(1)) * unit


def load_settings(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """TOML file, then ``IDEMPROXY_*`` variables, then ``overrides`` (dotted keys)."""
    raw = _read_toml(path)
    for dotted, value in _env_overrides(raw, os.environ if env is None else env):
        _set_dotted(raw, dotted, value)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(raw, dotted, value)
    return _build(raw)


def _read_toml(path: str | os.PathLike | None) -> dict:
    try:
        if path is None:
            text = resources.files("idemproxy.proxy").joinpath("default.toml").read_text()
        else:
            text = Path(path).read_text()
        return tomllib.loads(text)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read configuration {path or 'default.toml'}: {exc}") from exc


def _env_overrides(raw: dict, env: Mapping[str, str]):
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        for section, cls in SECTIONS.items():
            if rest.startswith(section + "_") and rest[len(section) + 1:] in _field_names(cls):
                yield f"{section}.{rest[len(section) + 1:]}", value
        for section, cls in NAMED_SECTIONS.items():
            if not rest.startswith(section + "_"):
                continue
            tail = rest[len(section) + 1:]
            # The longest field name that ends the variable wins, so entry names may
            # themselves contain underscores.
            for fname in sorted(_field_names(cls), key=len, reverse=True):
                if tail.endswith("_" + fname) and len(tail) > len(fname) + 1:
                    yield f"{section}.{tail[:-len(fname) - 1]}.{fname}", value
                    break


# IDEMPROXY_* variables that are not settings: the config file's name, and the test suite's
NOT_SETTINGS = ("IDEMPROXY_CONFIG", "IDEMPROXY_TEST_")


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """``IDEMPROXY_*`` variables that set nothing (a typo, or an option that does not exist)."""
    raw: dict = {}
    known = {ENV_PREFIX + dotted.replace(".", "_").upper() for dotted, _ in _env_overrides(raw, env)}
    return sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known
                  and not name.startswith(NOT_SETTINGS))


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} is not a table")
    if isinstance(value, str):
        value = _parse_scalar(value)
    node[leaf] = value


def _parse_scalar(text: str) -> Any:
    """Environment and CLI values use TOML syntax where they can (numbers, lists, booleans)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.name != "name"}


def _build(raw: dict) -> Settings:
    unknown = set(raw) - set(SECTIONS) - set(NAMED_SECTIONS)
    if unknown:
        raise ConfigError(f"unknown section(s): {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        values[section] = _make(cls, raw.get(section, {}), section)
    for section, cls in NAMED_SECTIONS.items():
        table = raw.get(section, {})
        values[section] = {name: _make(cls, {**body, "name": name}, f"{section}.{name}")
                           for name, body in table.items()}
    settings = Settings(**values)
    validate(settings)
    return settings


def _make(cls, table: Any, where: str):
    if not isinstance(table, dict):
        raise ConfigError(f"[{where}] must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"[{where}] unknown option(s): {', '.join(sorted(unknown))}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in table and
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"[{where}] needs {', '.join(missing)}")
    kwargs = {}
    for key, value in table.items():
        try:
            kwargs[key] = _coerce(hints[key], value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}.{key}: {exc}") from None
    return cls(**kwargs)


def _coerce(hint, value):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or value == "":
            return None
        return _coerce(next(a for a in args if a is not type(None)), value)
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise TypeError(f"expected a boolean, got {value!r}")
        return value
    if hint is float:
        return parse_duration(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"expected an integer, got {value!r}")
        return int(value)
    if hint in (str, Secret):
        if not isinstance(value, (str, int, float)):
            raise TypeError(f"expected a string, got {value!r}")
        return hint(value)
    if origin is tuple:
        items = [value] if isinstance(value, (str, dict)) else list(value)
        return tuple(_coerce(args[0], item) for item in items)
    if origin in (Mapping, collections.abc.Mapping):  # get_origin gives the abc, not typing's alias
        if not isinstance(value, dict):
            raise TypeError(f"expected a table, got {value!r}")
        return {str(k): _coerce(args[1], v) for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return _make(hint, value, hint.__name__)
    raise TypeError(f"unsupported option type {hint}")
