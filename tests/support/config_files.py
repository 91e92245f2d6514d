"""Configuration files for the proxies the tests and the soak start: TOML written from dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from idemproxy.proxy.config_view import to_toml


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    """Write a TOML file from {"server": {...}, "upstreams.openai": {...}}, as the proxy shows its own."""
    path.write_text(to_toml(sections))
    return path
