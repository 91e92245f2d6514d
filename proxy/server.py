"""Running the proxy: one process, or several sharing one port (SO_REUSEPORT)."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import signal
import time
from typing import Any, Callable, Coroutine

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from .app import create_app
from .handler import OUTCOME
from .config import Settings

log = logging.getLogger("idemproxy")
access_log = logging.getLogger("idemproxy.access")


class AccessLogger(AbstractAccessLogger):
    """One line per request at INFO, with what the proxy did with it."""

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def log(self, request: web.BaseRequest, response: web.StreamResponse, duration: float) -> None:
        self.logger.info("%s %s %s %d %s %.1fms", request.remote, request.method, request.path,
                         response.status, request.get(OUTCOME, "-"), duration * 1000)


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` on uvloop where it is installed."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


async def until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_app(settings: Settings, *, supervise: bool, reuse_port: bool = False) -> None:
    from ..supervisor import routes, supervisor_task  # runs API, admin API and the loop

    app = create_app(settings, extra_routes=routes)
    runner = web.AppRunner(app, access_log_class=AccessLogger,
                           access_log=access_log if settings.server.access_log else None,
                           handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, settings.server.host, settings.server.port, reuse_port=reuse_port,
                       shutdown_timeout=settings.server.shutdown_timeout, backlog=1024)
    await site.start()
    # Everything allocated so far lives as long as the process: keep the cyclic GC from
    # walking it again on every full collection (~13 ms each under load, measured in bench/).
    gc.freeze()
    log.info("idemproxy listening on http://%s:%d (upstreams: %s)", settings.server.host,
             settings.server.port, ", ".join(settings.upstreams) or "none")
    sup = asyncio.create_task(supervisor_task(app, settings)) if supervise else None
    try:
        await until_signalled()
        log.info("shutting down")
    finally:
        if sup is not None:
            sup.cancel()
            await asyncio.gather(sup, return_exceptions=True)
        await runner.cleanup()


def serve(settings: Settings, args=None) -> int:
    if settings.server.workers == 1:
        run(lambda: serve_app(settings, supervise=settings.supervisor.enabled))
        return 0
    return _serve_workers(settings)


def _worker(settings: Settings, index: int) -> None:
    logging.basicConfig(level=logging.getLogger().level or logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s[w{index}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    run(lambda: serve_app(settings, supervise=settings.supervisor.enabled and index == 0,
                          reuse_port=True))


def _serve_workers(settings: Settings) -> int:
    """Start N workers on one port; restart one that dies; stop all on SIGTERM/SIGINT."""
    ctx = multiprocessing.get_context("spawn")
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def start(i: int):
        p = ctx.Process(target=_worker, args=(settings, i), name=f"idemproxy-worker-{i}")
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
