"""What an MCP server's answer to ``tools/call`` means for its journal entry (docs/mcp.md).

The HTTP status alone does not say: a 2026-07-28 server answers invalid params with 400 and
an internal error with 200, a 2025-11-25 server answers both with 200. The JSON-RPC response
inside the answer does:

- a result, ``isError: true`` included: the tool ran, or refused; that is its outcome. Recorded.
- invalid params, method not found: refused before anything ran, and it would be again. Recorded.
- any other error at a 4xx status (an unknown session, a header mismatch, an unsupported
  version), or a parse error / invalid request: refused at the door, nothing ran. Released.
- an internal error, or any other code: the tool may have acted. Ambiguous (quarantined by
  default for MCP upstreams).
- no response at all (a stream that ended without one, a 5xx page): ambiguous, unless a 4xx
  says the request was turned away.
"""

from __future__ import annotations

from ..policy import NOTHING_HAPPENED, Verdict, verdict
from .jsonrpc import (HEADER_MISMATCH, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR,
                      EventSplitter, final_response, is_response)

RECORDED_ERRORS = frozenset({INVALID_PARAMS, METHOD_NOT_FOUND})
NOTHING_RAN = frozenset({PARSE_ERROR, INVALID_REQUEST, HEADER_MISMATCH})


def tool_verdict(status: int, body: bytes | None, streamed: bool) -> Verdict:
    """The verdict on a ``tools/call`` answer; ``body`` None when it was too large to keep."""
    if body is None:
        return verdict(status)
    response = final_response(body, streamed)
    turned_away = 400 <= status < 500
    if response is None:
        return Verdict.RELEASE if turned_away else Verdict.AMBIGUOUS
    if "result" in response:
        return Verdict.RECORD
    error = response.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    if code in RECORDED_ERRORS:
        return Verdict.RECORD
    if code in NOTHING_RAN or turned_away or status in NOTHING_HAPPENED:
        return Verdict.RELEASE
    return Verdict.AMBIGUOUS


class ToolAnswer:
    """Reads one ``tools/call`` answer as it passes (``calls.Call``'s ``reader``)."""

    def __init__(self) -> None:
        self._events = EventSplitter()

    def ends_stream(self, chunk: bytes) -> bool:
        """Whether this read completes the response event. An SSE client acts on an event only
        once its empty line arrives, so holding back this read alone keeps rule 1."""
        return any(is_response(event.message) for event in self._events.feed(chunk))

    @staticmethod
    def verdict(status: int, body: bytes | None, streamed: bool) -> Verdict:
        return tool_verdict(status, body, streamed)
