"""An upstream on a bare socket, and an agent on one: both ends see bytes, never decoded
strings (issue 25, items 4 and 5)."""

from __future__ import annotations

import asyncio
from typing import Callable
from urllib.parse import urlsplit


class RawUpstream:
    """Keep-alive HTTP/1.1 on a bare socket: each request (head and Content-Length body, kept
    in ``requests`` as received) is answered with ``answer(target)``'s bytes."""

    def __init__(self, answer: Callable[[bytes], bytes]):
        self.answer = answer
        self.requests: list[tuple[bytes, bytes]] = []
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> "RawUpstream":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append((head, await reader.readexactly(length)))
                writer.write(self.answer(head.split(b" ", 2)[1]))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def exchange(url: str, method: str, target: str, headers: dict[str, str] | None = None,
                   body: bytes = b"") -> tuple[bytes, bytes]:
    """One request on a raw socket; the answer's head (with its last CRLF) and body, unchunked."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close",
             f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    if b"\r\ntransfer-encoding: chunked" in head.lower():
        rest = _dechunk(rest)
    return head + b"\r\n", rest


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)
        out += data[:n]
        data = data[n + 2:]
    return bytes(out)
