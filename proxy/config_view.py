"""The configuration shown to people: ``idemproxy config`` (the effective settings, secrets
masked) and docs/configuration.md's table of every option, generated from the dataclasses in
config/settings.py so that it cannot drift::

    python -m idemproxy.proxy.config_view --markdown
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import typing
from typing import Any

from .config import ENV_PREFIX, NAMED_SECTIONS, SECTIONS, Secret, Settings, mask_url

MASK = "***"


def effective(settings: Settings) -> dict[str, Any]:
    """Every option's value after file, environment and flags, as TOML tables."""
    out: dict[str, Any] = {}
    for section in SECTIONS:
        out[section] = _table(getattr(settings, section))
    for section in NAMED_SECTIONS:
        out[section] = {name: _table(value) for name, value in getattr(settings, section).items()}
    return out


def _table(value: Any) -> dict[str, Any]:
    return {f.name: _plain(f.name, getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "name"}


def _plain(name: str, value: Any) -> Any:
    if isinstance(value, Secret):
        return MASK
    if isinstance(value, str) and (name.endswith("url") or name == "proxy"):  # proxy: user:pass@
        return mask_url(value)
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(name, v) for v in value]
    if isinstance(value, typing.Mapping):
        return {k: _plain(name, v) for k, v in value.items()}
    return value


def to_toml(tables: dict[str, Any]) -> str:
    """The few TOML shapes settings take: tables of scalars, lists and inline tables."""
    lines: list[str] = []

    def emit(header: str, table: dict[str, Any]) -> None:
        lines.append(f"[{header}]")
        lines.extend(f"{key} = {toml_value(v)}" for key, v in table.items() if v is not None)
        lines.append("")
    for section, table in tables.items():
        if section in NAMED_SECTIONS:
            for name, body in table.items():
                emit(f"{section}.{_key(name)}", body)
        else:
            emit(section, table)
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """A value as TOML (inline tables for dicts; None members left out)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):  # JSON's escapes are TOML's, but for DEL, which TOML escapes too
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{toml_value(k)} = {toml_value(v)}" for k, v in value.items() if v is not None) + " }"
    raise TypeError(f"no TOML for {value!r}")


def _key(name: str) -> str:
    """A table name as a TOML key: bare when it can be, quoted otherwise."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else toml_value(name)


def options() -> list[tuple[str, str, str]]:
    """(``[section] option``, default, environment variable) for every option."""
    rows = []
    for section, cls in {**SECTIONS, **NAMED_SECTIONS}.items():
        named = section in NAMED_SECTIONS
        header = f"[{section}.NAME]" if named else f"[{section}]"
        for f in dataclasses.fields(cls):
            if f.name == "name":
                continue
            default = ("(required)" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                       else toml_value(_plain(f.name, f.default_factory() if f.default is dataclasses.MISSING
                                          else f.default)) if f.default is not None else "(unset)")
            env = f"{ENV_PREFIX}{section.upper()}_{'NAME_' if named else ''}{f.name.upper()}"
            rows.append((f"{header} {f.name}", default, env))
    return rows


def markdown_table() -> str:
    lines = ["| option | default | environment |", "|---|---|---|"]
    lines += [f"| `{option}` | `{default}` | `{env}` |".replace("`(", "(").replace(")`", ")")
              for option, default, env in options()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m idemproxy.proxy.config_view --markdown")
    sys.stdout.write(markdown_table())
