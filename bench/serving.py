"""What every benchmark process shares: the event loop it runs on, and serving one app.

Every process runs on ``idemproxy serve``'s own runner (uvloop where it is installed),
so the benchmark compares request paths, not event loops.
"""

from __future__ import annotations

from aiohttp import web

from idemproxy.proxy.eventloop import run, until_signalled  # idemproxy serve's own loop and stop

__all__ = ["run", "serve_until_signalled"]


async def serve_until_signalled(app: web.Application, port: int, reuse_port: bool = False) -> None:
    """Serve ``app`` on 127.0.0.1:``port`` until SIGTERM or SIGINT (``reuse_port``: with
    other processes on the same port, as ``idemproxy serve --workers N`` does)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024, reuse_port=reuse_port).start()
    await until_signalled()
    await runner.cleanup()
