"""Request bodies with a ``Content-Encoding`` (docs/guarantees.md): forwarded as received, read decoded.

A body goes upstream byte for byte as the agent sent it, its ``Content-Encoding`` with it:
decoding it is the upstream's business. What the proxy reads of a body itself (the
fingerprint, an MCP message, the model a call names, the runs API's JSON) is its content,
decoded here. aiohttp's server would decode it on its own and hand over nothing else, so it
is told not to (``REQUEST_HANDLING``, used by app.py and server.py).

Codings: ``gzip`` (and ``x-gzip``; several members in a row are one body, RFC 1952),
``deflate`` (zlib, RFC 1950, or bare deflate as some clients send it and aiohttp accepted),
``identity``; several are undone last applied first. Decoding stops one byte past ``limit``
(``max_request_bytes``), so a few KB that would inflate to gigabytes never grow in memory: 413.
A body that is malformed, cut short or followed by stray bytes, or in any other coding
(``br``, ``zstd``: the content could not be read, nor its size bounded), is refused before
anything else happens: 400 ``undecodable-body``. An empty body is empty content, whatever
coding it names (some clients name one on every request).
"""

from __future__ import annotations

import zlib
from typing import Callable

from multidict import CIMultiDictProxy

from .problems import Problem

# aiohttp's request handler options: the body reaches us as it came (see the docstring)
REQUEST_HANDLING = {"auto_decompress": False}


def decoded(body: bytes, headers: CIMultiDictProxy[str], limit: int) -> bytes:
    """``body`` decoded per the request's ``Content-Encoding``, at most ``limit`` bytes of it."""
    if not body or "Content-Encoding" not in headers:  # nearly every request: nothing to undo
        return body
    for coding in reversed(codings(headers)):
        decode = DECODERS.get(coding)
        if decode is None:
            raise Problem("undecodable-body", f"Content-Encoding {coding!r} is not one the proxy "
                          f"can read ({', '.join(sorted(DECODERS))} or identity)")
        if body:  # an inner coding may have held nothing
            body = decode(body, limit)
    return body


def codings(headers: CIMultiDictProxy[str]) -> list[str]:
    """The codings applied, in order (RFC 9110 §8.4), ``identity`` left out."""
    named = ",".join(headers.getall("Content-Encoding", ()))
    return [c for c in (part.strip().lower() for part in named.split(",")) if c and c != "identity"]


def _gunzip(body: bytes, limit: int) -> bytes:
    out = bytearray()
    while body:  # member after member: what follows one must be another
        body = _inflate_into(out, zlib.decompressobj(16 + zlib.MAX_WBITS), body, limit, "gzip")
    return bytes(out)


def _deflate(body: bytes, limit: int) -> bytes:
    # zlib's header says CM = 8 (deflate) in its first byte's low bits; bare deflate does not
    wbits = zlib.MAX_WBITS if body[0] & 0x0F == 8 else -zlib.MAX_WBITS
    out = bytearray()
    if _inflate_into(out, zlib.decompressobj(wbits), body, limit, "deflate"):
        raise Problem("undecodable-body", "bytes follow the end of the deflate stream")
    return bytes(out)


def _inflate_into(out: bytearray, inflater, body: bytes, limit: int, coding: str) -> bytes:
    """Inflate one stream of ``body`` onto ``out``; what follows the stream is returned."""
    room = limit - len(out)
    try:
        data = inflater.decompress(body, room + 1)  # one byte more than room says it is too large
    except zlib.error as exc:
        raise Problem("undecodable-body", f"the body is not valid {coding}: {exc}") from None
    if len(data) > room:
        raise Problem("too-large", f"request body over {limit} bytes once decoded", max_request_bytes=limit)
    if not inflater.eof:
        raise Problem("undecodable-body", f"the {coding} body is cut short")
    out += data
    return inflater.unused_data


DECODERS: dict[str, Callable[[bytes, int], bytes]] = {"gzip": _gunzip, "x-gzip": _gunzip, "deflate": _deflate}
