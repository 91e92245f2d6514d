"""Idempotency keys minted from a run and a step, so the key exists before the call.

A key is a pure function of (run id, step name, arguments): the same run calling the
same step with the same arguments gets the same key in every attempt, which is what
lets a restarted attempt's call meet the journal entry of the attempt that crashed.
The epoch is deliberately not part of it.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Union

# What a key may be built from: values with one obvious, stable text form. Objects
# whose str() or repr() can change between processes (addresses, set order) are
# refused rather than hashed into a key that silently differs after a restart.
KeyPart = Union[str, int, float, bool, None, list[Any], tuple[Any, ...], dict[str, Any]]

STEP_CHARS = re.compile(r"[^A-Za-z0-9._-]")
MAX_STEP_LENGTH = 64
DIGEST_HEX = 32  # 128 bits: collisions between a run's steps are not a practical concern
SCHEME = "idemproxy-key-v1"


def step_key(run_id: str, step: str, *parts: KeyPart) -> str:
    """The idempotency key of ``step`` called with ``parts`` in run ``run_id``.

    The result is ``<step>:<hex digest>``: readable in logs, at most 97 printable ASCII
    characters, accepted by the proxy and by providers that take ``Idempotency-Key``.
    A step that legitimately runs twice with the same arguments needs a part that tells
    the two apart (a counter, an item id).

    Raises ``TypeError`` for a part that has no stable text form (convert it to ``str``).
    Raises ``ValueError`` for an empty step name.
    """
    if not step:
        raise ValueError("a step name is required")
    material = json.dumps([SCHEME, run_id, step, [_canonical(p) for p in parts]],
                          sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    digest = hashlib.sha256(material.encode()).hexdigest()[:DIGEST_HEX]
    readable = STEP_CHARS.sub("_", step)[:MAX_STEP_LENGTH]
    return f"{readable}:{digest}"


def _canonical(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise TypeError("NaN and infinity have no stable key form")
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("dict keys in an idempotency key part must be strings")
        return {k: _canonical(v) for k, v in value.items()}
    raise TypeError(f"{type(value).__name__} has no stable key form; pass str(value) or its id")
