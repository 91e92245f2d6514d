"""Limits (SPEC §5, §7): request size, record size, retention and purge."""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
import time

from rawhttp import problem

CHAT = "/openai/v1/chat/completions"
PURGED = re.compile(r"purged (\d+) expired journal entr")


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


def sqlite_rows(store_url: str, run: str) -> int | None:
    if not store_url.startswith("sqlite:"):
        return None
    conn = sqlite3.connect(store_url[len("sqlite:///"):])
    try:
        return conn.execute("SELECT count(*) FROM journal WHERE run = ?", (run,)).fetchone()[0]
    finally:
        conn.close()


async def test_expired_entries_run_as_new_and_are_purged(make_proxy, store_url, provider, http, caplog):
    caplog.set_level(logging.INFO, logger="idemproxy")
    proxy = await make_proxy(store_url, store={"retention": "1s", "purge_interval": "0.25s"})
    msg = {"model": "m", "messages": [{"role": "user", "content": "old"}]}
    for n in (0, 1):  # two entries in a run nobody touches again
        async with http.post(f"{proxy.url}/runs/purged/epochs/0{CHAT}", json={**msg, "n": n}) as r:
            assert r.status == 200
    async with http.post(proxy.url + CHAT, json=msg, headers={"Idempotency-Key": "old"}) as r:
        assert r.headers["Idempotent-Replayed"] == "false"
    async with http.post(proxy.url + CHAT, json=msg, headers={"Idempotency-Key": "old"}) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
    assert sqlite_rows(store_url, "purged") in (2, None)
    assert provider.calls["chat"] == 3

    await asyncio.sleep(1.1)  # past retention
    changed = {**msg, "messages": [{"role": "user", "content": "new"}]}
    async with http.post(proxy.url + CHAT, json=changed, headers={"Idempotency-Key": "old"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"  # new: no 422
    assert provider.calls["chat"] == 4

    def purged() -> int:
        found = (PURGED.search(rec.getMessage()) for rec in caplog.records)
        return sum(int(m.group(1)) for m in found if m)

    deadline = time.monotonic() + 3
    while purged() < 2:  # the background task deleted the two expired entries
        assert time.monotonic() < deadline, f"expired entries were not purged: {caplog.text[-2000:]}"
        await asyncio.sleep(0.05)
    assert await proxy.store.journal.purge(time.time()) == 0  # nothing expired is left
    assert sqlite_rows(store_url, "purged") in (0, None)  # gone from the file, not just hidden
