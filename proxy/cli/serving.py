"""``serve`` and ``supervise``: the proxy app with the supervisor's hooks and, unless disabled,
its loop beside it; or the supervisor alone against the store. This is where the proxy and the
supervisor are put together (uvicorn's main.py does the same for its server and supervisors)."""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import AsyncIterator

from aiohttp import web

from ...supervisor import Hooks, Supervisor
from .. import server
from ..app import create_app
from ..appkeys import METRICS, RUNS, SETTINGS
from ..config import Settings
from ..eventloop import run
from ..runs import RunsService
from ..store import open_store
from .common import OK, command, with_runs


def add_serve(sub, common: argparse.ArgumentParser) -> None:
    p = command(sub, common, "serve", "run the proxy (and the supervisor, unless disabled)",
                "Run the proxy: bring the store's schema up to date, then listen. The supervisor "
                "runs in the same process unless --no-supervisor or [supervisor] enabled = false. "
                "A store that is not reachable yet is retried with backoff; one that refuses the "
                "configuration (no such database or folder) stops the start at once.")
    p.add_argument("--host", help="address to listen on (default [server] host, 127.0.0.1)")
    p.add_argument("--port", type=port, help="port to listen on, 0 for any free one (default 8787)")
    p.add_argument("--workers", type=int, help="processes sharing the port (SO_REUSEPORT)")
    p.add_argument("--no-supervisor", action="store_true", help="run the proxy alone")
    p.set_defaults(handler=serve)


def add_supervise(sub, common: argparse.ArgumentParser) -> None:
    p = command(sub, common, "supervise", "run the supervisor alone against the store (no proxy)",
                "Run the supervisor alone against the store, for deployments that run it apart from "
                "the proxies: it brings the store's schema up to date, then restarts silent runs by "
                "their hooks.")
    p.set_defaults(handler=supervise)


def port(text: str) -> int:
    """--port: 0 (any free port) to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535, 0 for any free one)")
    return value


def build_app(settings: Settings, *, supervise: bool) -> web.Application:
    """The proxy app, its runs service firing the supervisor's hooks; with ``supervise``,
    the supervisor's loop runs with it (started after the store opens, stopped before)."""
    app = create_app(settings, launcher=Hooks)
    if supervise:
        app.cleanup_ctx.append(_supervisor)
    return app


async def _supervisor(app: web.Application) -> AsyncIterator[None]:
    stop = asyncio.Event()
    loop = asyncio.create_task(Supervisor(app[RUNS], app[SETTINGS], app[METRICS]).run(stop))
    yield
    stop.set()  # graceful: the tick in progress finishes, claims get their hooks
    await loop


async def serve_app(settings: Settings, *, supervise: bool, reuse_port: bool = False) -> None:
    await server.serve_until_signalled(build_app(settings, supervise=supervise), settings,
                                       reuse_port=reuse_port)


def serve(settings: Settings, args: argparse.Namespace | None = None) -> int:
    if settings.server.workers > 1:
        # Here, once: the schema is made before the workers start, and a store that refuses
        # the configuration stops the start in one line, not in workers restarted one by one.
        run(lambda: _migrated(settings))
    return server.serve(settings, serve_app)


async def _migrated(settings: Settings) -> None:
    store = await open_store(settings)
    await store.aclose()


def supervise(settings: Settings, args: argparse.Namespace | None = None) -> int:
    async def work(runs: RunsService) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)  # only enqueue; the loop decides when
        await Supervisor(runs, settings).run(stop)
        return OK
    return with_runs(settings, work, migrate=True)
