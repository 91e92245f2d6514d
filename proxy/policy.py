"""What is recorded (docs/concepts.md): the policy of a request and the verdict on an answer."""

from __future__ import annotations

from enum import StrEnum
from fnmatch import fnmatchcase

from .config import Policy, UpstreamSettings, ambiguous_policy


class Verdict(StrEnum):
    """What an upstream's status means for the claimed key."""
    RECORD = "record"        # keep the answer; replays return it
    RELEASE = "release"      # nothing happened: give the key back, a retry goes upstream
    AMBIGUOUS = "ambiguous"  # the upstream may have acted: see OnAmbiguous


class OnAmbiguous(StrEnum):
    """An upstream's ``on_ambiguous``: what an ambiguous outcome does to the key."""
    RETRY = "retry"            # give the key back; a retry may go upstream again
    QUARANTINE = "quarantine"  # keep it as outcome-unknown until an operator resolves it


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# 408, 409, 425 and 429 mean "nothing happened": release the claim so a retry goes upstream.
NOTHING_HAPPENED = frozenset({408, 409, 425, 429})


def _matches(match: str, method: str, path: str) -> bool:
    want_method, _, glob = match.strip().rpartition(" ")
    if want_method and want_method.upper() not in (method, "*"):
        return False
    return fnmatchcase(path, glob)


def decide(upstream: UpstreamSettings, method: str, path: str, *, override: Policy | None,
           has_key: bool, has_run: bool) -> Policy:
    """Per-request override, then the upstream's first matching rule, then the defaults."""
    if override:
        return override
    for rule in upstream.rules:
        if _matches(rule.match, method, path):
            return Policy(rule.policy)
    if method in SAFE_METHODS:
        return Policy.PASSTHROUGH
    return Policy.RECORD if has_key or has_run else Policy.PASSTHROUGH


def ignored_fields(upstream: UpstreamSettings, method: str, path: str) -> tuple[str, ...]:
    fields: tuple[str, ...] = ()
    for entry in upstream.ignore_fields:
        if _matches(entry.match, method, path):
            fields += entry.fields
    return fields


def unordered_fields(upstream: UpstreamSettings, method: str, path: str) -> tuple[str, ...]:
    """The arrays whose order the fingerprint ignores (``ignore_order``) for this request."""
    fields: tuple[str, ...] = ()
    for entry in upstream.ignore_order:
        if _matches(entry.match, method, path):
            fields += entry.fields
    return fields


def verdict(status: int) -> Verdict:
    """Which outcomes are recorded: 2xx and 4xx, except those that mean nothing happened."""
    if status >= 500:
        return Verdict.AMBIGUOUS
    if status in NOTHING_HAPPENED:
        return Verdict.RELEASE
    return Verdict.RECORD


def on_ambiguous(upstream: UpstreamSettings) -> OnAmbiguous:
    """The upstream's ``on_ambiguous``, or its kind's default (model calls retry, tools
    quarantine)."""
    return OnAmbiguous(ambiguous_policy(upstream))
