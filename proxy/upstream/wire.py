"""Answers whose header values reach the agent as the bytes the upstream sent (docs/guarantees.md).

An upstream's header values are kept as latin-1 text from the moment they are parsed
(connection.py), through the journal, to the agent: each character U+0000-U+00FF stands
for the byte of that value, so a value is any bytes, obs-text (RFC 9110 §5.5) included, and
JSON in every store carries it unchanged. aiohttp's server writes every header as UTF-8 (and
its C writer drops lone surrogates), which would turn a 0xE9 into C3 A9: these responses
write a head holding such a value themselves.

People read and write values as text: an operator's value is kept as its UTF-8 bytes
(``from_text``), and a kept value is shown as its bytes read as UTF-8 (``as_text``). A value
with a character past U+00FF was kept as text before values were kept as bytes: it is
written as UTF-8, as aiohttp wrote it then.
"""

from __future__ import annotations

from aiohttp import web


def from_text(value: str) -> str:
    """An operator's header value (text), as the bytes it is sent as: its UTF-8 (a form's
    bytes that were not UTF-8, as aiohttp escaped them, are those bytes)."""
    return value.encode("utf-8", "surrogateescape").decode("latin-1")


def as_text(value: str) -> str:
    """A kept header value for people to read: its bytes as UTF-8, U+FFFD for bytes that are
    not (JSON and HTML hold text, not bytes)."""
    try:
        return value.encode("latin-1").decode("utf-8", "replace")
    except UnicodeEncodeError:  # kept as text before values were kept as bytes
        return value


def _value(value: str) -> bytes:
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


def head_bytes(status_line: str, headers) -> bytes:
    """The head as it goes on the wire, each value by the rule in the module docstring."""
    lines = [status_line.encode("latin-1")]
    lines += [name.encode("latin-1") + b": " + _value(value) for name, value in headers.items()]
    return b"\r\n".join(lines) + b"\r\n\r\n"


class _BytesHead:
    """Writes the head itself when a value has a byte past ASCII; aiohttp writes all others."""

    async def _write_headers(self) -> None:
        headers = self._headers
        if "".join(headers.values()).isascii():  # nearly every answer: aiohttp's own fast writer
            await super()._write_headers()
            return
        writer = self._payload_writer
        version = self._req.version
        status_line = f"HTTP/{version[0]}.{version[1]} {self._status} {self._reason}"
        # aiohttp's writer checks the head (no control characters) and runs its hooks; the
        # bytes it buffers are then replaced by ours, before anything is sent
        await writer.write_headers(status_line, headers)
        writer._headers_buf = head_bytes(status_line, headers)
        if self._send_headers_immediately:
            writer.send_headers()


class Answer(_BytesHead, web.Response):
    """A whole answer carrying an upstream's (or a record's) headers."""


class StreamedAnswer(_BytesHead, web.StreamResponse):
    """A streamed answer carrying an upstream's (or a record's) headers."""
