"""The fingerprint of a request: what makes two calls "the same call" (SPEC §3).

SHA-256 over method, upstream, path with query, and body. JSON bodies are
canonicalised first (keys sorted, no insignificant whitespace, numbers as parsed), so
a client that serialises its dict in another order still maps onto its recorded call.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Iterable

import orjson

# orjson reads integers past 64 bits as floats, losing digits; such bodies go through the
# standard library, which keeps them exact.
LONG_NUMBER = re.compile(rb"\d{19}")


def canonical_json(body: bytes, ignore: Iterable[str] = ()) -> bytes | None:
    """Canonical bytes of a JSON body with ``ignore`` paths removed; None if not JSON."""
    try:
        value = json.loads(body) if LONG_NUMBER.search(body) else orjson.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # orjson's error is a ValueError
        return None
    for path in ignore:
        _drop(value, path.split("."))
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _drop(node: Any, path: list[str]) -> None:
    """Remove the field at a dotted path; ``*`` matches every key or index."""
    head, rest = path[0], path[1:]
    if isinstance(node, dict):
        children = list(node) if head == "*" else [head] if head in node else []
    elif isinstance(node, list):
        if head == "*":
            children = list(range(len(node)))
        elif head.isdigit() and int(head) < len(node):
            children = [int(head)]
        else:
            children = []
    else:
        return
    if not rest:
        if isinstance(node, dict):
            for child in children:
                del node[child]
        else:  # dropping list items would shift their siblings; blank them instead
            for child in children:
                node[child] = None
        return
    for child in children:
        _drop(node[child], rest)


def fingerprint(method: str, upstream: str, path_qs: str, body: bytes, content_type: str,
                ignore: Iterable[str] = ()) -> str:
    if body and "json" in content_type:
        canonical = canonical_json(body, ignore)
        if canonical is not None:
            body = canonical
    h = hashlib.sha256()
    for part in (method.upper().encode(), upstream.encode(), path_qs.encode()):
        h.update(part)
        h.update(b"\0")
    h.update(body)
    return h.hexdigest()
