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
from ..identity import EPOCH, parse_epoch
from ..problems import Problem
from ..store.model import EntryState, Recorded
from ..upstream.wire import from_text

RUN_OPTIONS = ("timeout_s", "grace_s", "hook", "max_restarts", "metadata")
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
    """Validated run options from a registration body, within the ``[runs]`` limits (a
    registration may not ask for a restart storm: ``outside-limits``)."""
    unknown = set(body) - set(RUN_OPTIONS)
    if unknown:
        raise Problem("invalid-body", f"unknown field(s): {', '.join(sorted(unknown))}; "
                      f"known: {', '.join(RUN_OPTIONS)}")
    limits = settings.runs
    options: dict[str, Any] = {}
    for name, least in (("timeout_s", limits.min_timeout_s), ("grace_s", limits.min_grace_s)):
        if name in body:
            options[name] = _seconds(name, body[name])
            if options[name] < least:
                raise Problem("outside-limits", f"{name} must be at least {least:g} s ([runs] min_{name})",
                              **{f"min_{name}": least})
    if "max_restarts" in body:
        value = body["max_restarts"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Problem("invalid-body", "max_restarts must be a non-negative integer")
        if value > limits.max_restarts_limit:
            raise Problem("outside-limits", f"max_restarts must be at most {limits.max_restarts_limit} "
                          "([runs] max_restarts_limit)", max_restarts_limit=limits.max_restarts_limit)
        options["max_restarts"] = value
    if "hook" in body:
        hook = body["hook"]
        if hook is not None and (not isinstance(hook, str) or hook not in settings.hooks):
            raise Problem("invalid-body", f"hook must be one of the configured hooks "
                          f"({', '.join(settings.hooks) or 'none configured'}) or null")
        options["hook"] = hook
    if "metadata" in body:
        metadata = body["metadata"]
        if not isinstance(metadata, dict):
            raise Problem("invalid-body", "metadata must be a JSON object")
        if len(orjson.dumps(metadata)) > limits.max_metadata_bytes:
            raise Problem("outside-limits", f"metadata must be at most {limits.max_metadata_bytes} bytes "
                          "of JSON ([runs] max_metadata_bytes)", max_metadata_bytes=limits.max_metadata_bytes)
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
        if isinstance(given, bool) or not isinstance(given, int) or not EPOCH.fullmatch(str(given)):
            raise Problem("invalid-body", "epoch must be a non-negative integer of at most 15 digits")
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
    return Recorded(status, [(k, from_text(v)) for k, v in headers], _content(body))


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
