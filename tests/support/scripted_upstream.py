"""A scriptable upstream on a raw socket: what a broken or malicious server sends, byte by byte,
and what exactly it received (each request's head and body as bytes).

Each request is answered by the script for its path (``/evil/{name}`` -> ``scripts[name]``), an
async function given the parsed request and the stream writer; a path with no script is answered
by ``default``. The server itself behaves like
the servers the proxy meets: keep-alive, one request after another on a connection, and, as
some do, it may ignore a body on GET (the body's bytes are then read as the next request: the
CL.0 desync) or close connections idle past ``idle_close_s``. It counts what each path
executed, which is what "sent twice" is measured by.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Awaitable, Callable


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    connection: int  # which connection (1, 2, ...) carried it
    head: bytes  # the request line and header fields as received, through the blank line


Script = Callable[[Request, asyncio.StreamWriter], Awaitable[None]]


def answer(text: str | bytes, status: int = 200, extra: bytes = b"") -> bytes:
    body = text.encode() if isinstance(text, str) else text
    return (b"HTTP/1.1 %d X\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n%s\r\n%s"
            % (status, len(body), extra, body))


def says(text: str) -> Script:
    """Answer with ``text``."""
    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(answer(text))
    return script


def replying(answer: Callable[[bytes], bytes]) -> Script:
    """Answer with the bytes ``answer(target)`` gives for the request's raw target."""
    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(answer(request.head.split(b" ", 2)[1]))
    return script


@dataclass
class ScriptedUpstream:
    scripts: dict[str, Script] = field(default_factory=dict)
    default: Script | None = None  # for paths with no script; else "no script for {name}"
    ignore_body_on: frozenset[str] = frozenset()  # methods whose body this server does not read
    # A request that arrives on a connection idle longer than this is met by a close, as when
    # a server's idle close (gunicorn 2 s, uvicorn and Node 5 s) crosses the request in flight.
    idle_close_s: float | None = None
    executions: collections.Counter = field(default_factory=collections.Counter)
    requests: list[Request] = field(default_factory=list)
    connections: int = 0
    _server: asyncio.Server | None = None
    _tasks: set = field(default_factory=set)

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()

    def executed(self, name: str) -> int:
        return self.executions[name]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        self.connections += 1
        number = self.connections
        try:
            idle_since = asyncio.get_running_loop().time()
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if self.idle_close_s is not None and \
                        asyncio.get_running_loop().time() - idle_since > self.idle_close_s:
                    return  # closed unanswered: the server's idle close crossed the request
                request = self._parse(head, number)
                length = int(request.headers.get("content-length", "0"))
                if length and request.method not in self.ignore_body_on:
                    request.body = await reader.readexactly(length)
                self.requests.append(request)
                name = request.path.split("?")[0].rsplit("/", 1)[-1]
                self.executions[name] += 1
                script = self.scripts.get(name) or self.default or says(f"no script for {name}")
                await script(request, writer)
                await writer.drain()
                idle_since = asyncio.get_running_loop().time()
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            self._tasks.discard(asyncio.current_task())

    @staticmethod
    def _parse(head: bytes, connection: int) -> Request:
        line, *fields = head.decode("latin-1").split("\r\n")
        method, target, _ = line.split(" ", 2)
        headers = {}
        for f in fields:
            if ":" in f:
                name, _, value = f.partition(":")
                headers[name.strip().lower()] = value.strip()
        return Request(method, target, headers, b"", connection, head)
