"""What is recorded (SPEC §4): the policy of a request and the fate of an outcome."""

from __future__ import annotations

from fnmatch import fnmatchcase

from .config import UpstreamSettings

RECORD, PASSTHROUGH = "record", "passthrough"
POLICIES = (RECORD, PASSTHROUGH)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# 408, 409, 425 and 429 mean "nothing happened": release the claim so a retry goes upstream.
NOTHING_HAPPENED = frozenset({408, 409, 425, 429})


def _matches(match: str, method: str, path: str) -> bool:
    want_method, _, glob = match.strip().rpartition(" ")
    if want_method and want_method.upper() not in (method, "*"):
        return False
    return fnmatchcase(path, glob)


def decide(upstream: UpstreamSettings, method: str, path: str, *, override: str | None,
           has_key: bool, has_run: bool) -> str:
    """Per-request override, then the upstream's first matching rule, then the defaults."""
    if override:
        return override
    for rule in upstream.rules:
        if _matches(rule.match, method, path):
            return rule.policy
    if method in SAFE_METHODS:
        return PASSTHROUGH
    return RECORD if has_key or has_run else PASSTHROUGH


def ignored_fields(upstream: UpstreamSettings, method: str, path: str) -> tuple[str, ...]:
    fields: tuple[str, ...] = ()
    for entry in upstream.ignore_fields:
        if _matches(entry.match, method, path):
            fields += entry.fields
    return fields


def outcome(status: int) -> str:
    """``record`` (keep and replay), ``release`` (nothing happened) or ``ambiguous``."""
    if status >= 500:
        return "ambiguous"
    if status in NOTHING_HAPPENED:
        return "release"
    return "record"
