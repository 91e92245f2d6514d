"""The aiohttp application: routes, and the lifecycle of the store, the upstream pools and
the runs service."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
from functools import partial
from typing import AsyncIterator, Awaitable, Callable, Mapping
from urllib.parse import urlsplit

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler

from . import console
from .appkeys import AUTH, CLIENTS, METRICS, PROXY, RUNS, SETTINGS, STORE, STRAIGHT, TENANTS
from .codings import REQUEST_HANDLING
from .config import Settings
from .connections import request_started
from .errors import problem_middleware
from .forward import make_pool
from .heartbeats import Heartbeats
from .identity import TenantResolver, tenant_secret
from .observability import pricing, tracing
from .observability.metrics import Metrics
from .problems import Problem
from .ratelimit import AuthGuard, Clients
from .replay import server_timing
from .request_path.handler import Proxy
from .routing import NOT_OURS, origin_form
from .runs import Launcher, RunsService, admin, api, attach
from .store import Store, StoreUnavailable, open_store, retried

log = logging.getLogger("idemproxy.proxy")

RUNS_COUNT_TTL_S = 1.0  # scrapes closer together than this show the same count of runs

# Builds what fires hooks, once the store is open: the composition root hands in the
# supervisor's Hooks, so this package never imports the supervisor.
LauncherFactory = Callable[[Settings, Store], Launcher]


def create_app(settings: Settings, launcher: LauncherFactory) -> web.Application:
    counters = Metrics()  # not `metrics`: that is the /metrics route below
    middlewares = [problem_middleware(counters, _admit)]
    straight = [problem_middleware(counters, request_started)]  # the same, for what front_door takes
    traces = tracing.from_environment(settings, os.environ)  # None unless OTEL_* ask for it
    if traces is not None:  # outermost: the outcome its spans read is final
        middlewares.insert(0, traces.middleware(lambda request: request.match_info.handler is _proxy))
        straight.insert(0, traces.middleware(lambda request: True))
    # We read bodies ourselves to answer 413 as problem+json; aiohttp's own cap sits above ours.
    # Bodies come as received, never decoded by aiohttp: they are forwarded so (codings.py).
    app = web.Application(client_max_size=settings.server.max_request_bytes + 1024,
                          middlewares=middlewares, handler_args=REQUEST_HANDLING)
    app[SETTINGS] = settings
    app[METRICS] = counters
    app[STRAIGHT] = straight
    app[CLIENTS] = Clients(settings.server.trusted_proxies)
    app.cleanup_ctx.append(lambda app: _lifecycle(app, launcher, traces))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    # Ahead of the runs API, which shares its prefix: aiohttp tries the routes under /runs
    # in order, and a run's proxied call would first fail to match each of them.
    app.router.add_route("*", "/runs/{run}/epochs/{epoch}/{tail:.*}", _proxy)
    api.add_routes(app.router)
    attach.setup(app)
    app.add_subapp("/admin/", admin.admin_app())
    console.mount(app)
    app.router.add_route("*", "/{tail:.*}", _proxy)
    return app


def open_front_door(runner: web.BaseRunner) -> None:
    """Put :func:`front_door` before the app's router. Call it once ``runner.setup()`` has
    started the app and before the first connection: each takes the server's handler as it opens."""
    server = runner.server
    server.request_handler = front_door(runner.app, server.request_handler)


def front_door(app: web.Application, routed: Handler) -> Handler:
    """The handler of every request: a proxied call goes straight to the proxy handler, past
    aiohttp's router and middleware chain, which cost a replay 14-31 µs, a tenth to a fifth of
    its CPU (docs/performance.md). It passes the same error boundary and span as a routed one (``STRAIGHT``).

    Straight means a target whose first segment names an upstream (no route but the proxy's
    starts with one: config RESERVED_NAMES), or one under ``/runs/{run}/epochs/{epoch}/``,
    the proxy's route ahead of the runs API. Anything else is ``routed``, as are requests
    with ``Expect`` (aiohttp's router answers 100-continue), CONNECT, and targets not in origin form.
    CONNECT's target is an authority, never a path, so the router refuses it whatever it says.
    The router still sends a proxied call it gets to the same handler (``_proxy``)."""
    handler: Handler = app[PROXY].handle
    for middleware in reversed(app[STRAIGHT]):
        handler = partial(middleware, handler=handler)
    upstreams = app[SETTINGS].upstreams

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        target = request.raw_path
        if (goes_straight(target, upstreams) and request.method != hdrs.METH_CONNECT
                and hdrs.EXPECT not in request.headers):
            return await handler(request)
        return await routed(request)
    return handle


def goes_straight(target: str, upstreams: Mapping[str, object]) -> bool:
    """Whether the router would surely give ``target`` to the proxy (see front_door)."""
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


async def _lifecycle(app: web.Application, make_launcher: LauncherFactory,
                     traces: "tracing.Tracing | None") -> AsyncIterator[None]:
    settings = app[SETTINGS]
    store = app[STORE] = await open_store(settings)
    # retried: a store that drops just after opening must not end the start (the fault campaign saw it)
    secret = await retried(lambda: tenant_secret(settings, store), "tenant secret not readable")
    tenants = app[TENANTS] = TenantResolver.from_settings(secret, settings)
    launcher = make_launcher(settings, store)
    app[RUNS] = RunsService(store, settings, launcher)
    app[AUTH] = AuthGuard(settings.admin, store.audit)  # wrong admin tokens, counted for every replica
    proxy = app[PROXY] = Proxy(
        settings, store, tenants, Heartbeats(store), app[METRICS],
        pools={name: make_pool(up, None if traces is None else traces.inject)
               for name, up in settings.upstreams.items()})
    cached = settings.store.cache_lease > 0 and (settings.store.answer_cache_bytes > 0
                                                  or settings.store.replay_cache_bytes > 0)
    if cached:  # the first look before the first request, so memory answers from the start
        with contextlib.suppress(StoreUnavailable):
            await proxy.freshness.look()
    tasks = [asyncio.create_task(loop, name=name) for name, loop in (
        *((("freshness", proxy.freshness.run()),) if cached else ()),
        ("heartbeats", proxy.heartbeats.run()),
        ("leases", proxy.renew_leases()),
        ("replay-counts", _every(1.0, proxy.flush_replay_counts)),
        ("purge", _every(settings.store.purge_interval, lambda: _purge(app[RUNS]))),
        ("prices", _load_prices()),
    )]
    try:
        yield
    finally:
        await proxy.drain(settings.server.shutdown_timeout)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(StoreUnavailable):
            await proxy.heartbeats.flush()
            await proxy.flush_replay_counts()
        for pool in proxy.pools.values():
            await pool.close()
        await launcher.aclose()
        await store.aclose()
        if traces is not None:  # the exporter posts from its own thread: keep the loop free
            await asyncio.to_thread(traces.shutdown)


async def _every(interval: float, work: Callable[[], Awaitable[object]]) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await work()
        except StoreUnavailable as exc:
            log.warning("background work skipped: %s", exc)
        except Exception:  # noqa: BLE001 - keep the loop alive; the next round may succeed
            log.exception("background work failed")


async def _load_prices() -> None:
    """The price database, off the first replay's time; then frozen with everything else
    that lives as long as the process (server.py), so full collections skip its objects."""
    await asyncio.to_thread(pricing.load)
    gc.freeze()


async def _purge(runs: RunsService) -> None:
    entries, gone = await runs.purge()
    if entries or gone:
        log.info("purged %d expired journal entries and %d runs", entries, gone)


def _admit(request: web.Request) -> None:
    """What every routed request passes before its handler (errors.problem_middleware runs it);
    the front door admits a proxied call with request_started alone, since it skips the route."""
    request_started(request)
    # Targets no route can take (`CONNECT host:port`, `OPTIONS *`) never reach the proxy
    # handler; refuse them as problems too, not with aiohttp's plain-text 404.
    match_info = request.match_info
    if match_info.http_exception is not None:
        raise Problem("invalid-request", NOT_OURS, headers={"Server-Timing": server_timing(0.0)})
    # An absolute-form target is taken when it names this proxy (routing.origin_form), and
    # a body announced over the limit is refused before a byte of it is read, on the runs
    # and admin APIs too, as problem+json. The proxy route checks (and counts) its own.
    if match_info.handler is _proxy:
        return
    if not request.raw_path.startswith("/"):
        origin_form(request.raw_path, request.headers.getall(hdrs.HOST, ()))
    limit = request.config_dict[SETTINGS].server.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise Problem("too-large", f"request body over {limit} bytes", max_request_bytes=limit)


async def _proxy(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].handle(request)


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
