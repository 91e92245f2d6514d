"""The data plane: proxied calls, through one middleware chain into the proxy handler.

It owns every target whose first segment names an upstream (no route of the control plane
starts with one: config RESERVED_NAMES) and every one under ``/runs/{run}/epochs/{epoch}/``.
Its chain is the span, when tracing is on (outermost: the outcome it reads is final), then the
error boundary (errors.py), which counts each call in metrics; the admission is only
``connections.request_started``, since there is no route to check.

The dispatcher (:func:`open_planes`) hands such a target to the data plane before aiohttp's
router, which cost a replay a tenth to a fifth of its CPU (docs/performance.md); everything
else goes to the control plane (control_plane.py), an ordinary aiohttp app. A target the
dispatcher cannot be sure of (Expect, whose 100 Continue the router sends; escapes in a run's
segments; a target not in origin form) goes to the control plane too, whose router hands what
it matches as a proxied call back here (:func:`hand_off`): through the same chain, so no answer
depends on which way a call came.
"""

from __future__ import annotations

from functools import partial
from typing import Mapping

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from .appkeys import DATA_PLANE, SETTINGS

# What a proxied call passes through, outermost first: [the span,] the error boundary
Chain = list[Middleware]


def data_plane(chain: Chain, handle: Handler) -> Handler:
    """The proxy handler ``handle`` under ``chain``."""
    handler = handle
    for middleware in reversed(chain):
        handler = partial(middleware, handler=handler)
    return handler


def open_planes(runner: web.BaseRunner) -> None:
    """Dispatch every request to its plane. Call it once ``runner.setup()`` has started the
    app and before the first connection: each takes the server's handler as it opens."""
    server = runner.server
    server.request_handler = dispatcher(runner.app, server.request_handler)


def dispatcher(app: web.Application, control: Handler) -> Handler:
    """A request to the data plane when it surely is a proxied call (:func:`owns`), else to the
    control plane's router."""
    data = app[DATA_PLANE]
    upstreams = app[SETTINGS].upstreams

    async def dispatch(request: web.BaseRequest) -> web.StreamResponse:
        if owns(request, upstreams):
            return await data(request)
        return await control(request)
    return dispatch


def owns(request: web.BaseRequest, upstreams: Mapping[str, object]) -> bool:
    """Whether the request surely is a proxied call: its target (:func:`proxied_target`), not
    CONNECT (whose target is an authority, never a path, whatever it says), no ``Expect``."""
    return (proxied_target(request.raw_path, upstreams) and request.method != hdrs.METH_CONNECT
            and hdrs.EXPECT not in request.headers)


def proxied_target(target: str, upstreams: Mapping[str, object]) -> bool:
    """Whether the control plane's router would surely give ``target`` to the data plane."""
    parts = target.split("/", 5)
    if len(parts) < 3 or parts[0]:  # "/name" alone, or not origin form: the router decides
        return False
    if parts[1] in upstreams:
        return True
    # /runs/{run}/epochs/{epoch}/...; the router matches decoded paths: segments without
    # an escape, a query or a fragment read the same decoded
    return (len(parts) == 6 and parts[1] == "runs" and parts[3] == "epochs"
            and _plain(parts[2]) and _plain(parts[4]))


def _plain(segment: str) -> bool:
    return bool(segment) and "%" not in segment and "?" not in segment and "#" not in segment


async def hand_off(request: web.Request) -> web.StreamResponse:
    """The control plane's route for what its router finds to be a proxied call."""
    return await request.app[DATA_PLANE](request)
