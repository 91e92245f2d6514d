"""Client connections under abuse: header, body and idle timeouts, a connection cap, and
problem+json with one log line for what aiohttp's parser refuses.

aiohttp's server closes idle keep-alive connections (``keepalive_timeout``, our
``idle_timeout``) but has no header or body read timeout and no connection cap (its old
``slow_request_timeout`` is gone), so a client sending half a request held a connection
and a descriptor for as long as it liked. Three parts add them, through aiohttp's own
extension points (a RequestHandler subclass, a protocol factory, a BaseSite):

    Connection   aiohttp's RequestHandler plus one timer: a request's head must arrive
                 whole within ``header_timeout`` (from the connection, or from its first
                 byte after the previous answer), and a body may fall silent for at most
                 ``body_timeout``. Time the proxy itself stops reading (flow control) is
                 not held against the client.
    Gate         the protocol factory: past ``max_connections`` a new connection is
                 answered 503 problem+json and closed, before anything is parsed (and
                 reported in one log line per ``REPORT_EVERY_S``, not one per refusal).
    ProxySite    a TCP site that listens through the Gate.

``request_started`` (called by the app's one middleware) tells a Connection that its
request's head arrived whole; aiohttp's own bookkeeping, that its answer went out.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource

import orjson
from aiohttp import web

from .config import ServerSettings
from .errors import problem_response
from .exchange import EXCHANGE
from .problems import Problem

log = logging.getLogger("idemproxy.access")

REFUSAL = web.RequestKey("refusal", str)  # why aiohttp's parser refused a request (access log)
LINGER_S = 1.0  # how long a refused connection is read (and ignored) before it closes
REPORT_EVERY_S = 10.0  # connections refused at the cap are logged at most this often
ECHO = re.compile(r":\s*(?:b'|b\"|bytearray\()")  # where aiohttp's parser quotes the bytes it refused


def max_connections(settings: ServerSettings) -> int:
    """``max_connections``, or by default half the open-file limit: the rest is for the
    upstream pools, the store and the log."""
    if settings.max_connections:
        return settings.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, soft // 2) if soft != resource.RLIM_INFINITY else 10000


class Connection(web.RequestHandler):
    """One client connection, with read timeouts (see the module docstring)."""

    def __init__(self, manager: web.Server, gate: Gate, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._request: web.BaseRequest | None = None  # the last one started (see _answering)
        self._head_since: float | None = None  # a request head is awaited since then
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._head_since = self._last_read = self._loop.time()
        self._check_at(self._head_since + self._gate.settings.header_timeout)

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        if self._head_since is None and not self._request_in_progress:  # a new request begins
            self._head_since = self._last_read
            self._check_at(self._head_since + self._gate.settings.header_timeout)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._gate.closed()
        request = self._answering()
        # The upstream answer a handler only relays to its client (a passthrough stream) is
        # closed when that client goes away, so that an idle upstream stream (an MCP notification
        # stream, an SSE feed between events) is let go at once, not at its next byte; the handler
        # then ends as for any client that left (499). Handlers themselves outlive their clients
        # (handler_cancellation is off): a recorded call must finish and record.
        exchange = request.get(EXCHANGE) if request is not None else None
        relayed = exchange.relaying if exchange is not None else None
        super().connection_lost(exc)
        if relayed is not None:
            relayed.close()

    def started(self, request: web.BaseRequest) -> None:
        """The request's head arrived whole; its body, if any, is on its way."""
        self._request, self._head_since = request, None
        if request.body_exists and not request.content.is_eof():
            self._check_at(self._last_read + self._gate.settings.body_timeout)

    def _answering(self) -> web.BaseRequest | None:
        """The request being answered. aiohttp's ``_request_in_progress`` holds from the
        handler's start until its answer is out (``finish_response``); overriding that
        coroutine instead cost every request one more. Once it is over, the
        connection is idle, and aiohttp's keep-alive timeout takes over."""
        return self._request if self._request_in_progress else None

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request its parser refused (400), or to an exception no
        middleware caught (500): problem+json. A refusal is logged once, by the access
        log, with its reason; only a bug (500) gets a traceback."""
        if request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)  # raises: cut short
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            problem = Problem("internal-error", "the proxy failed to answer this request")
        else:
            request[REFUSAL] = reason = _reason(message or str(exc))
            problem = Problem("invalid-request", f"malformed HTTP request: {reason}")
        resp = problem_response(problem)
        resp.force_close()
        return resp

    def _check_at(self, when: float) -> None:
        """Check the connection at ``when`` (loop time), or earlier if already due then."""
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._check)

    def _check(self) -> None:
        """Close the connection if the client owes bytes it has not sent in time."""
        self._timer = None
        settings, now = self._gate.settings, self._loop.time()
        request = self._answering()
        if request is not None:
            if request.content.is_eof():
                return  # the whole body is in: nothing is owed until the answer is out
            due = self._last_read + settings.body_timeout
            why = f"request body silent for {settings.body_timeout:g}s"
        elif self._head_since is not None:
            due, why = (self._head_since + settings.header_timeout,
                        f"request head not complete within {settings.header_timeout:g}s")
        else:
            return  # idle between requests: aiohttp's keep-alive timeout watches that
        transport = self.transport
        if transport is None:
            return
        if now < due or not transport.is_reading():  # not due, or we are the ones not reading
            self._check_at(max(due, now + 0.05))
            return
        log.info("%s closed: %s", _peer(transport), why)
        self.force_close()


class Gate:
    """The protocol factory for client connections: a Connection each, up to the cap."""

    def __init__(self, server: web.Server, settings: ServerSettings, **handler_options) -> None:
        self.server, self.settings = server, settings
        self.limit = max_connections(settings)
        self.open = 0
        self.refused = 0  # since the last report
        self._reported_at = float("-inf")
        self._options = handler_options

    def __call__(self) -> asyncio.Protocol:
        loop = asyncio.get_running_loop()
        if self.open >= self.limit:
            self.refused += 1
            if loop.time() - self._reported_at >= REPORT_EVERY_S:
                log.warning("at the connection cap (%d): %d connection(s) refused with 503", self.limit,
                            self.refused)
                self._reported_at, self.refused = loop.time(), 0
            return Refusal()
        self.open += 1  # counted here, not in connection_made: accepts come in batches
        return Connection(self.server, self, loop=loop, **self._options)

    def closed(self) -> None:
        self.open -= 1


def _over_the_cap() -> bytes:
    body = orjson.dumps(Problem("too-many-connections", "the proxy is at its connection cap; retry "
                                "shortly").body())
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/problem+json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


class Refusal(asyncio.Protocol):
    """A connection over the cap: 503 problem+json, then closed once the client has had a
    moment to read it (closing with its request unread would reset the connection and
    could destroy the answer before the client reads it)."""

    ANSWER = _over_the_cap()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.ANSWER)
        if transport.can_write_eof():
            transport.write_eof()
        self._closing = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # read and ignored

    def connection_lost(self, exc: BaseException | None) -> None:
        self._closing.cancel()


class ProxySite(web.BaseSite):
    """A TCP site whose connections go through a :class:`Gate`."""

    __slots__ = ("_host", "_port", "_reuse_port", "gate")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, gate: Gate, *,
                 reuse_port: bool = False, backlog: int = 1024) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._reuse_port, self.gate = host, port, reuse_port, gate

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The port listened on (the one chosen when ``port`` was 0)."""
        return self._server.sockets[0].getsockname()[1] if self._server else self._port

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self.gate, self._host, self._port, backlog=self._backlog, reuse_address=True,
            reuse_port=self._reuse_port)


def request_started(request: web.BaseRequest) -> None:
    """Tell a guarded connection that its request's head is in (the header timeout ends);
    app._admit calls it first thing for every request."""
    protocol = request.protocol
    if isinstance(protocol, Connection):
        protocol.started(request)


def _reason(message: str) -> str:
    """The parser's complaint, without its echo of the client's bytes (kept out of logs)."""
    first = ECHO.split(message.strip().split("\n", 1)[0], 1)[0]
    return first.rstrip(": ")[:120] or "malformed"


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) else str(peer)
