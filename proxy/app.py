"""The app: the control plane's aiohttp app (control_plane.py), which also carries the data
plane's handler (data_plane.py), and the lifecycle of what both use: the store, the upstream
pools, the runs service and the proxy handler."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from typing import AsyncIterator, Awaitable, Callable

from aiohttp import web

from .appkeys import AUTH, CLIENTS, DATA_PLANE, METRICS, PROXY, RUNS, SETTINGS, STORE, TENANTS
from .config import Settings
from .connections import request_started
from .control_plane import control_app
from .data_plane import Chain, data_plane
from .errors import problem_middleware
from .forward import make_pool
from .heartbeats import Heartbeats
from .identity import TenantResolver, tenant_secret
from .observability import pricing, tracing
from .observability.metrics import Metrics
from .ratelimit import AuthGuard, Clients
from .request_path.handler import Proxy
from .runs import Launcher, RunsService
from .store import Store, StoreUnavailable, open_store, retried

log = logging.getLogger("idemproxy.proxy")

# Builds what fires hooks, once the store is open: the composition root hands in the
# supervisor's Hooks, so this package never imports the supervisor.
LauncherFactory = Callable[[Settings, Store], Launcher]


def create_app(settings: Settings, launcher: LauncherFactory) -> web.Application:
    counters = Metrics()
    traces = tracing.from_environment(settings, os.environ)  # None unless OTEL_* ask for it
    app = control_app(settings, counters)
    app[SETTINGS] = settings
    app[METRICS] = counters
    app[CLIENTS] = Clients(settings.server.trusted_proxies)
    app.cleanup_ctx.append(lambda app: _lifecycle(app, launcher, traces))
    return app


def data_chain(counters: Metrics, traces: tracing.Tracing | None) -> Chain:
    """The data plane's middleware: the span when tracing is on (outermost: the outcome it
    reads is final), then the error boundary, admitting with request_started alone."""
    chain: Chain = [problem_middleware(counters, request_started)]
    if traces is not None:
        chain.insert(0, traces.middleware(lambda request: True))
    return chain


async def _lifecycle(app: web.Application, make_launcher: LauncherFactory,
                     traces: tracing.Tracing | None) -> AsyncIterator[None]:
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
    app[DATA_PLANE] = data_plane(data_chain(app[METRICS], traces), proxy.handle)
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
        await _close(proxy, launcher, store, settings.store.timeout)
        if traces is not None:  # the exporter posts from its own thread: keep the loop free
            await asyncio.to_thread(traces.shutdown)


async def _close(proxy: Proxy, launcher: Launcher, store: Store, timeout: float) -> None:
    """Write what is pending and close. What waits on the store is bounded as a whole too, so
    that a stop always ends, whatever a client library waits on; the local closes always run."""
    async def pending() -> None:
        with contextlib.suppress(StoreUnavailable):
            await proxy.heartbeats.flush()
            await proxy.flush_replay_counts()
    await _within(pending(), 2 * timeout + 1, "writing pending beats and replay counts")
    for pool in proxy.pools.values():
        await pool.close()
    await launcher.aclose()
    await _within(store.aclose(), 2 * timeout + 1, "closing the store")


async def _within(work: Awaitable[None], seconds: float, what: str) -> None:
    """Await ``work`` for ``seconds`` at most; past them, cancel it (a second for its own
    clean-up) and go on without it."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait([task], timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        return task.result()
    log.warning("%s took more than %.0fs; stopping without it: %r", what, seconds, task)
    task.cancel()
    await asyncio.wait([task], timeout=1.0)


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
