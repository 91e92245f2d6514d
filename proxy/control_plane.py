"""The control plane: runs API, admin API, console, health and metrics, as an ordinary aiohttp
app with one middleware, the error boundary (errors.py) behind :func:`_admit`. It never traces
and never counts a call in metrics: proxied calls are the data plane's (data_plane.py), and
what its router finds to be one (the proxy's routes below) it hands to the data plane."""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from . import console
from .appkeys import METRICS, SETTINGS, STORE
from .codings import REQUEST_HANDLING
from .config import Settings
from .connections import request_started
from .data_plane import hand_off
from .errors import problem_middleware
from .observability.metrics import Metrics
from .problems import Problem
from .replay import server_timing
from .routing import NOT_OURS, origin_form
from .runs import admin, api, attach
from .store import StoreUnavailable

log = logging.getLogger("idemproxy.proxy")

RUNS_COUNT_TTL_S = 1.0  # scrapes closer together than this show the same count of runs


def control_app(settings: Settings, counters: Metrics) -> web.Application:
    """The app and its routes (``counters``: not ``metrics``, the /metrics route below)."""
    # We read bodies ourselves to answer 413 as problem+json; aiohttp's own cap sits above ours.
    # Bodies come as received, never decoded by aiohttp: they are forwarded so (codings.py).
    app = web.Application(client_max_size=settings.server.max_request_bytes + 1024,
                          middlewares=[problem_middleware(counters, _admit, observes=False)],
                          handler_args=REQUEST_HANDLING)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    # Ahead of the runs API, which shares its prefix: aiohttp tries the routes under /runs
    # in order, and a run's proxied call would first fail to match each of them.
    app.router.add_route("*", "/runs/{run}/epochs/{epoch}/{tail:.*}", hand_off)
    api.add_routes(app.router)
    attach.setup(app)
    app.add_subapp("/admin/", admin.admin_app())
    console.mount(app)
    app.router.add_route("*", "/{tail:.*}", hand_off)
    return app


def _admit(request: web.Request) -> None:
    """What every routed request passes before its handler (errors.problem_middleware runs it);
    a proxied call handed to the data plane is admitted there."""
    match_info = request.match_info
    if match_info.handler is hand_off:
        return
    request_started(request)
    # Targets no route can take (`CONNECT host:port`, `OPTIONS *`) never reach the proxy
    # handler; refuse them as problems too, not with aiohttp's plain-text 404.
    if match_info.http_exception is not None:
        raise Problem("invalid-request", NOT_OURS, headers={"Server-Timing": server_timing(0.0)})
    # An absolute-form target is taken when it names this proxy (routing.origin_form), and
    # a body announced over the limit is refused before a byte of it is read, on the runs
    # and admin APIs too, as problem+json. The data plane checks (and counts) its own.
    if not request.raw_path.startswith("/"):
        origin_form(request.raw_path, request.headers.getall(hdrs.HOST, ()))
    limit = request.config_dict[SETTINGS].server.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise Problem("too-large", f"request body over {limit} bytes", max_request_bytes=limit)


# /healthz, /readyz and /metrics answer anyone: they name no path, URL or host (docs/security.md).
# Why the store failed goes to the log, through errors.problem_middleware.

async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    store = request.app[STORE]
    try:
        await asyncio.wait_for(store.ping(), settings.store.timeout)
    except asyncio.TimeoutError:
        raise StoreUnavailable(f"readyz: no answer to a ping within {settings.store.timeout}s") from None
    return web.json_response({"status": "ready", "store": urlsplit(settings.store.url).scheme,
                              "durability": store.durability})


async def metrics(request: web.Request) -> web.Response:
    await _count_runs(request.app)
    return web.Response(body=request.app[METRICS].exposition(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _count_runs(app: web.Application) -> None:
    """Runs by state, and quarantined journal entries, counted in the store when scraped:
    every process that answers /metrics shows them (every worker, with or without the
    supervisor)."""
    m = app[METRICS]
    now = time.monotonic()
    if now - m.runs_counted_at < RUNS_COUNT_TTL_S:
        return
    m.runs_counted_at = now
    store, timeout = app[STORE], app[SETTINGS].store.timeout
    try:
        counts = await asyncio.wait_for(store.runs.count(), timeout)
        quarantined = await asyncio.wait_for(store.journal.count_quarantined(), timeout)
    except (StoreUnavailable, asyncio.TimeoutError) as exc:  # the other metrics still answer
        log.warning("runs not counted for /metrics: %s", exc)
        return
    m.set_runs(counts)
    m.quarantined.set(quarantined)
