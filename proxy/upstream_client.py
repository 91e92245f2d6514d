"""The HTTP/1.1 client the proxy talks to upstreams with: one pool of keep-alive connections
per upstream, answers framed by llhttp (httptools), bodies handed on as they arrive.

Why not aiohttp's client: a call through it builds a ClientRequest, a payload, a
ClientResponse, a StreamReader and their timers, about 100 Python calls per call, and that
was more than half of what a plain aiohttp pass-through spends per request (bench/, issue
13). A proxy needs little of it: one origin per pool, bytes in and bytes out, no cookies, no
redirects, no decompression. The framing (Content-Length, chunked bodies, 1xx, bodiless
statuses, the checks against response smuggling) is llhttp's, the parser Node.js uses, not
ours.

Failures say what the upstream can have seen: ``NotSent`` (no connection, so nothing was
sent), ``UpstreamTimeout`` (silence longer than ``read_timeout``), any other
``UpstreamError`` (sent, outcome unknown).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import time
from typing import Callable
from urllib.parse import unquote, urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from .egress import Egress

PAUSE_ABOVE_BYTES = 1 << 16  # unread body held before the upstream is asked to wait
# Methods whose body an upstream may ignore (RFC 9110 §9.3: a GET body has no defined meaning).
# One that ignores it reads the body as the next request on the connection and answers it (CL.0
# desync): a connection that carried such a body is closed after its answer, never reused.
BODYLESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})
# A passthrough in one of these is sent again, once, on a new connection when a reused one closed
# before a byte of its answer: its close crossed our request. RFC 9110 §9.2.2: these mean the
# same sent twice. A recorded call is never sent again by the pool, whatever its method: its
# journal promises at most one execution per key, and a PUT the upstream acted on before it
# closed would act twice.
RETRIED_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
KEEPALIVE_MARGIN_S = 1.0  # a server's `Keep-Alive: timeout=N` is trusted for N less this


class UpstreamError(Exception):
    """The exchange with an upstream failed; the request may have reached it."""


class NotSent(UpstreamError):
    """No connection to the upstream: it cannot have seen the request."""


class UpstreamTimeout(UpstreamError):
    """The upstream said nothing for longer than the configured timeout."""


class ConnectTimeout(NotSent, UpstreamTimeout):
    """No connection within ``connect_timeout``: a full listen backlog, or a pool whose
    connections all stayed busy."""


class UnsendableRequest(NotSent):
    """The request cannot be written as HTTP/1.1 (a line break in a header): nothing was sent."""


class HeadTooLarge(UpstreamError):
    """The upstream's answer head is over ``max_head_bytes`` or ``max_head_fields``."""


class UpstreamPool:
    """Keep-alive connections to one origin, at most ``max_connections`` of them open.

    Idle connections are kept per *tenant* (the ``tenant`` of each request) and a connection
    only ever carries one tenant's requests. HTTP/1.1 pairs answers to requests by order
    alone, so bytes an upstream sends late, twice or past the framed answer are read as the
    answer to the connection's next request: kept within one tenant, they can never become
    another tenant's recorded answer, whatever their timing. The cap is shared: a tenant
    that finds the pool full closes another tenant's least recently used idle connection.
    """

    def __init__(self, url: str, *, max_connections: int, connect_timeout: float | None,
                 read_timeout: float | None, on_request: Callable[[list], list] | None = None,
                 keepalive_timeout: float = 4.0, max_head_bytes: int = 64 * 1024,
                 max_head_fields: int = 256, egress: Egress | None = None):
        parts = urlsplit(url)
        self.host = parts.hostname or ""
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.base_path = parts.path.rstrip("/")
        # 0 (or less) means no limit, as it did with aiohttp's client
        self.max_connections = max_connections if max_connections > 0 else 1 << 30
        self.connect_timeout = connect_timeout if connect_timeout and connect_timeout > 0 else None
        self.read_timeout = read_timeout if read_timeout and read_timeout > 0 else None
        self.on_request = on_request  # sees and may change every request's headers (tracing)
        self.keepalive_timeout = max(0.0, keepalive_timeout)  # 0: every connection closes after one answer
        self.max_head_bytes, self.max_head_fields = max_head_bytes, max_head_fields
        default_port = self.port == (443 if self.tls else 80)
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self._fixed = f"Host: {shown if default_port else f'{shown}:{self.port}'}"
        self._auth = None  # credentials in the URL replace the agent's, as aiohttp's client did
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            self._auth = "Basic " + base64.b64encode(pair).decode()
        # how connections are opened (direct or through an egress proxy, TLS): proxy/egress.py
        self.egress = egress if egress is not None else Egress(url)
        self._idle: dict[str, collections.deque[_Connection]] = {}  # per tenant, most recent last
        self._idle_order: dict[_Connection, None] = {}  # every idle connection, least recent first
        self._connected: set[_Connection] = set()  # busy or idle
        self._open = 0  # connecting, busy or idle
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._closed = False

    async def request(self, method: str, target: str, headers: list[tuple[str, str]],
                      body: bytes, *, tenant: str = "", may_resend: bool = False) -> UpstreamResponse:
        """Send one request (``target``: the path and query after the upstream's base path,
        sent exactly as the agent sent it: re-quoting would change what a signed or picky
        upstream receives) on one of ``tenant``'s connections; returns once the answer's head
        is in. Call ``release()`` or ``close()`` when done.

        ``may_resend``: a passthrough, which may go once more on a new connection when a
        reused one closed before a byte of its answer (RETRIED_METHODS only). A recorded
        call is never sent twice by the pool."""
        if self.on_request is not None:
            headers = self.on_request(headers)
        head = self._head(method, target, headers, body)
        # a body on a method whose body the upstream may ignore: the connection is not reused
        reuse = not body or method not in BODYLESS_METHODS
        conn = await self._acquire(tenant)
        reused = conn.exchanges > 0
        try:
            return self._through_egress(await conn.exchange(head, body, method == "HEAD", reuse))
        except UpstreamError:
            closed_by_upstream = conn.lost and not conn.aborted  # not a timeout, not a parse error
            conn.abort()
            if not (may_resend and reused and closed_by_upstream and not conn.received
                    and method in RETRIED_METHODS):
                raise
            self._gone(conn)  # its slot now, not when its close is seen: the new one takes it
        except BaseException:
            conn.abort()
            raise
        conn = await self._connect(None, tenant)
        try:
            return self._through_egress(await conn.exchange(head, body, method == "HEAD", reuse))
        except BaseException:
            conn.abort()
            raise

    def _through_egress(self, response: UpstreamResponse) -> UpstreamResponse:
        """The answer, unless a forward proxy refused to pass the request on: a 407 is the
        proxy's own (RFC 9110 §15.5.8), so the upstream never saw the request."""
        if response.status == 407 and self.egress.target_prefix:
            response.close()
            raise NotSent("the egress proxy refused the request: 407 Proxy Authentication Required")
        return response

    def _head(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
        egress = self.egress  # through a forward proxy: absolute-form, Proxy-Authorization
        lines = [f"{method} {egress.target_prefix}{self.base_path}{target} HTTP/1.1", self._fixed,
                 *egress.header_lines]
        if self._auth is None:
            lines += [f"{k}: {v}" for k, v in headers]
        else:
            lines += [f"{k}: {v}" for k, v in headers if k.lower() != "authorization"]
            lines.append(f"Authorization: {self._auth}")
        if body or method not in BODYLESS_METHODS:
            lines.append(f"Content-Length: {len(body)}")
        head = "\r\n".join(lines) + "\r\n\r\n"
        # A line break inside a name or value would start a header (or a request) of its own.
        if head.count("\n") != len(lines) + 1 or head.count("\r") != len(lines) + 1:
            raise UnsendableRequest("a line break in the request line or a header")
        return head.encode("utf-8", "surrogateescape")  # the bytes aiohttp's server decoded

    async def _acquire(self, tenant: str) -> _Connection:
        deadline = None
        while True:
            idle = self._idle.get(tenant)
            while idle:
                conn = idle.pop()  # the most recently used: the least likely to be stale
                del self._idle_order[conn]
                if not idle:  # tenants come and go: none is kept without a connection
                    del self._idle[tenant]
                if conn.reusable():
                    return conn
                conn.abort()
            if self._closed:
                raise NotSent("the proxy is shutting down")
            if self._open >= self.max_connections and self._idle_order:
                self._evict(next(iter(self._idle_order)))  # another tenant's, least recently used
            if self._open < self.max_connections:
                return await self._connect(deadline, tenant)
            loop = asyncio.get_running_loop()
            if deadline is None and self.connect_timeout is not None:
                deadline = loop.time() + self.connect_timeout
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken as it left: the freed slot goes to the next in line
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                if isinstance(exc, TimeoutError):
                    raise ConnectTimeout(f"no free connection to {self.host}:{self.port} "
                                         f"within {self.connect_timeout} s") from None
                raise

    async def _connect(self, deadline: float | None, tenant: str) -> _Connection:
        self._open += 1
        loop = asyncio.get_running_loop()
        if deadline is None and self.connect_timeout is not None:
            deadline = loop.time() + self.connect_timeout
        conn = _Connection(self, tenant)  # its slot is freed once, by whichever of us sees it fail first
        try:
            async with asyncio.timeout_at(deadline):
                await self.egress.connect(conn)
        except TimeoutError:
            self._gone(conn)
            raise ConnectTimeout(f"no connection to {self.host}:{self.port} "
                                 f"within {self.connect_timeout} s") from None
        except OSError as exc:  # refused, DNS, TLS (ssl.SSLError is an OSError)
            self._gone(conn)
            raise NotSent(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        except BaseException:
            self._gone(conn)
            raise
        if self._closed:  # closed while this one was connecting
            conn.abort()
            raise NotSent("the proxy is shutting down")
        return conn

    def _idle_again(self, conn: _Connection) -> None:
        """A connection whose answer was read to its end, ready for the next request."""
        if self._closed:
            conn.abort()
            return
        conn.resume()  # a relay that stopped reading may have left it paused
        now = time.monotonic()
        oldest = next(iter(self._idle_order), None)  # new ones are taken first: the oldest would
        if oldest is not None and now >= oldest.expires_at:  # never be looked at, so look here
            self._evict(oldest)
        conn.expires_at = now + conn.keepalive
        self._idle.setdefault(conn.tenant, collections.deque()).append(conn)
        self._idle_order[conn] = None
        self._wake()

    def _forget_idle(self, conn: _Connection) -> None:
        if conn in self._idle_order:
            del self._idle_order[conn]
            idle = self._idle[conn.tenant]
            idle.remove(conn)
            if not idle:
                del self._idle[conn.tenant]

    def _evict(self, conn: _Connection) -> None:
        """Close an idle connection and free its slot now (its close is seen later)."""
        self._forget_idle(conn)
        conn.abort()
        self._gone(conn)

    def _gone(self, conn: _Connection) -> None:
        """A connection closed, or failed to open: its slot is free (once)."""
        if conn.slot_freed:
            return
        conn.slot_freed = True
        self._open -= 1
        self._connected.discard(conn)
        self._forget_idle(conn)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        """Close every connection, busy ones too (the proxy closes its pools once its calls
        have drained): an upstream's handler is never left writing to a proxy that is gone."""
        self._closed = True
        self._idle.clear()
        self._idle_order.clear()
        for conn in list(self._connected):
            conn.abort()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)  # wakes to find the pool closed


class UpstreamResponse:
    """The answer to one request: its head at once, its body as it arrives."""

    __slots__ = ("status", "headers", "content_length", "_conn", "_raw", "_chunks", "_buffered",
                 "_complete", "_error", "_waiter", "_skip_body", "_keep_alive", "_done", "_whole",
                 "_ends_at_close")

    def __init__(self, conn: _Connection, skip_body: bool):
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
            conn.pool._idle_again(conn)
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


class _Connection(asyncio.Protocol):
    """One connection to the upstream, one exchange at a time; its parser calls back here."""

    def __init__(self, pool: UpstreamPool, tenant: str):
        self.pool = pool
        self.tenant = tenant  # the only tenant whose requests it carries (see UpstreamPool)
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
        self.slot_freed = False  # the pool counted its close (UpstreamPool._gone)
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
        self.pool._connected.add(self)

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
        self.pool._gone(self)

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
        self.response._raw.append((name.decode("latin-1"), value.decode("latin-1")))  # byte for byte: proxy/wire.py

    def on_headers_complete(self) -> None:
        self.response._head_done(self.parser.get_status_code(), self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)

    def on_message_complete(self) -> None:
        self.response._message_done()
