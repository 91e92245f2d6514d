"""How the Redis store names runs in keys and keeps values in hashes: text both ways."""

from __future__ import annotations

from typing import Any

import orjson


def run_ref(namespace: str, run_id: str) -> str:
    """A run's name in keys: the length prefix keeps any namespace apart from the run id."""
    return f"{len(namespace.encode())}:{namespace}:{run_id}"


def text(value: bytes | str | None) -> str | None:
    """A reply's bytes as text (None stays None)."""
    return value.decode() if isinstance(value, bytes) else value


def field(value: Any) -> str:
    """A value as the text Redis keeps (every float the store writes goes through here). A
    float's is its shortest round-trip digits, as from repr() (only tiny numbers read
    differently: 0.00002 for 2e-05), written by orjson at a fraction of repr()'s cost
    (five per record)."""
    return orjson.dumps(value).decode() if type(value) is float else str(value)


def maybe(kind: type, value: bytes | None) -> Any:
    """``kind(value)``, or None for a field the hash does not have."""
    return None if value is None else kind(value)
