"""Test helpers: raw HTTP/1.1 over a socket, and checks for problem+json refusals.

A raw socket is the only way to send what a well-behaved client library never sends
(absolute-form targets, CONNECT, backslashes, repeated headers) to prove the proxy
refuses it itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import orjson
from multidict import CIMultiDict

PROBLEM_TYPE_BASE = "https://idemproxy.dev/problems/"


@dataclass
class RawResponse:
    status: int
    headers: CIMultiDict
    body: bytes  # unchunked
    head: bytes  # the status line and header fields as received, through the last field's CRLF

    def json(self):
        return orjson.loads(self.body)


def _dechunk(data: bytes) -> bytes:
    out, rest = bytearray(), data
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2:]
    return bytes(out)


async def raw_request(url: str, head: str, body: bytes = b"", timeout: float = 10.0) -> RawResponse:
    """Send ``head`` (request line and headers, no blank line) and ``body``; read to EOF.

    ``Connection: close`` is added, so the answer ends when the proxy closes.
    """
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        lines = head.rstrip("\r\n").split("\n")
        text = "\r\n".join(line.rstrip("\r") for line in lines) + "\r\nConnection: close\r\n\r\n"
        writer.write(text.encode("latin-1") + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass
    header_block, _, payload = data.partition(b"\r\n\r\n")
    status_line, *header_lines = header_block.decode("latin-1").split("\r\n")
    headers = CIMultiDict()
    for line in header_lines:
        name, _, value = line.partition(":")
        headers.add(name.strip(), value.strip())
    if headers.get("Transfer-Encoding", "").lower() == "chunked":
        payload = _dechunk(payload)
    return RawResponse(int(status_line.split()[1]), headers, payload, header_block + b"\r\n")


async def exchange(url: str, method: str, target: str, headers: dict[str, str] | None = None,
                   body: bytes = b"") -> tuple[bytes, bytes]:
    """One request on a raw socket; the answer's head as received (see ``RawResponse.head``) and its
    body, unchunked."""
    fields = [f"Host: {urlsplit(url).netloc}", f"Content-Length: {len(body)}",
              *(f"{k}: {v}" for k, v in (headers or {}).items())]
    answer = await raw_request(url, "\n".join([f"{method} {target} HTTP/1.1", *fields]), body)
    return answer.head, answer.body


def check_problem(status: int, content_type: str, body: bytes, slug: str, expected_status: int) -> dict:
    """An RFC 9457 body with the stable ``type`` for ``slug`` and the expected status."""
    assert status == expected_status, (status, body[:500])
    assert content_type.split(";")[0].strip() == "application/problem+json", (content_type, body[:300])
    problem = orjson.loads(body)
    assert problem["type"] == PROBLEM_TYPE_BASE + slug, problem
    assert problem["type"].endswith("/" + slug)
    assert problem["status"] == expected_status
    assert problem["title"] and problem["detail"]
    return problem


def raw_problem(resp: RawResponse, slug: str, expected_status: int) -> dict:
    return check_problem(resp.status, resp.headers.get("Content-Type", ""), resp.body, slug,
                         expected_status)


async def problem(resp: aiohttp.ClientResponse, slug: str, expected_status: int) -> dict:
    """Check an aiohttp response is the problem ``slug``; returns the parsed body."""
    return check_problem(resp.status, resp.headers.get("Content-Type", ""), await resp.read(), slug,
                         expected_status)
