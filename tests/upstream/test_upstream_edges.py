"""Upstream edges: calls that never left, streams nobody listens to, and large passthrough
bodies. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from aiohttp import web

import fake_provider
import services
from conftest import proxy_sections
from rawhttp import problem

TOOL = {"Content-Type": "application/json"}


@pytest.fixture
async def refusing_upstream():
    """A listening socket whose backlog is full and that accepts nothing: a connection
    attempt hangs, as against a server drowning in connections. ``serve()`` then starts
    the fake provider on that very socket."""
    blackhole = services.Blackhole()
    runners = []

    async def serve() -> web.Application:
        blackhole.close_fillers()
        app = fake_provider.create_app()
        runner = web.AppRunner(app)
        await runner.setup()
        await web.SockSite(runner, blackhole.listener).start()
        runners.append(runner)
        return app

    yield f"http://127.0.0.1:{blackhole.port}", serve
    for runner in runners:
        await runner.cleanup()
    blackhole.close()


async def test_a_call_that_could_not_connect_releases_its_key(make_proxy, store_url, refusing_upstream, http):
    url, serve = refusing_upstream
    # a tool upstream: an ambiguous outcome would be quarantined
    proxy = await make_proxy(store_url, upstreams__stuck={"url": url, "kind": "tool", "connect_timeout": "0.5s"})
    target = proxy.url + "/stuck/tools/send"
    async with http.post(target, json={"to": "x"}, headers={"Idempotency-Key": "k1"}) as r:
        body = await problem(r, "upstream-timeout", 504)
        assert "nothing was sent" in body["detail"]
    app = await serve()
    assert app[fake_provider.CALLS]["tool:send"] == 0  # it never reached the upstream
    async with http.post(target, json={"to": "x"}, headers={"Idempotency-Key": "k1"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"  # not outcome-unknown
    assert app[fake_provider.CALLS]["tool:send"] == 1


@pytest.mark.slow  # waits out timeouts or retention (>1 s)
async def test_a_call_that_waited_in_vain_for_a_pooled_connection_releases_its_key(make_proxy, sqlite_url,
                                                                                   provider, http):
    proxy = await make_proxy(sqlite_url, upstreams__tools={"max_connections": 2, "connect_timeout": "0.5s"})

    async def hold(key: str) -> int:
        async with http.post(proxy.url + "/tools/hold", json={}, headers={
                "Idempotency-Key": key, "X-Fake-Delay": "1.5"}) as r:
            return r.status
    held = [asyncio.create_task(hold(f"hold-{i}")) for i in range(2)]
    for _ in range(100):  # until both pooled connections are taken
        if provider.calls["tool:hold"] == 2:
            break
        await asyncio.sleep(0.02)
    started = time.monotonic()
    async with http.post(proxy.url + "/tools/send", json={}, headers={"Idempotency-Key": "third"}) as r:
        await problem(r, "upstream-timeout", 504)
    assert time.monotonic() - started < 1.4 and provider.calls["tool:send"] == 0
    assert await asyncio.gather(*held) == [200, 200]
    async with http.post(proxy.url + "/tools/send", json={}, headers={"Idempotency-Key": "third"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"
    assert provider.calls["tool:send"] == 1


async def leave_a_stream(http, url: str, key: str, delay: str = "0") -> None:
    """An agent that reads the start of an answer, then goes away."""
    resp = await http.post(url, headers={"Idempotency-Key": key, "X-Fake-Chunk-Delay": delay})
    assert resp.status == 200
    await resp.content.readexactly(1000)
    resp.close()


async def until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.02)


async def test_abandoned_endless_streams_free_their_connections(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url, server={"max_record_bytes": 200_000},
                             upstreams__raw={"max_connections": 2, "connect_timeout": "2s"})
    for key in ("a", "b"):
        await leave_a_stream(http, proxy.url + "/raw/flood", key)
    # the proxy let go of both, and settled them
    await until(lambda: provider.app[fake_provider.OPEN]["flood"] == 0 and not proxy.proxy.calls)
    started = time.monotonic()
    async with http.post(proxy.url + "/raw/tools/send", json={}, headers={"Idempotency-Key": "c"}) as r:
        assert r.status == 200  # a third call is not stuck behind them
    assert time.monotonic() - started < 1.0
    async with http.post(proxy.url + "/raw/flood", headers={"Idempotency-Key": "a"}) as r:
        body = await problem(r, "not-replayable", 409)  # the existing rule for answers too large to keep
        assert "nobody was listening" in body["detail"]
    assert provider.calls["flood"] == 2


async def test_a_recording_ends_after_max_record_seconds_once_nobody_listens(make_proxy, sqlite_url, provider,
                                                                            http):
    proxy = await make_proxy(sqlite_url, server={"max_record_seconds": "0.5s"})
    url = proxy.url + "/raw/flood"
    async with http.post(url, headers={"Idempotency-Key": "slow", "X-Fake-Chunk-Delay": "0.05"}) as r:
        await r.content.readexactly(1000)
        await asyncio.sleep(0.8)  # past the bound, but listened to: it flows on, unrecorded
        before = provider.app[fake_provider.OPEN]["flood"]
        more = len(await r.content.read(200_000))
    assert before == 1 and more > 0
    await until(lambda: provider.app[fake_provider.OPEN]["flood"] == 0 and not proxy.proxy.calls, timeout=2.0)
    async with http.post(url, headers={"Idempotency-Key": "slow"}) as r:
        body = await problem(r, "not-replayable", 409)
        assert "max_record_seconds" in body["detail"]


async def test_a_large_passthrough_body_streams_as_it_comes(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url)
    size = 20 * 65536  # over PASSED_WHOLE_BYTES
    paced = {"X-Fake-Size": str(size), "X-Fake-Chunk-Delay": "0.05"}
    async with http.get(proxy.url + "/raw/flood", headers=paced) as r:
        assert r.status == 200 and r.headers["Content-Length"] == str(size)  # not rechunked
        first = await r.content.readexactly(65536)
        assert provider.app[fake_provider.OPEN]["flood"] == 1  # the upstream is still sending
        rest = await r.read()
    assert len(first) + len(rest) == size


def peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


@pytest.mark.slow  # a proxy process and 200 MiB through it
async def test_a_200_mib_passthrough_keeps_the_proxy_small(proxy_process, provider, sqlite_url, http):
    proc = proxy_process(proxy_sections(provider.url, sqlite_url))
    url = proc.url + "/raw/flood"
    async with http.get(url, headers={"X-Fake-Size": str(2 << 20)}) as r:  # warm up
        assert len(await r.read()) == 2 << 20
    before = peak_rss_kib(proc.proc.pid)
    received = 0
    async with http.get(url, headers={"X-Fake-Size": str(200 << 20)}) as r:
        async for chunk in r.content.iter_chunked(1 << 20):
            received += len(chunk)
    grown_mib = (peak_rss_kib(proc.proc.pid) - before) / 1024
    print(f"peak RSS grew {grown_mib:.1f} MiB passing 200 MiB")
    assert received == 200 << 20 and grown_mib < 32


@pytest.mark.slow  # a proxy process: the in-process test server cancels handlers, `idemproxy serve` does not
async def test_a_passthrough_stream_whose_client_left_lets_its_idle_upstream_go(proxy_process, provider, sqlite_url):
    proc = proxy_process(proxy_sections(provider.url, sqlite_url))
    flowing = provider.app[fake_provider.OPEN]
    reader, writer = await asyncio.open_connection("127.0.0.1", proc.port)
    # an endless stream that then stays idle for a minute, as an MCP notification stream may
    writer.write(b"GET /raw/flood HTTP/1.1\r\nHost: proxy\r\nX-Fake-Chunk-Delay: 60\r\n\r\n")
    await writer.drain()
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    await reader.readexactly(1024)  # its first block is on its way
    assert flowing["flood"] == 1
    writer.close()  # the agent goes away
    deadline = time.monotonic() + 3
    while flowing["flood"] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert flowing["flood"] == 0, "the proxy held the idle upstream stream after its client left"
    exposition = await asyncio.to_thread(lambda: urllib.request.urlopen(proc.url + "/metrics", timeout=10).read().decode())
    assert 'idemproxy_requests_total{outcome="disconnected"} 1.0' in exposition  # counted as the agent's leaving
