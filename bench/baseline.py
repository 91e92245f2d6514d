"""The benchmark's baseline: a plain aiohttp pass-through reverse proxy.

What a competent engineer writes when asked for "a reverse proxy in aiohttp": one pooled
client session, forward method, path, headers and body to one upstream, read the answer,
return it. No journal, no policy, no metrics. It runs on the same event loop as
``idemproxy serve`` (uvloop where installed), so the comparison is between the two
request paths, not between loops.

    python bench/baseline.py --port 9200 --upstream http://127.0.0.1:9100
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web
from serving import run, serve_until_signalled

# RFC 9110 §7.6.1 hop-by-hop headers, plus those recomputed for the next hop.
NOT_FORWARDED = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer",
                           "transfer-encoding", "upgrade", "host", "content-length"})


async def serve(port: int, upstream: str) -> None:
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
        await serve_until_signalled(app, port)
    finally:
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:9100")
    args = parser.parse_args()
    run(lambda: serve(args.port, args.upstream.rstrip("/")))


if __name__ == "__main__":
    main()
