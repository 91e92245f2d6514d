"""Refusals: a :class:`Problem` has a stable ``type`` slug (RFC 9457).

Clients match on the slug (``https://idemproxy.dev/problems/<slug>``), never on the human
``detail``. Code anywhere raises a Problem; ``errors.problem_middleware`` is the one place
it becomes an HTTP answer.
"""

from __future__ import annotations

from typing import NamedTuple

from .outcomes import Outcome

TYPE_BASE = "https://idemproxy.dev/problems/"


class ProblemType(NamedTuple):
    status: int
    title: str
    # What a proxied request that ends in this problem counts as. None: what it got to
    # stands (passthrough, recorded or joined, when the upstream or store failed it later).
    outcome: Outcome | None


_REJECTED, _CONFLICT = Outcome.REJECTED, Outcome.CONFLICT

PROBLEMS: dict[str, ProblemType] = {
    "invalid-key": ProblemType(400, "Malformed Idempotency-Key", _REJECTED),
    "invalid-header": ProblemType(400, "Malformed idemproxy header", _REJECTED),
    "invalid-request": ProblemType(400, "Request refused", _REJECTED),
    "invalid-body": ProblemType(400, "Malformed request body", _REJECTED),
    "undecodable-body": ProblemType(400, "Request body not decodable by its Content-Encoding", _REJECTED),
    "unauthorized": ProblemType(401, "Admin token required", _REJECTED),
    "credential-required": ProblemType(401, "A credential is required to record", _REJECTED),
    "invalid-csrf": ProblemType(403, "Missing or wrong CSRF token", _REJECTED),
    "untrusted-tenant": ProblemType(403, "Tenant header from an untrusted source", _REJECTED),
    "invalid-run-token": ProblemType(403, "The run token is not this run's", _REJECTED),
    "hook-not-allowed": ProblemType(403, "This caller may not arm the hook", _REJECTED),
    "unknown-upstream": ProblemType(404, "Unknown upstream", _REJECTED),
    "not-found": ProblemType(404, "Not found", _REJECTED),
    "in-flight": ProblemType(409, "A request with this key is still in flight", _CONFLICT),
    "not-replayable": ProblemType(409, "The recorded response was too large to keep", _CONFLICT),
    "run-ended": ProblemType(409, "The run has ended", _REJECTED),
    "not-quarantined": ProblemType(409, "The journal entry is not quarantined", _REJECTED),
    "not-dead": ProblemType(409, "The run is not dead", _REJECTED),
    "ambiguous-run": ProblemType(409, "The run id exists in several namespaces", _REJECTED),
    "epoch-ahead": ProblemType(409, "Epoch ahead of the run", _REJECTED),
    "attempt-lost": ProblemType(409, "The attempt was found lost; a new one is starting", _REJECTED),
    "stale-epoch": ProblemType(412, "Superseded attempt", Outcome.FENCED),
    "too-large": ProblemType(413, "Request body too large", _REJECTED),
    "key-reused": ProblemType(422, "Idempotency-Key reused with a different request", _CONFLICT),
    "outside-limits": ProblemType(422, "Outside the configured limits", _REJECTED),
    "too-many-requests": ProblemType(429, "Too many requests from this client", _REJECTED),
    "too-many-runs": ProblemType(429, "Too many runs not ended in this namespace", _REJECTED),
    "outcome-unknown": ProblemType(502, "Outcome of the first call is unknown", _CONFLICT),
    "upstream-unavailable": ProblemType(502, "Upstream unreachable", None),
    "store-unavailable": ProblemType(503, "Journal store unavailable", None),
    "too-many-connections": ProblemType(503, "Too many connections", _REJECTED),
    "internal-error": ProblemType(500, "Internal error", None),
    "websocket-refused": ProblemType(501, "WebSockets cannot be journaled", _REJECTED),
    "upstream-timeout": ProblemType(504, "Upstream timed out", None),
}


class Problem(Exception):
    """A refusal with a stable type slug, a human detail, headers for the answer (such as
    ``Retry-After``) and extra members for its body."""

    def __init__(self, slug: str, detail: str, *, headers: dict[str, str] | None = None, **extra):
        if slug not in PROBLEMS:
            raise ValueError(f"unknown problem type {slug!r}")
        super().__init__(detail)
        self.slug = slug
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra

    @property
    def status(self) -> int:
        return PROBLEMS[self.slug].status

    def body(self, instance: str | None = None) -> dict:
        """The RFC 9457 members."""
        kind = PROBLEMS[self.slug]
        body = {"type": TYPE_BASE + self.slug, "title": kind.title, "status": kind.status,
                "detail": self.detail, **self.extra}
        if instance:
            body["instance"] = instance
        return body
