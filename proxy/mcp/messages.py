"""What an MCP POST asks for: a ``tools/call`` (journaled), or anything else (passed through).

A ``tools/call`` is keyed by what it means (SPEC §12): the tool's name and its params in
canonical JSON (``arguments``, and ``inputResponses``/``requestState`` of a multi-round call),
never its JSON-RPC id, its session, or its ``_meta`` (progress token, trace context, the
client's info: they change from one attempt to the next and do not change what the tool does).

2026-07-28 requests name their method in ``Mcp-Method`` (and the tool in ``Mcp-Name``), which
the server must check against the body: anything but a ``tools/call`` then passes through
without its body being read. Older requests are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDictProxy

from ..fingerprint import fingerprint
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


@dataclass(frozen=True, slots=True)
class ToolCall:
    request_id: Any
    name: str
    meaning: bytes  # canonical JSON of the params that say what the call does
    progress_token: Any
    key: str | None  # from `_meta`

    def fingerprint(self, upstream: str, path_qs: str, tenant: str) -> str:
        """Per tenant: so are the derived key's occurrences, which the store counts by fingerprint."""
        return fingerprint("MCP", upstream, path_qs, tenant.encode() + b"\0" + self.meaning, "")


@dataclass(frozen=True, slots=True)
class Other:
    """Anything but a tools/call: a request, a notification, a response, a batch without
    a tools/call, a GET stream or a DELETE."""
    method: str | None
    request_id: Any = None
    tool: str | None = None  # a tools/call named by its header only (a read, see Catalog)


def read(method: str, headers: CIMultiDictProxy[str], body: bytes) -> ToolCall | Other:
    """What the request is. Raises ``invalid-request`` for a batch with a tools/call in it."""
    if method != "POST":
        return Other(None)
    named = _named_method(headers)
    if named is not None and named != TOOLS_CALL:
        return Other(named)
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
    meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
    meaning = {k: v for k, v in params.items() if k != "_meta"}
    meaning.setdefault("arguments", {})
    return ToolCall(request_id, params["name"], canonical(meaning), meta.get("progressToken"),
                    _meta_key(meta.get(META_KEY)))


def header_tool(headers: CIMultiDictProxy[str]) -> str | None:
    """The tool a validated ``tools/call`` names in ``Mcp-Name`` (plain ASCII form only)."""
    if _named_method(headers) == TOOLS_CALL:
        name = headers.get("Mcp-Name")
        if name and not name.startswith("=?base64?"):
            return name
    return None


def _named_method(headers: CIMultiDictProxy[str]) -> str | None:
    """``Mcp-Method``, when the revision obliges the server to hold the body to it."""
    if headers.get("MCP-Protocol-Version") in VALIDATED_REVISIONS:
        return headers.get("Mcp-Method")
    return None


def _meta_key(value: Any) -> str | None:
    if value is None:
        return None
    if (not isinstance(value, str) or not 1 <= len(value) <= MAX_KEY_LENGTH
            or not all(" " <= ch <= "~" for ch in value)):
        raise Problem("invalid-key", f"_meta {META_KEY} must be a string of 1-{MAX_KEY_LENGTH} "
                      "printable ASCII characters")
    return value
