"""JSON-RPC 2.0 as MCP carries it over Streamable HTTP: a POST body holds one message (or,
before MCP 2025-06-18, a batch); an answer is one JSON object or an SSE stream of events whose
``data`` is a message, notifications first and the response last.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import orjson

# JSON-RPC 2.0 §5.1 and the MCP schema
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
HEADER_MISMATCH = -32020  # MCP 2026-07-28: routing headers disagree with the body
# The proxy's own refusals (key reused, outcome unknown, ...): outside the range JSON-RPC and MCP
# reserve (-32768..-32000); the problem's ``type`` in ``error.data`` says which.
PROXY_ERROR = -31000

# An event ends at an empty line (WHATWG HTML, server-sent events); one line-ending style per stream.
EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
LINE = re.compile(rb"\r\n|\n|\r")


def loads(data: bytes | str) -> Any:
    """JSON, or None when it is not. Integers past 64 bits stay exact (orjson would fail)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            return None


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer past 64 bits
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def canonical(value: Any) -> bytes:
    """Keys sorted, no insignificant whitespace (docs/concepts.md, "The fingerprint")."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def is_response(message: Any) -> bool:
    """A response (result or error), as opposed to a request or a notification."""
    return isinstance(message, dict) and "method" not in message and ("result" in message or "error" in message)


@dataclass(frozen=True, slots=True)
class Event:
    """One server-sent event: its raw bytes (with the empty line that ends it), and the
    JSON-RPC message its ``data`` carries (None when there is none, e.g. a comment)."""
    raw: bytes
    message: Any

    @classmethod
    def parse(cls, raw: bytes) -> "Event":
        data = [line[5:].removeprefix(b" ") for line in LINE.split(raw) if line.startswith(b"data:")]
        return cls(raw, loads(b"\n".join(data)) if data else None)


class EventSplitter:
    """Cuts a byte stream into complete server-sent events, whatever the reads' boundaries."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, chunk: bytes) -> list[Event]:
        data = self._partial + chunk
        events, start = [], 0
        for end in EVENT_END.finditer(data):
            events.append(Event.parse(data[start:end.end()]))
            start = end.end()
        self._partial = data[start:]
        return events

    def rest(self) -> bytes:
        """What is left after the last complete event (an unfinished one)."""
        rest, self._partial = self._partial, b""
        return rest


def final_response(body: bytes, streamed: bool) -> Any:
    """The JSON-RPC response an answer carries: the body itself, or the last response event."""
    if not streamed:
        message = loads(body) if body else None
        return message if is_response(message) else None
    found = None
    for event in EventSplitter().feed(body):
        if is_response(event.message):
            found = event.message
    return found
