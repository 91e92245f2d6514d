"""What an MCP POST asks for: a ``tools/call`` (journaled), or anything else (passed through).

A ``tools/call`` is keyed by what it means (docs/mcp.md): the tool's name and its params in
canonical JSON (``arguments``, and ``inputResponses``/``requestState`` of a multi-round call),
never its JSON-RPC id, its session, or its ``_meta`` (progress token, trace context, the
client's info: they change from one attempt to the next and do not change what the tool does).

2026-07-28 requests name their method in ``Mcp-Method`` (and the tool in ``Mcp-Name``), which
the server must check against the body: anything but a ``tools/call`` then passes through
without its body being read. Older requests are read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDictProxy, istr

from ..identity import MAX_KEY_LENGTH
from ..problems import Problem
from .jsonrpc import canonical, loads

TOOLS_CALL = "tools/call"
TOOLS_LIST = "tools/list"
# An explicit idempotency key in a tools/call's `_meta`, for clients that cannot set a header
# per call (MCP `_meta` keys are prefixed with a reversed domain name).
META_KEY = "dev.idemproxy/idempotencyKey"
# Revisions whose servers must reject a request whose Mcp-Method/Mcp-Name disagree with its body
VALIDATED_REVISIONS = frozenset({"2026-07-28"})
# Header names as istr: a case-insensitive lookup by one skips folding the name's case each time
PROTOCOL_VERSION, MCP_METHOD, MCP_NAME = istr("MCP-Protocol-Version"), istr("Mcp-Method"), istr("Mcp-Name")


@dataclass(slots=True)  # not frozen: a frozen dataclass sets each field through object.__setattr__
class ToolCall:
    request_id: Any
    name: str
    meaning: bytes  # canonical JSON of the params that say what the call does
    progress_token: Any
    key: str | None  # from `_meta`

    def fingerprint(self, upstream: str, path_qs: str, tenant: str) -> str:
        """Per tenant: so are the derived key's occurrences, which the store counts by fingerprint.

        The digest ``fingerprint.fingerprint("MCP", upstream, path_qs, tenant + b"\\0" + meaning, "")``
        gives, hashed here directly: that body is never JSON (a tenant is not), so the generic
        function would only find so through a failed parse whose exception costs more than the
        hash (tests/mcp/test_mcp.py holds the two equal)."""
        return hashlib.sha256(b"MCP\0%b\0%b\0%b\0%b" % (upstream.encode(), path_qs.encode(), tenant.encode(),
                                                          self.meaning)).hexdigest()


@dataclass(frozen=True, slots=True)
class Other:
    """Anything but a tools/call: a request, a notification, a response, a batch without
    a tools/call, a GET stream or a DELETE."""
    method: str | None
    request_id: Any = None


def named(headers: CIMultiDictProxy[str]) -> tuple[str | None, str | None]:
    """The method a request names in ``Mcp-Method``, when the revision obliges the server to
    hold the body to it, and the tool a ``tools/call`` names in ``Mcp-Name`` (plain ASCII
    form only); (None, None) for older revisions."""
    if headers.get(PROTOCOL_VERSION) not in VALIDATED_REVISIONS:
        return None, None
    method = headers.get(MCP_METHOD)
    if method != TOOLS_CALL:
        return method, None
    tool = headers.get(MCP_NAME)
    return method, tool if tool and not tool.startswith("=?base64?") else None


def read(method: str, named_method: str | None, body: bytes) -> ToolCall | Other:
    """What the request is, given the method its headers name (see :func:`named`). Raises
    ``invalid-request`` for a batch with a tools/call in it."""
    if method != "POST":
        return Other(None)
    if named_method is not None and named_method != TOOLS_CALL:
        return Other(named_method)
    message = loads(body) if body else None
    if isinstance(message, list):
        if any(isinstance(m, dict) and m.get("method") == TOOLS_CALL for m in message):
            raise Problem("invalid-request", "a JSON-RPC batch with a tools/call in it is refused: each "
                          "tools/call is journaled on its own, send it in a POST of its own (MCP has no "
                          "batches since 2025-06-18)")
        return Other(None)
    if not isinstance(message, dict):
        return Other(None)
    request_id = message.get("id")
    if message.get("method") != TOOLS_CALL or request_id is None:
        return Other(message.get("method") if isinstance(message.get("method"), str) else None, request_id)
    params = message.get("params")
    if not isinstance(params, dict) or not isinstance(params.get("name"), str):
        return Other(TOOLS_CALL, request_id)  # malformed: the server refuses it, nothing runs
    meaning = dict(params)
    meta = meaning.pop("_meta", None)
    meaning.setdefault("arguments", {})
    if not isinstance(meta, dict):
        return ToolCall(request_id, params["name"], canonical(meaning), None, None)
    key = meta.get(META_KEY)
    return ToolCall(request_id, params["name"], canonical(meaning), meta.get("progressToken"),
                    None if key is None else _meta_key(key))


def _meta_key(value: Any) -> str:
    if (not isinstance(value, str) or not 1 <= len(value) <= MAX_KEY_LENGTH
            or not all(" " <= ch <= "~" for ch in value)):
        raise Problem("invalid-key", f"_meta {META_KEY} must be a string of 1-{MAX_KEY_LENGTH} "
                      "printable ASCII characters")
    return value
