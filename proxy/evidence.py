"""What an operator needs to decide a quarantined call (docs/concepts.md, Quarantine).

Kept with the entry when it is quarantined, shown by ``idemproxy journal show``,
``GET /admin/journal/{kid}`` and the console's entry page::

    {"request": {"headers": [[name, value]], "body_base64": ..., "bytes": n, "truncated": bool},
     "answer": {"status": 502, "headers": [[name, value]], "body_base64": ..., "bytes": n,
                "truncated": bool} or None}

Bounded: the request's body and the answer's first bytes up to ``[server]
max_evidence_bytes`` each (``bytes`` is what there was, ``truncated`` whether more than
was kept). Never a credential: the values of credential headers, of the upstream's
``set_headers`` (injected credentials) and ``redact_headers``, and cookies are kept as
``***``, as configuration secrets are shown; so their names say they were there.
"""

from __future__ import annotations

import base64
from typing import Any

from .config import UpstreamSettings

MASK = "***"
# Headers that carry a credential, whatever the upstream (identity.py reads the same ones)
CREDENTIALS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "x-goog-api-key",
                         "cookie", "set-cookie", "set-cookie2", "idem-run-token"})


def masked(headers: list[tuple[str, str]], upstream: UpstreamSettings,
           credentials: tuple[str, ...] = ()) -> list[list[str]]:
    """``headers`` with every credential's value as ``***`` (``credentials``: the configured
    ``[tenants] credential_headers``, besides ours)."""
    secret = (CREDENTIALS | {h.lower() for h in credentials} | {h.lower() for h in upstream.set_headers}
              | {h.lower() for h in upstream.redact_headers})
    return [[name, MASK if name.lower() in secret else str(value)] for name, value in headers]


def _part(data: bytes, limit: int, size: int | None = None) -> dict[str, Any]:
    """``data`` up to ``limit`` bytes; ``size``: of the whole, when ``data`` is its start only."""
    size = len(data) if size is None else size
    return {"body_base64": base64.b64encode(data[:limit]).decode(), "bytes": size, "truncated": size > limit}


def evidence(upstream: UpstreamSettings, limit: int, request_headers: list[tuple[str, str]], body: bytes,
             status: int = 0, answer_headers: list[tuple[str, str]] | None = None,
             answer_body: bytes = b"", credentials: tuple[str, ...] = (),
             answer_size: int | None = None) -> dict[str, Any]:
    """The evidence of a quarantined call: its request, and the answer if one began (``status``):
    ``answer_body`` its first bytes, of ``answer_size`` read."""
    answer = None
    if status:
        answer = {"status": status, "headers": masked(answer_headers or [], upstream, credentials),
                  **_part(answer_body, limit, answer_size)}
    return {"request": {"headers": masked(request_headers, upstream, credentials), **_part(body, limit)},
            "answer": answer}


def decoded(part: dict[str, Any] | None) -> bytes:
    """The bytes kept of a request's or answer's body."""
    return base64.b64decode(part["body_base64"]) if part and part.get("body_base64") else b""
