"""A passthrough: forwarded on one of its tenant's upstream connections, answered as the
upstream answers, nothing recorded."""

from __future__ import annotations

import time
from typing import Callable

from aiohttp import web

from ..config import Settings, UpstreamSettings
from ..errors import client_gone
from ..exchange import Exchange
from ..forward import failure_slug, is_stream, request_headers, response_headers
from ..forwarded import Forwarding
from ..identity import TenantResolver
from ..problems import Problem
from ..replay import server_timing, start_stream
from ..routing import Route
from ..upstream.errors import UpstreamError
from ..upstream.pool import UpstreamPool
from ..upstream.wire import Answer
from .intake import tenant_of

PASSED_WHOLE_BYTES = 1 << 20  # passthrough bodies up to this size go in one write; larger ones stream


class Passthrough:
    def __init__(self, settings: Settings, tenants: TenantResolver, pools: dict[str, UpstreamPool],
                 forwarding: Forwarding):
        self._settings, self._tenants, self._pools, self._forwarding = settings, tenants, pools, forwarding

    async def forward(self, request: web.Request, exchange: Exchange, route: Route, body: bytes,
                      tap: Callable[[bytes], None] | None = None) -> web.StreamResponse:
        """Forward, record nothing; ``tap`` sees the answer's bytes as they pass."""
        upstream = route.upstream
        headers = request_headers(request.headers, upstream, self._settings.tenants.header, None,
                                  self._forwarding.headers(request.headers, request.remote))
        sent = time.perf_counter()
        try:
            resp = await self._pools[upstream.name].request(
                request.method, route.path_qs, headers, body,
                tenant=self._connection_tenant(request, exchange), may_resend=True)
        except UpstreamError as exc:
            raise _upstream_failed(upstream, exc) from None
        try:
            upstream_s = exchange.upstream_s = time.perf_counter() - sent
            out = response_headers(resp.headers)
            out.append(("Server-Timing", server_timing(time.perf_counter() - exchange.started - upstream_s,
                                                       upstream_s)))
            length = resp.content_length
            bodiless = request.method == "HEAD"
            if bodiless and length is not None:  # the length a GET would get (RFC 9110 §9.3.2):
                out.append(("Content-Length", str(length)))  # aiohttp writes none for a HEAD
            if bodiless or not is_stream(resp.headers) and length <= PASSED_WHOLE_BYTES:
                answer = await resp.read()
                if tap is not None:
                    tap(answer)
                return Answer(status=resp.status, body=answer, headers=out)
            if length is not None:  # streamed as it comes, still with its length
                out.append(("Content-Length", str(length)))
            exchange.relaying = resp  # from here on, the client's going away closes it (connections.py)
            stream = await start_stream(request, resp.status, out)
            while chunk := await resp.readany():
                if tap is not None:
                    tap(chunk)
                await stream.write(chunk)
            await stream.write_eof()
            return stream
        except (UpstreamError, ConnectionError) as exc:
            # The client left (we then closed its upstream, or a write to it failed: aiohttp wakes
            # a write waiting on a gone client with a bare ConnectionError): not the upstream's fault.
            if client_gone(request):
                raise ConnectionResetError("the client went away") from None
            if not isinstance(exc, UpstreamError):
                raise
            raise _upstream_failed(upstream, exc) from None
        finally:
            resp.release()

    def _connection_tenant(self, request: web.Request, exchange: Exchange) -> str:
        """Whose upstream connections the request may use: its tenant's (docs/guarantees.md, the
        upstream boundary), so that nothing an upstream sends on a connection can reach another
        tenant. A passthrough outside a run has no namespace: its credential itself keys them."""
        return tenant_of(self._tenants, request, exchange) if exchange.ident.namespace else \
            self._tenants.connection_key(request.headers)


def _upstream_failed(upstream: UpstreamSettings, exc: UpstreamError) -> Problem:
    """A passthrough's failed exchange with its upstream, as the agent's problem."""
    return Problem(failure_slug(exc), f"{type(exc).__name__} talking to {upstream.name}: {exc}")
