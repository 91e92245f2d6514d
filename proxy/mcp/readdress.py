"""A recorded ``tools/call`` answer, addressed to the caller at hand (docs/mcp.md).

A replay or a joined answer was recorded under the first caller's JSON-RPC id, and its
progress notifications under the first caller's progress token. A restarted agent, or one
that re-issued the call after a broken stream, asks with ids of its own, and an MCP client
drops an answer that is not addressed to one of its requests. So the response gets the
caller's id, each ``notifications/progress`` the caller's progress token, and progress is
left out for a caller that asked for none. Everything else passes byte for byte. The proxy's
own refusals reach the caller the same way: as JSON-RPC errors under its id.

A whole answer is readdressed often (every replay of a recorded call), so the place of its id
is remembered (``Cuts``): the next replay sends the bytes around it with the caller's id in
between instead of parsing the answer and writing it anew. The bytes are those the rewrite
gives: orjson writes a dict's keys in order, the id where the recorded one was.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from ..problems import PROBLEMS
from .jsonrpc import INVALID_REQUEST, LINE, PROXY_ERROR, Event, EventSplitter, dumps, is_response, loads

PROGRESS = "notifications/progress"
MAX_CUT_BYTES = 4 * 1024 * 1024  # answers whose id's place is remembered, in bytes; then forgotten
MAX_CUT_ANSWER = MAX_CUT_BYTES // 16  # a larger answer is parsed at each replay
PLACE = b"\0"  # where the id goes while an answer is cut: orjson never writes this byte


class Cut(NamedTuple):
    """A recorded response around its id: ``head + id + tail``."""
    request_id: Any
    head: bytes
    tail: bytes


# Two answers that are not cut, told apart by identity (`is`)
PASSES = Cut(None, b"", b"")  # not a response: it passes as it is
UNCUT = Cut(None, b"", b"")  # a response orjson cannot write (an integer past 64 bits): parsed at each replay


class Cuts:
    """The place of the id in recorded answers this process replayed, by the answers' bytes
    (one per process: McpUpstreams). Up to ``MAX_CUT_BYTES`` of answers, then all forgotten."""

    def __init__(self) -> None:
        self._cuts: dict[bytes, Cut] = {}
        self._bytes = 0

    def of(self, data: bytes) -> Cut:
        cut = self._cuts.get(data)
        if cut is None:
            cut = _cut(data)
            if len(data) <= MAX_CUT_ANSWER:
                if self._bytes + len(data) > MAX_CUT_BYTES:
                    self._cuts.clear()
                    self._bytes = 0
                self._cuts[data] = cut
                self._bytes += len(data)
        return cut


def _cut(data: bytes) -> Cut:
    message = loads(data) if data else None
    if not is_response(message):
        return PASSES
    try:
        placed = orjson.dumps({**message, "id": orjson.Fragment(PLACE)})
    except TypeError:
        return UNCUT
    head, _, tail = placed.partition(PLACE)
    return Cut(message.get("id"), head, tail)


class Readdress:
    """Rewrites one answer for a caller (``replay.Readdress``): a whole body, or a stream; and
    puts the proxy's refusals as JSON-RPC errors (``Exchange.render_problem``: :meth:`problem`).
    Made before the request's body is read: its id and progress token are set once known."""
    __slots__ = ("request_id", "progress_token", "_cuts", "_events")

    def __init__(self, cuts: Cuts, request_id: Any = None, progress_token: Any = None) -> None:
        self.request_id = request_id
        self.progress_token = progress_token
        self._cuts = cuts
        self._events: EventSplitter | None = None  # made for a stream only: most answers are whole

    def problem(self, problem: dict) -> bytes:
        """A problem as a JSON-RPC error, which an MCP client surfaces to its caller (a
        problem+json body it would report as a bare HTTP error). The problem is its ``data``."""
        bad_input = PROBLEMS[problem["type"].rsplit("/", 1)[-1]].status in (400, 413)
        return dumps({"jsonrpc": "2.0", "id": self.request_id, "error": {
            "code": INVALID_REQUEST if bad_input else PROXY_ERROR,
            "message": f"{problem['title']}: {problem['detail']}", "data": problem}})

    def body(self, data: bytes) -> bytes:
        cut = self._cuts.of(data)
        if cut is PASSES:
            return data
        if cut is not UNCUT:
            if cut.request_id == self.request_id:
                return data
            try:
                return cut.head + orjson.dumps(self.request_id) + cut.tail
            except TypeError:  # an id past 64 bits: the answer is written whole, as below
                pass
        message = loads(data)
        if message.get("id") == self.request_id:
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
