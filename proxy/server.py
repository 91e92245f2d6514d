"""Running an app: one process, or several sharing one port (SO_REUSEPORT)."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import signal
import time
from typing import Any, Callable, Coroutine

from aiohttp import web

from .codings import REQUEST_HANDLING
from .config import Settings
from .connections import Gate, ProxySite
from .data_plane import open_planes
from .eventloop import run, until_signalled
from .observability.access_log import access_logger

log = logging.getLogger("idemproxy")
access_log = logging.getLogger("idemproxy.access")  # aiohttp logs through AccessLogger


ServeApp = Callable[..., Coroutine[Any, Any, None]]  # (settings, *, supervise, reuse_port)


async def start_serving(app: web.Application, settings: Settings, *,
                        reuse_port: bool = False) -> tuple[web.AppRunner, ProxySite]:
    """Start ``app`` (its startup hooks, then the listening socket); ``runner.cleanup()``
    stops it. Connections get the [server] timeouts and cap (connections.py)."""
    s = settings.server
    runner = web.AppRunner(app, handler_cancellation=False, shutdown_timeout=s.shutdown_timeout)
    await runner.setup()
    try:
        open_planes(runner)
        gate = Gate(runner.server, s, access_log_class=access_logger(settings),
                    access_log=access_log if s.access_log else None, keepalive_timeout=s.idle_timeout,
                    **REQUEST_HANDLING)  # the Gate makes its connections itself, not from handler_args
        site = ProxySite(runner, s.host, s.port, gate, reuse_port=reuse_port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site


YOUNG_COLLECTION_EVERY = 10_000  # allocations (CPython's default: 700)


async def serve_until_signalled(app: web.Application, settings: Settings, *, reuse_port: bool = False) -> None:
    """Serve ``app`` on the configured address until SIGTERM or SIGINT, then drain."""
    runner, site = await start_serving(app, settings, reuse_port=reuse_port)
    try:
        # Everything allocated so far lives as long as the process: keep the cyclic GC from
        # walking it again on every full collection.
        gc.freeze()
        # A young collection every 700 allocations ran several times per recorded call; every
        # 10,000, a fraction of one (docs/performance.md). What only the cyclic GC frees
        # (cycles) lives a little longer; nothing else changes.
        gc.set_threshold(YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])
        s = settings.server
        log.info("idemproxy listening on %s (upstreams: %s); connections: at most %d, header %gs, "
                 "body %gs, idle %gs", site.name, ", ".join(settings.upstreams) or "none",
                 site.gate.limit, s.header_timeout, s.body_timeout, s.idle_timeout)
        await until_signalled()
        log.info("shutting down")
    finally:
        await runner.cleanup()


def serve(settings: Settings, serve_app: ServeApp) -> int:
    """Run ``serve_app`` in this process, or in ``server.workers`` processes sharing the port;
    the supervisor runs in one of them only."""
    if settings.server.workers == 1:
        run(lambda: serve_app(settings, supervise=settings.supervisor.enabled))
        return 0
    return _serve_workers(settings, serve_app)


def _worker(settings: Settings, index: int, serve_app: ServeApp) -> None:
    logging.basicConfig(level=logging.getLogger().level or logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s[w{index}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    run(lambda: serve_app(settings, supervise=settings.supervisor.enabled and index == 0,
                          reuse_port=True))


def _serve_workers(settings: Settings, serve_app: ServeApp) -> int:
    """Start N workers on one port; restart one that dies; stop all on SIGTERM/SIGINT."""
    ctx = multiprocessing.get_context("spawn")
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def start(i: int):
        p = ctx.Process(target=_worker, args=(settings, i, serve_app), name=f"idemproxy-worker-{i}")
        p.start()
        return p

    workers = [start(i) for i in range(settings.server.workers)]
    started = [time.monotonic()] * len(workers)
    failures = [0] * len(workers)
    log.info("started %d workers", len(workers))
    while not stopping:
        time.sleep(0.2)
        for i, p in enumerate(workers):
            if p.is_alive() or stopping:
                continue
            # A worker that dies at once (a bind error, a bad store) is retried with backoff,
            # and the pool gives up rather than spin.
            failures[i] = failures[i] + 1 if time.monotonic() - started[i] < 10 else 1
            if failures[i] > 5:
                log.error("worker %d keeps exiting (%s); stopping", i, p.exitcode)
                stopping = True
                break
            delay = min(0.5 * 2 ** (failures[i] - 1), 10.0)
            log.warning("worker %d exited with %s; starting it again in %.1fs", i, p.exitcode, delay)
            time.sleep(delay)
            workers[i], started[i] = start(i), time.monotonic()
    for p in workers:
        p.terminate()  # SIGTERM: each worker drains its calls in flight
    for p in workers:
        p.join(settings.server.shutdown_timeout + 5)
    return 0 if all(f <= 5 for f in failures) else 1
