"""The benchmark's baseline: a plain aiohttp pass-through reverse proxy.

What a competent engineer writes when asked for "a reverse proxy in aiohttp": one pooled
client session, forward method, path, headers and body to one upstream, read the answer,
return it. No journal, no policy, no metrics. It runs on the same event loop as
``idemproxy serve`` (uvloop where installed), so the comparison is between the two
request paths, not between loops.

    python bench/baseline.py --port 9200 --upstream http://127.0.0.1:9100 [--processes N]

With ``--processes N`` it runs as N processes on one port (SO_REUSEPORT), the way
``idemproxy serve --workers N`` does: what the machine gives a plain proxy for N
processes is the yardstick for what it gives N workers.
"""

from __future__ import annotations

import argparse
import multiprocessing

import aiohttp
from aiohttp import web
from serving import run, serve_until_signalled

# RFC 9110 §7.6.1 hop-by-hop headers, plus those recomputed for the next hop.
NOT_FORWARDED = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer",
                           "transfer-encoding", "upgrade", "host", "content-length"})


async def serve(port: int, upstream: str, reuse_port: bool = False) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256),
                                    auto_decompress=False)

    async def forward(request: web.Request) -> web.Response:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED]
        async with session.request(request.method, upstream + request.raw_path, headers=headers,
                                   data=await request.read(), allow_redirects=False) as resp:
            body = await resp.read()
            out = [(k, v) for k, v in resp.headers.items() if k.lower() not in NOT_FORWARDED]
            return web.Response(status=resp.status, body=body, headers=out)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    try:
        await serve_until_signalled(app, port, reuse_port)
    finally:
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:9100")
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args()
    upstream, shared = args.upstream.rstrip("/"), args.processes > 1
    # The others are children in this process group: the benchmark stops them with it.
    others = [multiprocessing.get_context("spawn").Process(target=_serve, args=(args.port, upstream))
              for _ in range(args.processes - 1)]
    for process in others:
        process.start()
    try:
        run(lambda: serve(args.port, upstream, shared))
    finally:
        for process in others:
            process.join(timeout=5)


def _serve(port: int, upstream: str) -> None:
    run(lambda: serve(port, upstream, reuse_port=True))


if __name__ == "__main__":
    main()
