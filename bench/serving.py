"""What every benchmark process shares: the event loop it runs on, and serving one app.

Every process runs on uvloop where it is installed, as ``idemproxy serve`` does, so the
benchmark compares request paths, not event loops.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Callable, Coroutine

from aiohttp import web


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` on uvloop where it is installed, else on asyncio's loop."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


async def serve_until_signalled(app: web.Application, port: int, reuse_port: bool = False) -> None:
    """Serve ``app`` on 127.0.0.1:``port`` until SIGTERM or SIGINT (``reuse_port``: with
    other processes on the same port, as ``idemproxy serve --workers N`` does)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024, reuse_port=reuse_port).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
