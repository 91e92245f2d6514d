"""Durability (docs/guarantees.md): answered means committed; no credential stored; fail closed."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from conftest import proxy_sections
from rawhttp import problem

CHAT = "/openai/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "remember me"}]}


@pytest.mark.slow  # proxy subprocesses, one SIGKILLed
async def test_answer_survives_sigkill_right_after_it(proxy_process, store_url, provider, http):
    sections = proxy_sections(provider.url, store_url)
    first = proxy_process(sections)
    auth = {"Authorization": "Bearer sk-kill-test"}
    answers = {}
    async with http.post(first.url + CHAT, json=BODY, headers={**auth, "Idempotency-Key": "k1"}) as r:
        answers["explicit"] = await r.read()
    async with http.post(first.url + "/runs/rk/epochs/0" + CHAT, json={**BODY, "stream": True}, headers=auth) as r:
        answers["stream"] = await r.read()
    async with http.post(first.url + "/tools/send", json=BODY, headers={**auth, "Idempotency-Key": "t1"}) as r:
        answers["tool"] = await r.read()
    first.kill()  # SIGKILL: no shutdown, no flush, no checkpoint

    second = proxy_process(sections)  # same store; a new tenant secret would lose every record
    replays = {}
    async with http.post(second.url + CHAT, json=BODY, headers={**auth, "Idempotency-Key": "k1"}) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
        replays["explicit"] = await r.read()
    async with http.post(second.url + "/runs/rk/epochs/1" + CHAT, json={**BODY, "stream": True}, headers=auth) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
        replays["stream"] = await r.read()
    async with http.post(second.url + "/tools/send", json=BODY, headers={**auth, "Idempotency-Key": "t1"}) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
        replays["tool"] = await r.read()
    assert replays == answers
    assert (provider.calls["chat"], provider.calls["tool:send"]) == (2, 1)


def store_bytes(db: Path) -> bytes:
    return b"".join(p.read_bytes() for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists())


async def test_store_file_holds_no_credential_and_no_cookie(make_proxy, sqlite_url, provider, http):
    secrets = [b"sk-live-bearer-9f8e7d6c5b4a", b"xak-anthropic-1a2b3c4d5e", b"azure-api-key-77aa88bb",
               b"goog-key-31415926", b"sk-passthrough-2718281828", b"injected-cred-1618033988",
               b"secret-cookie"]
    proxy = await make_proxy(sqlite_url, upstreams__tools={"set_headers": {"X-Tool-Token": secrets[5].decode()}},
                             upstreams__openai={"redact_headers": ["X-Request-Id"]})
    u = proxy.url
    requests = [
        ("POST", u + CHAT, BODY, {"Authorization": f"Bearer {secrets[0].decode()}", "Idempotency-Key": "a"}),
        ("POST", u + "/runs/sec/epochs/0" + CHAT, {**BODY, "stream": True},
         {"Authorization": f"Bearer {secrets[0].decode()}"}),
        ("POST", u + "/anthropic/v1/messages", BODY, {"x-api-key": secrets[1].decode(), "Idempotency-Key": "b"}),
        ("POST", u + "/anthropic/v1/messages", {**BODY, "stream": True},
         {"x-api-key": secrets[1].decode(), "Idem-Run": "sec2"}),
        ("POST", u + "/tools/send", BODY, {"api-key": secrets[2].decode(), "Idempotency-Key": "c"}),
        ("POST", u + "/tools/send", BODY, {"x-goog-api-key": secrets[3].decode(), "Idempotency-Key": "d",
                                           "X-Fake-Status": "503"}),
        ("POST", u + "/tools/send", BODY, {"Authorization": f"Bearer {secrets[0].decode()}",
                                           "Idempotency-Key": "e", "X-Fake-Status": "400"}),
        ("GET", u + "/raw/echo/pass", None, {"Authorization": f"Bearer {secrets[4].decode()}"}),
        ("POST", u + CHAT, BODY, {"Authorization": f"Bearer {secrets[0].decode()}", "Idempotency-Key": "a"}),
    ]
    for method, url, body, headers in requests:
        async with http.request(method, url, json=body, headers=headers) as r:
            await r.read()
            assert r.status < 600
    assert provider.calls["chat"] == 2 and provider.calls["messages"] == 2

    db = Path(sqlite_url[len("sqlite:///"):])
    written = store_bytes(db)
    assert b"chat.completion" in written and b"claude reply" in written  # the records are there
    for secret in secrets:
        assert secret not in written, secret
    await proxy.server.close()  # checkpoint the WAL into the main file, then look again
    written = store_bytes(db)
    assert b"chat.completion" in written
    for secret in secrets:
        assert secret not in written, secret

    conn = sqlite3.connect(db)  # and the stored response headers say why: stripped before storing
    try:
        headers = b" ".join(row[0] for row in conn.execute("SELECT headers FROM journal WHERE headers IS NOT NULL"))
    finally:
        conn.close()
    assert b"Content-Type" in headers
    assert b"Set-Cookie" not in headers and b"X-Request-Id" not in headers


@pytest.mark.slow  # a store outage and its timeouts
async def test_store_failure_fails_closed_and_passthrough_still_works(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url, store={"timeout": "0.5s"})
    async with http.post(proxy.url + CHAT, json=BODY, headers={"Idempotency-Key": "warm"}) as r:
        assert r.status == 200
    calls = provider.calls["chat"]

    blocker = sqlite3.connect(sqlite_url[len("sqlite:///"):], isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # every write of the proxy now times out
    try:
        for headers, path in (({"Idempotency-Key": "blocked"}, CHAT),
                              ({}, "/runs/blocked-run/epochs/0" + CHAT),
                              ({"Idempotency-Key": "tool-blocked"}, "/tools/send")):
            async with http.post(proxy.url + path, json=BODY, headers=headers) as r:
                await problem(r, "store-unavailable", 503)
        assert provider.calls["chat"] == calls and provider.calls["tool:send"] == 0  # nothing forwarded
        async with http.get(proxy.url + "/raw/echo/still-up") as r:
            assert r.status == 200  # passthrough needs no store
        async with http.post(proxy.url + CHAT, json=BODY) as r:
            assert r.status == 200  # a POST with neither key nor run is passthrough too
        async with http.get(proxy.url + "/readyz") as r:
            await problem(r, "store-unavailable", 503)
        async with http.get(proxy.url + "/healthz") as r:
            assert r.status == 200
        await asyncio.sleep(0.6)  # let the writer give up on what is still queued
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()

    async with http.post(proxy.url + CHAT, json=BODY, headers={"Idempotency-Key": "after"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"
    async with http.get(proxy.url + "/readyz") as r:
        assert r.status == 200


@pytest.mark.slow  # a store outage and its timeouts
async def test_a_write_answered_as_store_unavailable_never_commits_later(make_proxy, sqlite_url, provider, http):
    """A claim whose request got 503 must not appear once the store recovers: nobody would
    own it, and on a quarantine upstream it would turn into outcome-unknown for good."""
    proxy = await make_proxy(sqlite_url, store={"timeout": "1s"})
    async with http.get(proxy.url + "/readyz") as r:
        assert r.status == 200

    async def send(key: str) -> int:
        async with http.post(proxy.url + "/tools/send", json=BODY, headers={"Idempotency-Key": key}) as r:
            return r.status

    blocker = sqlite3.connect(sqlite_url[len("sqlite:///"):], isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        first = asyncio.create_task(send("a"))  # keeps the writer busy-waiting for the lock
        await asyncio.sleep(0.5)
        second = asyncio.create_task(send("b"))  # queued behind it; its caller gives up first
        assert (await first, await second) == (503, 503)
    finally:
        blocker.execute("ROLLBACK")  # the writer may still hold b's write: it must drop it
        blocker.close()
    await asyncio.sleep(0.3)
    for key in ("a", "b"):  # the keys are free: a retry goes upstream at once
        assert await asyncio.wait_for(send(key), 2.0) == 200
    assert provider.calls["tool:send"] == 2
