"""A recorded body as a person reads it: JSON indented, server-sent events one per line.

``journal show`` prints these lines and the console shows them; neither changes what is
stored. A body that is neither JSON, SSE nor text is described, not dumped.
"""

from __future__ import annotations

import orjson

from ..store.model import Recorded

MAX_SHOWN = 512 * 1024  # longer bodies are cut here, with a line that says so


def content_type(recorded: Recorded) -> str:
    return next((v for k, v in recorded.headers if k.lower() == "content-type"), "")


def encoded(recorded: Recorded) -> str | None:
    """The Content-Encoding the body was recorded with (kept as the upstream sent it)."""
    return next((v for k, v in recorded.headers if k.lower() == "content-encoding"), None)


def readable(recorded: Recorded) -> tuple[str, list[str]]:
    """(what the body is: "json", "sse", "text", "binary" or "empty"; its lines to show)."""
    body = recorded.body
    if not body:
        return "empty", []
    if encoded(recorded):
        return "binary", [f"{len(body)} bytes, Content-Encoding: {encoded(recorded)}"]
    shown, cut = body[:MAX_SHOWN], len(body) > MAX_SHOWN
    tail = [f"... ({len(body) - MAX_SHOWN} more bytes not shown)"] if cut else []
    if recorded.streamed or "text/event-stream" in content_type(recorded):
        return "sse", sse_lines(shown) + tail
    if not cut:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
        else:
            return "json", orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode().splitlines()
    try:
        return "text", shown.decode().splitlines() + tail
    except UnicodeDecodeError:
        return "binary", [f"{len(body)} bytes, not text"]


def sse_lines(body: bytes) -> list[str]:
    """One line per event: its ``event:`` name (if any) and its ``data:``, JSON made compact."""
    lines = []
    for block in body.decode(errors="replace").replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        if not data and name is None:
            continue
        text = "\n".join(data)
        try:
            text = orjson.dumps(orjson.loads(text)).decode()
        except orjson.JSONDecodeError:
            pass
        lines.append(f"{name}: {text}" if name else text)
    return lines
