"""Limits (docs/configuration.md): request size, record size, retention and purge."""

from __future__ import annotations

import asyncio
import gzip
import time

import pytest

from idemproxy.proxy.config import StoreSettings
from idemproxy.proxy.store import make_store
from idemproxy.proxy.store.model import EntryState
from rawhttp import problem, raw_problem, raw_request

CHAT = "/openai/v1/chat/completions"


async def test_bodies_over_max_request_bytes_are_413(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url, server={"max_request_bytes": 1000})
    url = proxy.url + "/tools/send"
    big = b'{"pad":"' + b"x" * 4000 + b'"}'

    async with http.post(url, data=big, headers={"Content-Type": "application/json",
                                                 "Idempotency-Key": "big"}) as r:
        body = await problem(r, "too-large", 413)
        assert body["max_request_bytes"] == 1000

    async def chunked():  # no Content-Length: the cap holds while reading
        for i in range(0, len(big), 500):
            yield big[i:i + 500]

    async with http.post(url, data=chunked(), headers={"Content-Type": "application/json",
                                                       "Idem-Run": "big-run"}) as r:
        assert "Content-Length" not in r.request_info.headers
        await problem(r, "too-large", 413)
    async with http.post(url, data=chunked(), headers={"Content-Type": "application/json"}) as r:
        await problem(r, "too-large", 413)  # passthrough is capped too
    assert sum(provider.calls.values()) == 0

    fits = b'{"pad":"' + b"x" * (1000 - 10) + b'"}'
    assert len(fits) == 1000
    async with http.post(url, data=fits, headers={"Content-Type": "application/json",
                                                  "Idempotency-Key": "fits"}) as r:
        assert r.status == 200
    assert provider.calls["tool:send"] == 1


@pytest.mark.parametrize("over", [True, False])
async def test_a_chunked_body_that_comes_whole_with_its_head_is_capped_too(make_proxy, sqlite_url, provider, over):
    """One write holds the head and every chunk: the body is in before the handler looks
    (taken as it lies, no read loop), and the cap holds all the same."""
    proxy = await make_proxy(sqlite_url, server={"max_request_bytes": 1000})
    body = b'{"pad":"' + b"x" * ((1200 if over else 990) - 10) + b'"}'
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:600], body[600:])) + b"0\r\n\r\n"
    resp = await raw_request(proxy.url, "POST /tools/send HTTP/1.1\nHost: proxy\nContent-Type: application/json\n"
                                        "Idempotency-Key: whole-chunked\nTransfer-Encoding: chunked", chunked)
    if over:
        raw_problem(resp, "too-large", 413)
        assert sum(provider.calls.values()) == 0
    else:
        assert resp.status == 200 and provider.calls["tool:send"] == 1
        assert provider.seen[-1]["body"] == body


@pytest.mark.parametrize("late", [False, True])
async def test_a_body_grown_past_the_cap_by_its_encoding_is_413(make_proxy, sqlite_url, provider, late):
    """aiohttp inflates a gzip body as it reads; the cap is on what the upstream would get,
    whether the body came with its head or after it."""
    proxy = await make_proxy(sqlite_url, server={"max_request_bytes": 1000})
    inflated = b'{"pad":"' + b"x" * 1490 + b'"}'  # 1,500 bytes: over the cap, under aiohttp's own
    body = gzip.compress(inflated)
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /tools/send HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
                 b"Content-Encoding: gzip\r\nIdempotency-Key: gz\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    if late:
        await writer.drain()
        await asyncio.sleep(0.3)  # the handler is reading by now
    writer.write(body)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert sum(provider.calls.values()) == 0


async def test_response_over_max_record_bytes_passes_but_is_not_replayable(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, server={"max_record_bytes": 1000})
    blob = proxy.url + "/raw/blob"
    async with http.post(blob, headers={"Idempotency-Key": "huge", "X-Fake-Size": "5000"}) as r:
        assert r.status == 200 and len(await r.read()) == 5000  # the caller gets it all
    async with http.post(blob, headers={"Idempotency-Key": "huge", "X-Fake-Size": "5000"}) as r:
        await problem(r, "not-replayable", 409)
    assert provider.calls["blob"] == 1

    async with http.post(blob, headers={"Idempotency-Key": "small", "X-Fake-Size": "900"}) as r:
        small = await r.read()
    async with http.post(blob, headers={"Idempotency-Key": "small"}) as r:
        assert r.headers["Idempotent-Replayed"] == "true" and await r.read() == small

    stream = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "long"}]}
    async with http.post(proxy.url + CHAT, json=stream, headers={"Idempotency-Key": "long",
                                                                  "X-Fake-Chunks": "30"}) as r:
        whole = await r.read()
        assert len(whole) > 1000 and whole.endswith(b"data: [DONE]\n\n")
    async with http.post(proxy.url + CHAT, json=stream, headers={"Idempotency-Key": "long"}) as r:
        await problem(r, "not-replayable", 409)
    assert provider.calls["chat"] == 1


@pytest.fixture
async def reader(store_url):
    """The store the proxy writes to, opened on its own, to read what is really stored."""
    store = make_store(StoreSettings(url=store_url))
    await store.open()
    yield store
    await store.aclose()


@pytest.mark.slow  # waits out timeouts or retention (>1 s)
async def test_expired_entries_run_as_new_and_are_purged(make_proxy, store_url, reader, provider, http):
    proxy = await make_proxy(store_url, store={"retention": "1s", "purge_interval": "0.25s"})
    run = ("default", "purged")  # (namespace, run id): the run's journal in the store
    msg = {"model": "m", "messages": [{"role": "user", "content": "old"}]}
    for n in (0, 1):  # two entries in a run nobody touches again
        async with http.post(f"{proxy.url}/runs/purged/epochs/0{CHAT}", json={**msg, "n": n}) as r:
            assert r.status == 200
    async with http.post(proxy.url + CHAT, json=msg, headers={"Idempotency-Key": "old"}) as r:
        assert r.headers["Idempotent-Replayed"] == "false"
    async with http.post(proxy.url + CHAT, json=msg, headers={"Idempotency-Key": "old"}) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
    assert await reader.journal.count_steps([run]) == {run: 2}
    entries = await reader.journal.entries(*run)
    assert [e.state for e in entries] == [EntryState.COMPLETE, EntryState.COMPLETE]
    for e in entries:  # kept for the configured retention, not the default week
        assert e.expires_at - e.created_at == pytest.approx(1.0, abs=0.5), e
    assert provider.calls["chat"] == 3

    await asyncio.sleep(1.1)  # past retention
    changed = {**msg, "messages": [{"role": "user", "content": "new"}]}
    async with http.post(proxy.url + CHAT, json=changed, headers={"Idempotency-Key": "old"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"  # new: no 422
    assert provider.calls["chat"] == 4

    # the background task deletes the two expired entries: count_steps counts what is stored,
    # expired or not (rows on SQL; Redis's index, whose entries expire by themselves)
    deadline = time.monotonic() + 3
    while left := await reader.journal.count_steps([run]):
        assert time.monotonic() < deadline, f"expired entries still stored after 3 s: {left}"
        await asyncio.sleep(0.05)
    assert await proxy.store.journal.purge(time.time()) == 0  # nothing expired is left


@pytest.mark.slow  # waits out timeouts or retention (>1 s)
async def test_runs_go_with_the_journal_when_ended_or_idle_past_retention(make_proxy, store_url, reader, http):
    """Ended and idle runs are purged with the journal: with a short retention, hundreds of
    runs of 60 KB of metadata each would otherwise outlive it for ever."""
    proxy = await make_proxy(store_url, store={"retention": "1s", "purge_interval": "0.25s"})
    blob = {"notes": "x" * 60_000}
    for i in range(30):
        async with http.post(f"{proxy.url}/runs/idle-{i}", json={"metadata": blob}) as r:
            assert r.status == 201
    for step in ("", "/complete"):  # a run that ended
        async with http.post(f"{proxy.url}/runs/done{step}") as r:
            assert r.status in (200, 201)
    async with http.post(f"{proxy.url}/runs/by-traffic/epochs/0{CHAT}", json={"model": "m", "messages": []}) as r:
        assert r.status == 200
    async with http.post(f"{proxy.url}/runs/alive") as r:
        assert r.status == 201
    assert len(await reader.runs.list()) == 33

    deadline = time.monotonic() + 5
    while {r.run_id for r in await reader.runs.list()} != {"alive"}:
        assert time.monotonic() < deadline, "runs idle past retention are still stored after 5 s"
        async with http.post(f"{proxy.url}/runs/alive/heartbeat") as r:  # alive: never idle that long
            assert r.status == 200
        await asyncio.sleep(0.2)
    assert await reader.runs.count() == {"running": 1}
    async with http.get(f"{proxy.url}/runs/idle-0") as r:
        assert r.status == 404
