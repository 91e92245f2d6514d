"""Configuration files for the proxies the tests and the soak start: TOML written from dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from idemproxy.proxy.config_view import toml_value


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    """Write a TOML file from {"server": {...}, "upstreams.openai": {...}}."""
    lines = []
    for name, body in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in body.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path
