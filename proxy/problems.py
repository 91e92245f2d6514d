"""Refusals, and the one place they become HTTP answers (RFC 9457 problem+json).

Every refusal is a :class:`Problem` with a stable ``type`` slug; clients match on the
slug (``https://idemproxy.dev/problems/<slug>``), never on the human ``detail``.
"""

from __future__ import annotations

import orjson
from aiohttp import web

TYPE_BASE = "https://idemproxy.dev/problems/"

# slug -> (status, title)
PROBLEMS: dict[str, tuple[int, str]] = {
    "invalid-key": (400, "Malformed Idempotency-Key"),
    "invalid-header": (400, "Malformed idemproxy header"),
    "invalid-request": (400, "Request refused"),
    "invalid-body": (400, "Malformed request body"),
    "unauthorized": (401, "Admin token required"),
    "untrusted-tenant": (403, "Tenant header from an untrusted source"),
    "unknown-upstream": (404, "Unknown upstream"),
    "not-found": (404, "Not found"),
    "in-flight": (409, "A request with this key is still in flight"),
    "not-replayable": (409, "The recorded response was too large to keep"),
    "run-ended": (409, "The run has ended"),
    "not-quarantined": (409, "The journal entry is not quarantined"),
    "ambiguous-run": (409, "The run id exists in several namespaces"),
    "stale-epoch": (412, "Superseded attempt"),
    "too-large": (413, "Request body too large"),
    "key-reused": (422, "Idempotency-Key reused with a different request"),
    "outcome-unknown": (502, "Outcome of the first call is unknown"),
    "upstream-unavailable": (502, "Upstream unreachable"),
    "store-unavailable": (503, "Journal store unavailable"),
    "upstream-timeout": (504, "Upstream timed out"),
}


class Problem(Exception):
    """A refusal with a stable type slug, a human detail and optional extra members."""

    def __init__(self, slug: str, detail: str, *, headers: dict[str, str] | None = None, **extra):
        super().__init__(detail)
        self.slug = slug
        self.status, self.title = PROBLEMS[slug]
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra

    def response(self, instance: str | None = None) -> web.Response:
        body = {"type": TYPE_BASE + self.slug, "title": self.title, "status": self.status,
                "detail": self.detail, **self.extra}
        if instance:
            body["instance"] = instance
        return web.Response(status=self.status, body=orjson.dumps(body),
                            content_type="application/problem+json", headers=self.headers)
