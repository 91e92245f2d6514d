"""The HTTP surface under abuse (docs/security.md): header, body and idle timeouts,
the connection cap, and one log line with problem+json for every refusal. Each test
failed before its fix.

Proxies here are served the way ``idemproxy serve`` serves them (server.start_serving),
not through aiohttp's TestServer, whose connections have none of these limits.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
import pytest

from idemproxy.proxy.cli.serving import build_app
from idemproxy.proxy.config import load_settings
from idemproxy.proxy.server import start_serving
from conftest import proxy_sections
from config_files import write_config
from rawhttp import PROBLEM_TYPE_BASE, problem, raw_problem, raw_request

MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /tools/send HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # TLS on the plain port
]


@pytest.fixture
async def serve(tmp_path, provider):
    """``await serve(**server_options) -> url``: a proxy served as ``idemproxy serve`` does."""
    runners = []

    async def start(**server) -> str:
        sections = proxy_sections(provider.url, f"sqlite:///{tmp_path}/journal-{len(runners)}.db", server=server)
        settings = load_settings(write_config(tmp_path / f"proxy-{len(runners)}.toml", sections), env={})
        runner, site = await start_serving(build_app(settings, supervise=False), settings)
        runners.append(runner)
        return f"http://127.0.0.1:{site.port}"
    yield start
    for runner in runners:
        await runner.cleanup()


async def exchange(url: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, read the answer until the proxy closes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def problem_of(answer: bytes, status: int, slug: str) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == str(status).encode(), answer[:300]
    assert b"content-type: application/problem+json" in head.lower(), head
    parsed = orjson.loads(body)
    assert parsed["type"] == PROBLEM_TYPE_BASE + slug and parsed["status"] == status
    return parsed


async def test_a_burst_of_malformed_requests_logs_one_line_each(serve, caplog):
    url = await serve(access_log=True)
    caplog.set_level(logging.INFO)
    caplog.clear()
    for _ in range(3):
        for data in MALFORMED:
            problem_of(await exchange(url, data), 400, "invalid-request")
    records = [r for r in caplog.records if r.name.startswith(("idemproxy", "aiohttp"))]
    assert len(records) == 3 * len(MALFORMED), [r.getMessage()[:120] for r in records]
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in records)
    assert not any("aaaa" in r.getMessage() or "GARBAGE" in r.getMessage() for r in records)  # no echo


async def test_a_client_leaving_mid_body_is_one_line_not_a_traceback(serve, caplog):
    url = await serve(access_log=True)
    caplog.set_level(logging.INFO)
    caplog.clear()
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /runs/leaver HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 500\r\n\r\n{\"timeout_s\":")
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    for _ in range(100):
        if caplog.records:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith(("idemproxy", "aiohttp"))]
    assert len(lines) == 1 and "/runs/leaver 499" in lines[0], lines
    assert not any(r.exc_info for r in caplog.records)


async def test_a_runs_api_body_over_the_limit_is_problem_json(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, server={"max_request_bytes": 1000})
    big = orjson.dumps({"metadata": {"pad": "x" * 5000}})
    async with http.post(proxy.url + "/runs/r1", data=big, headers={"Content-Type": "application/json"}) as r:
        assert (await problem(r, "too-large", 413))["max_request_bytes"] == 1000

    async def chunked():  # no Content-Length: aiohttp's own cap answers, as problem+json too
        for i in range(0, len(big), 500):
            yield big[i:i + 500]
    json_type = {"Content-Type": "application/json"}
    async with http.post(proxy.url + "/runs/r2", data=chunked(), headers=json_type) as r:
        await problem(r, "too-large", 413)
    async with http.post(proxy.url + "/tools/send", data=big, headers={"Idempotency-Key": "k"}) as r:
        await problem(r, "too-large", 413)
    async with http.get(proxy.url + "/metrics") as r:  # a proxied request is still counted
        assert 'idemproxy_requests_total{outcome="rejected"} 1.0' in await r.text()


async def test_connections_over_the_cap_get_503_until_some_close(serve, caplog):
    url = await serve(max_connections=20)
    host, port = url.removeprefix("http://").split(":")
    held = [await asyncio.open_connection(host, int(port)) for _ in range(20)]
    caplog.set_level(logging.INFO)
    for _ in range(10):
        resp = await raw_request(url, "GET /healthz HTTP/1.1\r\nHost: x\r\n")
        raw_problem(resp, "too-many-connections", 503)
        assert resp.headers["Retry-After"] == "1"
    assert len([r for r in caplog.records if "connection cap" in r.getMessage()]) == 1  # not one per refusal
    for _, writer in held[:5]:
        writer.close()
    await asyncio.sleep(0.1)
    assert (await raw_request(url, "GET /healthz HTTP/1.1\r\nHost: x\r\n")).status == 200
    for _, writer in held[5:]:
        writer.close()


async def closed_after(reader: asyncio.StreamReader, limit: float) -> float:
    """Seconds until the proxy closed the connection (fails past ``limit``)."""
    started = time.monotonic()
    try:
        await asyncio.wait_for(reader.read(), limit)
    except ConnectionResetError:
        pass
    return time.monotonic() - started


@pytest.mark.slow  # waits out timeouts or retention (>1 s)
async def test_half_sent_requests_and_idle_connections_are_closed_in_time(serve):
    url = await serve(header_timeout="0.5s", body_timeout="0.5s", idle_timeout="1.5s")
    host, port = url.removeprefix("http://").split(":")

    async def opened(data: bytes):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(data)
        return reader, writer
    idle = await opened(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive, then nothing
    assert b" 200 " in await idle[0].readuntil(b"\r\n\r\n")
    silent = await opened(b"")
    half_head = await opened(b"POST /tools/send HTTP/1.1\r\nHost: x\r\nContent-Le")
    half_body = await opened(b"POST /tools/send HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\":")
    waits = await asyncio.gather(*(closed_after(reader, 3.0)
                                   for reader, _ in (silent, half_head, half_body, idle)))
    assert max(waits[:3]) < 1.0, waits  # header_timeout and body_timeout, not the idle timeout
    assert 1.0 < waits[3] < 2.5, waits  # idle_timeout
    for _, writer in (silent, half_head, half_body, idle):
        writer.close()


@pytest.mark.slow  # a proxy process and 200 slow clients for a few seconds
async def test_200_slow_clients_neither_delay_a_normal_request_nor_outstay_their_timeouts(
        proxy_process, provider, sqlite_url, http):
    proc = proxy_process(proxy_sections(provider.url, sqlite_url, server={
        "header_timeout": "2s", "body_timeout": "2s", "idle_timeout": "30s", "access_log": True}))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def normal_request(i: int) -> float:
        started = time.monotonic()
        async with http.post(proc.url + "/openai/v1/chat/completions", json=chat,
                             headers={"Idempotency-Key": f"normal-{i}"}) as r:
            assert r.status == 200
            await r.read()
        return time.monotonic() - started
    baseline = min([await normal_request(i) for i in range(3)])

    async def slow_client(kind: str) -> float:
        """Seconds from connecting until the proxy closed the connection."""
        reader, writer = await asyncio.open_connection("127.0.0.1", proc.port)
        started = time.monotonic()
        if kind == "half-head":  # slowloris: a byte now and then never finishes the head
            writer.write(b"POST /tools/send HTTP/1.1\r\nHost: x\r\n")
        elif kind == "half-body":
            writer.write(b"POST /tools/send HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\":")
        try:
            while not reader.at_eof():
                try:
                    await asyncio.wait_for(reader.read(1024), 0.5)
                except asyncio.TimeoutError:
                    if kind == "half-head":
                        writer.write(b"X")
                assert time.monotonic() - started < 10, f"{kind} connection still open"
        except ConnectionError:
            pass
        finally:
            writer.close()
        return time.monotonic() - started

    kinds = ["silent"] * 70 + ["half-head"] * 70 + ["half-body"] * 60
    slow = [asyncio.create_task(slow_client(kind)) for kind in kinds]
    await asyncio.sleep(0.5)  # all 200 are connected and stalling
    during = [await normal_request(100 + i) for i in range(5)]
    waits = await asyncio.gather(*slow)
    print(f"normal request {baseline * 1000:.1f} ms alone, at most {max(during) * 1000:.1f} ms beside "
          f"200 slow clients; they were closed after {min(waits):.2f}-{max(waits):.2f} s")
    assert max(during) < max(0.5, 10 * baseline)
    assert max(waits) < 2 + 1.5  # header_timeout / body_timeout, plus scheduling slack
    closed = [line for line in proc.log.read_text().splitlines() if " closed: " in line]
    assert len(closed) == 200  # one line each
    assert "Traceback" not in proc.log.read_text()
