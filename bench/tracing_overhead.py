"""What tracing costs per request, measured in one process.

Starts the fake provider, an OTLP/HTTP sink and the proxy on SQLite in this process, then
times sequential replays and recorded calls through one keep-alive connection, with tracing
off and then on (OTLP export to the sink), alternating rounds to even out a busy machine::

    python bench/tracing_overhead.py [--requests 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
import fake_provider  # noqa: E402

from idemproxy.proxy.cli.serving import build_app  # noqa: E402
from idemproxy.proxy.config import load_settings  # noqa: E402

BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


async def started(app: web.Application) -> TestServer:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def per_request_us(provider: str, folder: str, traced: bool, sink: str, n: int, replay: bool) -> float:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        os.environ.pop(name, None)
    if traced:
        os.environ.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=sink)
    settings = load_settings(env={}, overrides={
        "store.url": f"sqlite:///{folder}/j-{time.monotonic_ns()}.db", "upstreams.openai.url": provider,
        "server.access_log": False, "supervisor.enabled": False, "tenants.runs": "shared"})
    proxy = await started(build_app(settings, supervise=False))
    url = str(proxy.make_url("/openai/v1/chat/completions"))
    async with aiohttp.ClientSession() as http:
        headers = {"Idem-Run": "bench"}
        if replay:  # one recorded call, then n replays of it (a fixed key)
            headers["Idempotency-Key"] = "one"
        async with http.post(url, json=BODY, headers=headers) as resp:
            await resp.read()
        started_at = time.perf_counter()
        for i in range(n):
            key = headers if replay else {**headers, "Idempotency-Key": f"k{i}"}
            async with http.post(url, json=BODY, headers=key) as resp:
                await resp.read()
        elapsed = time.perf_counter() - started_at
    await proxy.close()
    return elapsed / n * 1e6


async def otlp_sink(request: web.Request) -> web.Response:
    await request.read()
    return web.Response()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    provider = await started(fake_provider.create_app())
    sink_app = web.Application()
    sink_app.router.add_post("/v1/traces", otlp_sink)
    sink = await started(sink_app)
    with tempfile.TemporaryDirectory() as folder:
        for replay in (True, False):
            found: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for traced in (False, True):
                    found[traced].append(await per_request_us(
                        str(provider.make_url("")).rstrip("/"), folder, traced,
                        str(sink.make_url("")).rstrip("/"), args.requests, replay))
            off, on = statistics.median(found[False]), statistics.median(found[True])
            print(f"{'replayed' if replay else 'recorded'}: tracing off {off:.0f} µs/request, "
                  f"on {on:.0f} µs/request (+{on - off:.0f} µs)")
    await provider.close()
    await sink.close()


if __name__ == "__main__":
    asyncio.run(main())
