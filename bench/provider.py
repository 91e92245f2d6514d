"""The benchmark's upstream: the test suite's fake provider, served on uvloop.

The same app as ``tests/support/fake_provider.py`` (the benchmark calls its ``/small`` endpoint
and reads its ``/_calls`` counters), on the same event loop as the proxies, so that the
upstream takes as little of the machine's two cores as it can.

``--arrivals`` also notes when each request arrived (``GET /_arrivals``: path -> UNIX
times, in order), for ``bench/resume.py``; off by default, so the load measurements
do not pay for it.

    python bench/provider.py --port 9100 [--arrivals]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

from aiohttp import web
from serving import run, serve_until_signalled

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import fake_provider  # noqa: E402


def with_arrivals(app: web.Application) -> web.Application:
    """``app`` noting the arrival time of every request, answered at ``GET /_arrivals``."""
    arrivals: dict[str, list[float]] = defaultdict(list)

    @web.middleware
    async def note(request: web.Request, handler):
        arrivals[request.path].append(time.time())
        return await handler(request)

    async def show(request: web.Request) -> web.Response:
        return web.json_response(arrivals)

    app.middlewares.append(note)
    app.router.add_get("/_arrivals", show)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--arrivals", action="store_true", help="note when each request arrived")
    args = parser.parse_args()
    app = fake_provider.create_app()
    if args.arrivals:
        app = with_arrivals(app)
    run(lambda: serve_until_signalled(app, args.port))


if __name__ == "__main__":
    main()
