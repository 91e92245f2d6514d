"""Replays from memory (docs/concepts.md): complete entries held by the proxy that recorded or read
them, answered as the store would, on every replica; deletes, resolves and expiry are seen
everywhere, and an unreachable store ends the memory's answers within ``cache_lease``.

Two proxies, A and B, share one real store of each backend, as two replicas would.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit, urlunsplit

import pytest

from conftest import backend_url
from rawhttp import problem
from relay import Relay

ADMIN = {"Authorization": "Bearer test-admin-token"}
SEND = "/tools/send"
# Headers that differ between two answers of the same record, whoever gives them
PER_ANSWER = {"Date", "Server-Timing", "Server"}


async def send(http, url: str, key: str, text: str = "hello", run: str | None = None) -> tuple[int, str | None, bytes]:
    base = f"{url}/runs/{run}/epochs/0" if run else url
    async with http.post(base + SEND, json={"text": text}, headers={"Idempotency-Key": key}) as r:
        return r.status, r.headers.get("Idempotent-Replayed"), await r.read()


async def answer(http, url: str, key: str) -> tuple[int, dict[str, str], bytes]:
    async with http.post(url + SEND, json={"text": "hello"}, headers={"Idempotency-Key": key}) as r:
        return r.status, {k: v for k, v in r.headers.items() if k not in PER_ANSWER}, await r.read()


async def test_a_replica_replays_what_another_recorded_from_its_memory_byte_for_byte(
        make_proxy, store_url, provider, http):
    a, b = await make_proxy(store_url), await make_proxy(store_url)
    status, replayed, recorded = await send(http, a.url, "k-1")
    assert (status, replayed) == (200, "false")
    from_store = await answer(http, b.url, "k-1")  # B reads the journal once, and keeps the entry
    from_memory = await answer(http, b.url, "k-1")
    assert from_memory == from_store and from_memory[2] == recorded
    assert from_memory[1]["Idempotent-Replayed"] == "true"
    assert b.proxy.metrics.replayed_from_cache == 1
    assert (await send(http, a.url, "k-1"))[1:] == ("true", recorded)  # A kept what it recorded
    assert a.proxy.metrics.replayed_from_cache == 1
    assert provider.calls["tool:send"] == 1

    async with http.post(b.url + SEND, json={"text": "other"}, headers={"Idempotency-Key": "k-1"}) as r:
        await problem(r, "key-reused", 422)  # another request under a held key: refused as before
    async with http.get(f"{b.url}/metrics") as r:
        metrics = await r.text()
    assert "idemproxy_replays_from_answer_cache_total 1.0" in metrics
    assert 'idemproxy_requests_total{outcome="replayed"} 2.0' in metrics  # replays counted as ever


async def test_once_a_delete_has_answered_no_replica_replays_the_deleted_entry(
        make_proxy, store_url, provider, http):
    a, b = await make_proxy(store_url), await make_proxy(store_url)
    _, _, first = await send(http, a.url, "k-1", run="wipe")
    for _ in range(2):
        assert (await send(http, b.url, "k-1", run="wipe"))[1:] == ("true", first)
    assert b.proxy.metrics.replayed_from_cache == 1  # B holds it
    started = time.monotonic()
    async with http.delete(f"{a.url}/admin/runs/wipe/journal", headers=ADMIN) as r:
        assert r.status == 200 and (await r.json())["deleted"] == 1
    answered = time.monotonic()
    status, replayed, again = await send(http, b.url, "k-1", run="wipe")
    assert (status, replayed) == (200, "false") and again != first  # recorded anew
    assert answered - started >= a.settings.store.cache_lease  # the delete waited out every lease
    assert provider.calls["tool:send"] == 2
    assert b.proxy.metrics.replayed_from_cache == 1



async def test_an_entry_read_while_a_delete_committed_is_not_kept(make_proxy, store_url, http):
    # A read that started before a delete may return the entry after the delete has raised
    # the generation: it is kept only under the generation noted before the read.
    a = await make_proxy(store_url)
    await send(http, a.url, "k-1", run="wipe")
    async with http.get(f"{a.url}/admin/runs/wipe", headers=ADMIN) as r:
        kid = (await r.json())["steps"][0]["kid"]
    answers, freshness, journal = a.proxy.answers, a.proxy.freshness, a.store.journal
    answers.clear()
    noted = freshness.generation
    entry = await journal.get(kid)  # read before the delete
    await journal.delete_run("default", "wipe")
    await freshness.look()
    answers.put(entry, noted)
    assert len(answers) == 0
    answers.put(entry, freshness.generation)  # what refused it above was the generation alone
    assert len(answers) == 1

async def test_a_resolve_is_seen_everywhere_and_then_held(make_proxy, store_url, provider, http):
    # A resolve changes a quarantined entry, which no memory holds: B answers the resolution
    # at once, from the journal, and then from its memory.
    a, b = await make_proxy(store_url), await make_proxy(store_url)
    async with http.post(a.url + SEND, json={"n": 1},
                         headers={"Idempotency-Key": "charge", "X-Fake-Status": "503"}) as r:
        assert r.status == 503
    async with http.post(b.url + SEND, json={"n": 1}, headers={"Idempotency-Key": "charge"}) as r:
        kid = (await problem(r, "outcome-unknown", 502))["kid"]
    async with http.post(f"{a.url}/admin/journal/{kid}/resolve", headers=ADMIN,
                         json={"action": "respond", "status": 200, "body": '{"charged": true}'}) as r:
        assert r.status == 200
    for _ in range(2):
        async with http.post(b.url + SEND, json={"n": 1}, headers={"Idempotency-Key": "charge"}) as r:
            assert (r.status, await r.read()) == (200, b'{"charged": true}')
    assert b.proxy.metrics.replayed_from_cache == 1
    assert provider.calls["tool:send"] == 1


async def test_an_expired_entry_is_not_answered_from_memory(make_proxy, store_url, provider, http):
    a = await make_proxy(store_url, store={"retention": "1s"})
    _, _, first = await send(http, a.url, "k-1")
    assert (await send(http, a.url, "k-1"))[1:] == ("true", first)
    assert a.proxy.metrics.replayed_from_cache == 1
    await asyncio.sleep(1.1)
    assert (await send(http, a.url, "k-1"))[1] == "false"  # expired: it runs as new
    assert provider.calls["tool:send"] == 2


async def test_memory_is_bounded_by_bytes_least_recently_used_out(make_proxy, store_url, provider, http):
    probe = await make_proxy(store_url)
    await send(http, probe.url, "k-0")
    one = probe.proxy.answers.used  # what one answer holds

    a = await make_proxy(store_url, store={"answer_cache_bytes": one * 3 // 2})  # room for one
    for key in ("k-1", "k-2"):
        await send(http, a.url, key)
    assert len(a.proxy.answers) == 1 and a.proxy.answers.used <= one * 3 // 2
    assert (await send(http, a.url, "k-2"))[1] == "true"
    assert a.proxy.metrics.replayed_from_cache == 1
    assert (await send(http, a.url, "k-1"))[1] == "true"  # evicted: from the store, held again
    assert a.proxy.metrics.replayed_from_cache == 1
    assert (await send(http, a.url, "k-1"))[1] == "true"
    assert a.proxy.metrics.replayed_from_cache == 2

    off = await make_proxy(store_url, store={"answer_cache_bytes": 0})
    for _ in range(2):
        assert (await send(http, off.url, "k-1"))[1] == "true"
    assert off.proxy.metrics.replayed_from_cache == 0 and len(off.proxy.answers) == 0
    assert provider.calls["tool:send"] == 3


def _through(url: str, port: int) -> str:
    """``url`` with its host and port replaced by the relay's."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=(auth + "@" if auth else "") + f"127.0.0.1:{port}"))


@pytest.fixture(params=["postgres", "redis"])
async def relayed_store(request, tmp_path):
    """A store reached directly, and through a relay that can take it away: (url, relayed url, relay)."""
    url, cleanup = backend_url(request.param, tmp_path)
    relay = await Relay(urlsplit(url).port).up()
    try:
        yield url, _through(url, relay.port), relay
    finally:
        await relay.down()
        await asyncio.to_thread(cleanup)


LEASE_S = 3.0  # room for a slow machine between taking the store away and the replays within the lease


async def test_memory_stops_answering_within_the_lease_once_the_store_is_gone(
        relayed_store, make_proxy, provider, http):
    url, relayed, relay = relayed_store
    a = await make_proxy(url)
    b = await make_proxy(relayed, store={"cache_lease": LEASE_S, "timeout": "0.5s"})
    _, _, first = await send(http, a.url, "k-1")
    for _ in range(2):
        assert (await send(http, b.url, "k-1"))[1:] == ("true", first)
    assert b.proxy.metrics.replayed_from_cache == 1

    await relay.down()
    gone = time.monotonic()
    # within the lease, memory still answers: the refusal of another request under the key too
    assert (await send(http, b.url, "k-1"))[1:] == ("true", first)
    async with http.post(b.url + SEND, json={"text": "other"}, headers={"Idempotency-Key": "k-1"}) as r:
        await problem(r, "key-reused", 422)
    assert b.proxy.metrics.replayed_from_cache == 2
    while True:
        sent = time.monotonic()
        if (await send(http, b.url, "k-1"))[0] != 200:
            break
        assert sent - gone < LEASE_S, "memory answered past its lease with the store gone"
        await asyncio.sleep(0.05)
    async with http.post(b.url + SEND, json={"text": "hello"}, headers={"Idempotency-Key": "k-1"}) as r:
        await problem(r, "store-unavailable", 503)  # as without memory

    await relay.up()
    deadline = time.monotonic() + 10
    while (await send(http, b.url, "k-1"))[0] != 200:
        assert time.monotonic() < deadline, "no recovery once the store was back"
        await asyncio.sleep(0.1)
    assert (await send(http, b.url, "k-1"))[1:] == ("true", first)
    assert provider.calls["tool:send"] == 1
