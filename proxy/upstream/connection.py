"""One keep-alive connection to an upstream and the answer it is reading. The framing
(Content-Length, chunked bodies, 1xx, bodiless statuses, the checks against response smuggling)
is llhttp's (httptools), the parser Node.js uses, not ours. A connection belongs to its pool
(pool.py) and tells it when it is idle again or gone."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Protocol

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from .errors import HeadTooLarge, UpstreamError, UpstreamTimeout

PAUSE_ABOVE_BYTES = 1 << 16  # unread body held before the upstream is asked to wait
KEEPALIVE_MARGIN_S = 1.0  # a server's `Keep-Alive: timeout=N` is trusted for N less this


class Slots(Protocol):
    """What a connection needs of its pool (pool.py's UpstreamPool): its limits, and to be told
    when the connection is idle again or gone, so that its slot is counted once."""

    read_timeout: float | None
    keepalive_timeout: float
    max_head_bytes: int
    max_head_fields: int
    connected: set[Connection]

    def idle_again(self, conn: Connection) -> None: ...

    def gone(self, conn: Connection) -> None: ...


class UpstreamResponse:
    """The answer to one request: its head at once, its body as it arrives."""

    __slots__ = ("status", "headers", "content_length", "_conn", "_raw", "_chunks", "_buffered",
                 "_complete", "_error", "_waiter", "_skip_body", "_keep_alive", "_done", "_whole",
                 "_ends_at_close")

    def __init__(self, conn: Connection, skip_body: bool):
        self.status = 0
        self.headers: CIMultiDictProxy[str] = _NO_HEADERS
        self.content_length: int | None = None
        self._conn = conn
        self._raw: list[tuple[str, str]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False  # the whole body is in _chunks
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._skip_body = skip_body  # a HEAD's answer announces a length it never sends
        self._keep_alive = False
        self._done = False  # released or closed
        self._whole = False  # read() wants it all: no pausing the upstream
        self._ends_at_close = False  # the body is all that comes until the upstream closes

    async def readany(self) -> bytes:
        """What has arrived of the body (waiting for some if none has); b"" at its end."""
        if not self._chunks:
            if self._complete:
                return b""
            await self._wait()
            if not self._chunks:
                return b""
        if len(self._chunks) == 1:
            chunk = self._chunks.popleft()
        else:
            chunk = b"".join(self._chunks)
            self._chunks.clear()
        if self._buffered > PAUSE_ABOVE_BYTES:
            self._conn.resume()
        self._buffered = 0
        return chunk

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        self._conn.resume()
        while not self._complete:
            await self._wait()
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body

    def at_eof(self) -> bool:
        return self._complete and not self._chunks

    def release(self) -> None:
        """Done with the answer: its connection is reused when the body was read to its end
        and the upstream keeps it open; otherwise closed."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        conn.response = None
        if self._complete and self._keep_alive and self._error is None and not self._skip_body \
                and conn.keepalive > 0 and not conn.lost and not conn.transport.get_write_buffer_size():
            # (an answer that came before our request was all written: nginx closes those too)
            conn.pool.idle_again(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """Abandon the answer: its connection is closed, a reader waiting on it wakes to an error."""
        self._fail(UpstreamError("the answer was abandoned"))
        if not self._done:
            self._done = True
            self._conn.response = None
            self._conn.abort()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timeout = self._conn.pool.read_timeout
        timer = loop.call_later(timeout, self._time_out) if timeout else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not self._complete:
            self._error = error
        self._wake()

    def _time_out(self) -> None:
        timeout = self._conn.pool.read_timeout
        self._fail(UpstreamTimeout(f"no byte from the upstream within {timeout:g} s"))
        self._conn.abort()

    # -- fed by the connection's parser --------------------------------------------------

    def _head_done(self, status: int, keep_alive: bool) -> None:
        if self._complete:  # a second answer to one request: the connection is not to be trusted
            self._keep_alive = False
            return
        if 100 <= status < 200:  # informational (a 100 Continue): the real answer follows
            self._raw = []
            return
        self.status = status
        self._keep_alive = keep_alive
        self.headers = CIMultiDictProxy(CIMultiDict(self._raw))
        if "Keep-Alive" in self.headers:
            self._conn.server_keepalive(self.headers.getall("Keep-Alive"))
        length = self.headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        if self._skip_body or status in (204, 304):
            self._complete = True
        elif self.content_length is None:
            # RFC 9112 §6.3: no length and chunked not the last coding: the body ends with the close
            codings = ",".join(self.headers.getall("Transfer-Encoding", ())).rsplit(",", 1)[-1]
            self._ends_at_close = codings.strip().lower() != "chunked"
        self._wake()

    def _feed(self, chunk: bytes) -> None:
        if self._complete:
            return
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > PAUSE_ABOVE_BYTES and not self._whole:
            self._conn.pause()
        self._wake()

    def _message_done(self) -> None:
        if self.status:  # not a 1xx's end
            self._complete = True
            self._wake()


_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


class Connection(asyncio.Protocol):
    """One connection to the upstream, one exchange at a time; its parser calls back here."""

    def __init__(self, pool: Slots, tenant: str):
        self.pool = pool
        self.tenant = tenant  # the only tenant whose requests it carries (see pool.py)
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.keepalive = pool.keepalive_timeout  # how long it may wait idle; 0: not reused
        self.expires_at = 0.0  # when idle: closed, not reused, from then on
        # the current exchange's answer heads, 1xx included: bytes read while a head was
        # incomplete, and the fields' own size and count
        self.head_bytes = self.head_size = self.head_fields = 0
        self.lost = False
        self.aborted = False  # closed by us: its end is no end of a body
        self.paused = False
        self.slot_freed = False  # the pool counted its close (Slots.gone)
        self.exchanges = 0  # requests sent on it
        self.received = False  # any byte of the current exchange's answer

    async def exchange(self, head: bytes, body: bytes, skip_body: bool,
                       reuse: bool = True) -> UpstreamResponse:
        response = self.response = UpstreamResponse(self, skip_body)
        self.exchanges += 1
        self.received = False
        self.head_bytes = self.head_size = self.head_fields = 0
        if not reuse:
            self.keepalive = 0.0
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)
        while not response.status:
            await response._wait()
        return response

    def reusable(self) -> bool:
        return not self.lost and not self.transport.is_closing() and time.monotonic() < self.expires_at

    def server_keepalive(self, values: list[str]) -> None:
        """``Keep-Alive: timeout=N`` (RFC 2068 §19.7.1, still sent by Node and others): the
        server closes idle connections after N s, so we stop reusing them a margin earlier
        than that, lest a request cross its close."""
        for value in values:
            for param in value.split(","):
                name, _, number = param.partition("=")
                if name.strip().lower() == "timeout":
                    try:
                        seconds = float(number.strip().strip('"'))
                    except ValueError:
                        continue
                    self.keepalive = max(0.0, min(self.keepalive, seconds - KEEPALIVE_MARGIN_S))

    def abort(self) -> None:
        if self.transport is not None and not self.lost:
            self.aborted = True
            self.transport.abort()  # connection_lost follows, and frees the slot

    def pause(self) -> None:
        if not self.paused and not self.lost:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.pool.connected.add(self)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: this connection cannot be trusted again
            self.abort()
            return
        self.received = True
        if not response.status:  # a head still coming: bounded, so a huge one cannot grow us
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            response._fail(UpstreamError("the upstream switched protocols"))
            self.abort()
        except httptools.HttpParserCallbackError as exc:  # one of ours, raised in a callback below
            cause = exc.__context__
            response._fail(cause if isinstance(cause, UpstreamError) else UpstreamError(str(exc)))
            self.abort()
        except httptools.HttpParserError as exc:
            response._fail(UpstreamError(f"malformed answer from the upstream: {exc}"))
            self.abort()
        else:
            if not response.status and self.head_bytes > self.pool.max_head_bytes:
                limit = self.pool.max_head_bytes
                response._fail(HeadTooLarge(f"the upstream's answer head is over {limit} bytes"))
                self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        response = self.response
        if response is not None:
            if response._ends_at_close and not response._complete and not self.aborted and exc is None:
                response._complete = True  # a body delimited by the connection's close
                response._keep_alive = False
                response._wake()
            else:
                response._fail(UpstreamError(f"the upstream closed the connection: {exc or 'EOF'}"))
        self.pool.gone(self)

    # -- httptools' callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.response._complete:  # the start of a second answer to one request: never reuse
            self.response._keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        # counted field by field: a head that arrives whole within one read is bounded too
        self.head_fields += 1
        self.head_size += len(name) + len(value) + 4
        if self.head_fields > self.pool.max_head_fields:
            raise HeadTooLarge(f"the upstream's answer head has over {self.pool.max_head_fields} fields")
        if self.head_size > self.pool.max_head_bytes:
            raise HeadTooLarge(f"the upstream's answer head is over {self.pool.max_head_bytes} bytes")
        self.response._raw.append((name.decode("latin-1"), value.decode("latin-1")))  # byte for byte: wire.py

    def on_headers_complete(self) -> None:
        self.response._head_done(self.parser.get_status_code(), self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)

    def on_message_complete(self) -> None:
        self.response._message_done()
