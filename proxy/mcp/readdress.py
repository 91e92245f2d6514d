"""A recorded ``tools/call`` answer, addressed to the caller at hand (SPEC §12).

A replay or a joined answer was recorded under the first caller's JSON-RPC id, and its
progress notifications under the first caller's progress token. A restarted agent, or one
that re-issued the call after a broken stream, asks with ids of its own, and an MCP client
drops an answer that is not addressed to one of its requests. So the response gets the
caller's id, each ``notifications/progress`` the caller's progress token, and progress is
left out for a caller that asked for none. Everything else passes byte for byte.
"""

from __future__ import annotations

from typing import Any

from .jsonrpc import LINE, Event, EventSplitter, dumps, is_response, loads

PROGRESS = "notifications/progress"


class Readdress:
    """Rewrites one answer for a caller (``replay.Readdress``): a whole body, or a stream."""

    def __init__(self, request_id: Any, progress_token: Any) -> None:
        self.request_id = request_id
        self.progress_token = progress_token
        self._events: EventSplitter | None = None  # made for a stream only: most answers are whole

    def body(self, data: bytes) -> bytes:
        message = loads(data) if data else None
        if not is_response(message) or message.get("id") == self.request_id:
            return data
        return dumps({**message, "id": self.request_id})

    def chunk(self, data: bytes) -> bytes:
        if self._events is None:
            self._events = EventSplitter()
        return b"".join(self._event(event) for event in self._events.feed(data))

    def end(self) -> bytes:
        return self._events.rest() if self._events is not None else b""

    def _event(self, event: Event) -> bytes:
        message = event.message
        if is_response(message):
            if message.get("id") == self.request_id:
                return event.raw
            return _with_data(event.raw, {**message, "id": self.request_id})
        if isinstance(message, dict) and message.get("method") == PROGRESS:
            params = message.get("params")
            if self.progress_token is None or not isinstance(params, dict):
                return b""  # the caller asked for no progress: it has no token to match it with
            if params.get("progressToken") == self.progress_token:
                return event.raw
            return _with_data(event.raw, {**message, "params": {**params, "progressToken": self.progress_token}})
        return event.raw


def _with_data(raw: bytes, message: Any) -> bytes:
    """The event with its ``data`` replaced, its other fields (``event:``, ``id:``) kept."""
    newline = LINE.search(raw)
    eol = newline.group() if newline else b"\n"
    fields = [line for line in LINE.split(raw) if line and not line.startswith(b"data:")]
    return eol.join([*fields, b"data: " + dumps(message)]) + eol + eol
