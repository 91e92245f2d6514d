"""What a runs-API or admin-API body may ask for, checked before anything changes.

Each function takes the parsed JSON body and returns plain values or raises
``Problem("invalid-body", ...)``; none touches the store.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import orjson

from ..config import Settings, parse_duration
from ..identity import parse_epoch
from ..problems import Problem
from ..store.base import EntryState, Recorded

RUN_OPTIONS = ("timeout_s", "grace_s", "hook", "max_restarts", "metadata")
MAX_METADATA_BYTES = 64 * 1024
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # never in a field value (RFC 9110 §5.5; HTAB may be)


# what `journal list --state` and GET /admin/journal?state= take: "quarantined" is what people
# call an outcome-unknown entry
JOURNAL_STATES = ("quarantined", *EntryState)


def journal_state(value: str | None) -> EntryState | None:
    """A journal state to list by (None: any)."""
    if not value:
        return None
    if value == "quarantined":
        return EntryState.UNKNOWN
    if value not in tuple(EntryState):
        raise Problem("invalid-request", f"state must be one of {', '.join(JOURNAL_STATES)}")
    return EntryState(value)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; an empty body is ``{}``."""
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Problem("invalid-body", f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Problem("invalid-body", "the body must be a JSON object")
    return body


def run_options(body: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Validated run options from a registration body."""
    unknown = set(body) - set(RUN_OPTIONS)
    if unknown:
        raise Problem("invalid-body", f"unknown field(s): {', '.join(sorted(unknown))}; "
                      f"known: {', '.join(RUN_OPTIONS)}")
    options: dict[str, Any] = {}
    for name in ("timeout_s", "grace_s"):
        if name in body:
            options[name] = _seconds(name, body[name])
    if "max_restarts" in body:
        value = body["max_restarts"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Problem("invalid-body", "max_restarts must be a non-negative integer")
        options["max_restarts"] = value
    if "hook" in body:
        hook = body["hook"]
        if hook is not None and (not isinstance(hook, str) or hook not in settings.hooks):
            raise Problem("invalid-body", f"hook must be one of the configured hooks "
                          f"({', '.join(settings.hooks) or 'none configured'}) or null")
        options["hook"] = hook
    if "metadata" in body:
        metadata = body["metadata"]
        if not isinstance(metadata, dict) or len(orjson.dumps(metadata)) > MAX_METADATA_BYTES:
            raise Problem("invalid-body", f"metadata must be a JSON object of at most "
                          f"{MAX_METADATA_BYTES} bytes")
        options["metadata"] = metadata
    return options


def _seconds(name: str, value: Any) -> float:
    try:
        seconds = parse_duration(value) if not isinstance(value, bool) else -1.0
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise Problem("invalid-body", f"{name} must be a positive number of seconds")
    return seconds


def attempt_epoch(header: str | None, body: dict[str, Any]) -> int | None:
    """The epoch a caller works in: ``Idem-Epoch``, or ``{"epoch": n}`` as the body, both
    read by the one epoch rule the proxy applies to every request."""
    if set(body) - {"epoch"}:
        raise Problem("invalid-body", f"unknown field(s): {', '.join(sorted(set(body) - {'epoch'}))}; "
                      "known: epoch")
    from_header = parse_epoch(header)
    given = body.get("epoch")
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int):
            raise Problem("invalid-body", "epoch must be a non-negative integer")
        given = parse_epoch(str(given))
    if from_header is not None and given is not None and from_header != given:
        raise Problem("invalid-request", f"Idem-Epoch ({from_header}) and the body's epoch ({given}) differ")
    return from_header if from_header is not None else given


def resolution(body: dict[str, Any]) -> Recorded | None:
    """The operator's decision on a quarantined key: None (retry) or the answer to replay."""
    action = body.get("action")
    if action == "retry":
        return None
    if action != "respond":
        raise Problem("invalid-body", 'action must be "retry" or "respond"')
    status = body.get("status")
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        raise Problem("invalid-body", "status must be an HTTP status from 200 to 599")
    headers = body.get("headers", [["Content-Type", "application/json"]])
    if not (isinstance(headers, list) and all(isinstance(h, list) and len(h) == 2
                                              and all(isinstance(x, str) for x in h) for h in headers)):
        raise Problem("invalid-body", 'headers must be a list of ["Name", "value"] pairs')
    for name, value in headers:
        if not HEADER_NAME.fullmatch(name) or CONTROL.search(value):
            raise Problem("invalid-body", f"header {name!r}: a name is a token (letters, digits, "
                          "!#$%&'*+.^_`|~-) and a value holds no control characters (CR, LF, NUL...)")
    return Recorded(status, [(k, v) for k, v in headers], _content(body))


def _content(body: dict[str, Any]) -> bytes:
    if "body_base64" in body:
        try:
            return base64.b64decode(str(body["body_base64"]), validate=True)
        except (binascii.Error, ValueError):
            raise Problem("invalid-body", "body_base64 is not base64") from None
    text = body.get("body", "")
    if not isinstance(text, str):
        raise Problem("invalid-body", "body must be text (or use body_base64)")
    return text.encode()
