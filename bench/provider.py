"""The benchmark's upstream: the test suite's fake provider, served on uvloop.

The same app as ``tests/fake_provider.py`` (the benchmark calls its ``/small`` endpoint
and reads its ``/_calls`` counters), on the same event loop as the proxies, so that the
upstream takes as little of the machine's two cores as it can.

    python bench/provider.py --port 9100
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fake_provider  # noqa: E402


async def serve(port: int) -> None:
    runner = web.AppRunner(fake_provider.create_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(args.port))


if __name__ == "__main__":
    main()
