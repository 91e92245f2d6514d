"""The HTTP/1.1 client the proxy talks to upstreams with: one pool of keep-alive connections
per upstream (this module), each connection's answers framed by llhttp (connection.py), how an
origin is reached (egress.py), and what a failure means (errors.py).

Why not aiohttp's client: a call through it builds a ClientRequest, a payload, a
ClientResponse, a StreamReader and their timers, about 100 Python calls per call, and that
was more than half of what a plain aiohttp pass-through spends per request (see the
performance docs). A proxy needs little of it: one origin per pool, bytes in and bytes out, no
cookies, no redirects, no decompression.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import time
from typing import Callable
from urllib.parse import unquote, urlsplit

from .connection import Connection, UpstreamResponse
from .egress import Egress
from .errors import ConnectTimeout, NotSent, UnsendableRequest, UpstreamError

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
        # how connections are opened (direct or through an egress proxy, TLS): proxy/upstream/egress.py
        self.egress = egress if egress is not None else Egress(url)
        self._idle: dict[str, collections.deque[Connection]] = {}  # per tenant, most recent last
        self._idle_order: dict[Connection, None] = {}  # every idle connection, least recent first
        self.connected: set[Connection] = set()  # busy or idle
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
            self.gone(conn)  # its slot now, not when its close is seen: the new one takes it
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

    async def _acquire(self, tenant: str) -> Connection:
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

    async def _connect(self, deadline: float | None, tenant: str) -> Connection:
        self._open += 1
        loop = asyncio.get_running_loop()
        if deadline is None and self.connect_timeout is not None:
            deadline = loop.time() + self.connect_timeout
        conn = Connection(self, tenant)  # its slot is freed once, by whichever of us sees it fail first
        try:
            async with asyncio.timeout_at(deadline):
                await self.egress.connect(conn)
        except TimeoutError:
            self.gone(conn)
            raise ConnectTimeout(f"no connection to {self.host}:{self.port} "
                                 f"within {self.connect_timeout} s") from None
        except OSError as exc:  # refused, DNS, TLS (ssl.SSLError is an OSError)
            self.gone(conn)
            raise NotSent(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        except BaseException:
            self.gone(conn)
            raise
        if self._closed:  # closed while this one was connecting
            conn.abort()
            raise NotSent("the proxy is shutting down")
        return conn

    def idle_again(self, conn: Connection) -> None:
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

    def _forget_idle(self, conn: Connection) -> None:
        if conn in self._idle_order:
            del self._idle_order[conn]
            idle = self._idle[conn.tenant]
            idle.remove(conn)
            if not idle:
                del self._idle[conn.tenant]

    def _evict(self, conn: Connection) -> None:
        """Close an idle connection and free its slot now (its close is seen later)."""
        self._forget_idle(conn)
        conn.abort()
        self.gone(conn)

    def gone(self, conn: Connection) -> None:
        """A connection closed, or failed to open: its slot is free (once)."""
        if conn.slot_freed:
            return
        conn.slot_freed = True
        self._open -= 1
        self.connected.discard(conn)
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
        for conn in list(self.connected):
            conn.abort()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)  # wakes to find the pool closed
