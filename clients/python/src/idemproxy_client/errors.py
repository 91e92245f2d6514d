"""What can go wrong talking to idemproxy's runs API.

Exception tree::

    IdemProxyError                  anything this client raises
    ├── ProxyUnreachable            no HTTP answer (connection refused, timeout)
    └── ProblemError                the proxy answered with an RFC 9457 problem
        ├── RunNotFound             404: no such run in this namespace
        ├── RunEnded                409 run-ended: completed, failed or dead; never restarted
        ├── RunExists               the run id is taken and ``resume=False`` was asked
        └── Superseded              412 stale-epoch, or a newer epoch seen, or 409
                                    attempt-lost: this attempt has been replaced (fenced),
                                    or is about to be, and must stop

Match on the classes (or on ``ProblemError.slug``), never on the human ``detail``.
"""

from __future__ import annotations

from typing import Any, Mapping

PROBLEM_TYPE_BASE = "https://idemproxy.dev/problems/"


class IdemProxyError(Exception):
    """Base class of every error this client raises."""


class ProxyUnreachable(IdemProxyError):
    """The proxy gave no HTTP answer: not listening, unreachable, or too slow."""


class ProblemError(IdemProxyError):
    """The proxy refused a request; ``slug`` is the stable problem type."""

    def __init__(self, status: int, slug: str, detail: str, body: Mapping[str, Any] | None = None):
        super().__init__(f"{status} {slug}: {detail}" if detail else f"{status} {slug}")
        self.status = status
        self.slug = slug
        self.detail = detail
        self.body: Mapping[str, Any] = body or {}


class RunNotFound(ProblemError):
    """No run with this id exists in the caller's namespace."""


class RunEnded(ProblemError):
    """The run is completed, failed or dead: it takes no new attempt and is never restarted."""


class RunExists(ProblemError):
    """The run id is already registered and the caller asked for a fresh run (``resume=False``)."""


class Superseded(ProblemError):
    """A newer attempt of this run exists (higher epoch); this process is a zombie and must stop."""


def problem_from_response(status: int, body: Any) -> ProblemError:
    """The exception for an error answer, from its status and (problem+json) body."""
    members: Mapping[str, Any] = body if isinstance(body, dict) else {}
    kind = str(members.get("type", ""))
    slug = kind[len(PROBLEM_TYPE_BASE):] if kind.startswith(PROBLEM_TYPE_BASE) else kind
    slug = slug or f"http-{status}"
    detail = str(members.get("detail") or members.get("title") or "")
    if slug in ("stale-epoch", "attempt-lost") or status == 412:
        return Superseded(status, slug, detail, members)
    if slug == "run-ended":
        return RunEnded(status, slug, detail, members)
    if status == 404:
        return RunNotFound(status, slug, detail, members)
    return ProblemError(status, slug, detail, members)
