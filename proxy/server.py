"""Running an app: one process, or several sharing one port (SO_REUSEPORT)."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import signal
import time
from typing import Any, Callable, Coroutine

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from .app import open_front_door
from .codings import REQUEST_HANDLING
from .config import Settings
from .connections import REFUSAL, Gate, ProxySite
from .eventloop import run, until_signalled
from .errors import OUTCOME, UPSTREAM_S
from .facts import FACTS, Facts
from .routing import shown_path

log = logging.getLogger("idemproxy")
access_log = logging.getLogger("idemproxy.access")


class AccessLogger(AbstractAccessLogger):
    """One line per request at INFO, with what the proxy did with it (durations to the µs)."""

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def log(self, request: web.BaseRequest, response: web.StreamResponse, duration: float) -> None:
        refused = request.get(REFUSAL)
        if refused is not None:  # aiohttp's parser refused it: no method or path to show
            self.logger.info("%s - - %d rejected %.3fms malformed HTTP: %s", request.remote,
                             response.status, duration * 1000, refused)
            return
        self.logger.info("%s %s %s %d %s %.3fms", request.remote, request.method, shown_path(request.path),
                         response.status, request.get(OUTCOME, "-"), duration * 1000)


class JsonAccessLogger(AccessLogger):
    """``[server] log_format = "json"``: one JSON object per request, for a log pipeline."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, duration: float) -> None:
        self.logger.info("%s", access_record(request, response, duration))


def access_logger(settings: Settings) -> type[AccessLogger]:
    return JsonAccessLogger if settings.server.log_format == "json" else AccessLogger


def access_record(request: web.BaseRequest, response: web.StreamResponse, duration: float) -> str:
    """The request as one JSON object: what it was, what the proxy did, and where time went."""
    line = {"remote": request.remote, "method": request.method, "path": shown_path(request.path),
            "status": response.status, "outcome": request.get(OUTCOME), "ms": round(duration * 1000, 3)}
    facts: Facts | None = request.get(FACTS)
    if facts is not None:
        upstream_s = request.get(UPSTREAM_S)
        line.update(upstream=facts.upstream, run=facts.run, epoch=facts.epoch, kid=facts.kid,
                    key_kind=facts.key_kind, model=facts.model,
                    input_tokens=facts.input_tokens, output_tokens=facts.output_tokens,
                    store_ms=round(facts.store_s * 1000, 3),
                    upstream_ms=None if upstream_s is None else round(upstream_s * 1000, 3),
                    proxy_ms=round((duration - (upstream_s or 0.0)) * 1000, 3))
    return orjson.dumps(line).decode()


ServeApp = Callable[..., Coroutine[Any, Any, None]]  # (settings, *, supervise, reuse_port)


async def start_serving(app: web.Application, settings: Settings, *,
                        reuse_port: bool = False) -> tuple[web.AppRunner, ProxySite]:
    """Start ``app`` (its startup hooks, then the listening socket); ``runner.cleanup()``
    stops it. Connections get the [server] timeouts and cap (connections.py)."""
    s = settings.server
    runner = web.AppRunner(app, handler_cancellation=False, shutdown_timeout=s.shutdown_timeout)
    await runner.setup()
    try:
        open_front_door(runner)
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
        # walking it again on every full collection (~13 ms each under load, measured in bench/).
        gc.freeze()
        # A young collection every 700 allocations cost records ~40-60 us of CPU each (0.7 ms
        # per collection, one per ~23 records: bench/, issue 13); every 10,000, ~11 us. What
        # only the cyclic GC frees (cycles) lives a little longer; nothing else changes.
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
