"""Configuration files for the proxies the tests and the soak start: TOML written from dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    """Write a TOML file from {"server": {...}, "upstreams.openai": {...}}."""
    lines = []
    for name, body in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in body.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path
