"""Concurrency (docs/guarantees.md): duplicates in flight, in_flight_wait, leases renewed and expiring.

(50 concurrent duplicates on one proxy cost one upstream call: tests/request_path/test_record_replay.py.)
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from conftest import proxy_sections
from rawhttp import problem

CHAT = "/openai/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "slow one"}]}


async def wait_for_calls(provider, name: str, n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while provider.calls[name] < n:
        assert time.monotonic() < deadline, f"{name} never reached {n} calls: {provider.calls}"
        await asyncio.sleep(0.01)


@pytest.mark.slow  # waits out in_flight_wait
@pytest.mark.parametrize("where", ["same-proxy", "other-proxy"])
async def test_duplicate_gets_409_in_flight_after_in_flight_wait(make_proxy, store_url, provider, http, where):
    one = await make_proxy(store_url, server={"in_flight_wait": "0.3s"})
    two = one if where == "same-proxy" else await make_proxy(store_url, server={"in_flight_wait": "0.3s"})

    async def first():
        async with http.post(one.url + CHAT, json=BODY, headers={"Idempotency-Key": "slow",
                                                                  "X-Fake-Delay": "1.2"}) as r:
            return r.status, await r.read()

    task = asyncio.create_task(first())
    await wait_for_calls(provider, "chat", 1)
    t0 = time.perf_counter()
    async with http.post(two.url + CHAT, json=BODY, headers={"Idempotency-Key": "slow"}) as r:
        waited = time.perf_counter() - t0
        await problem(r, "in-flight", 409)
        assert int(r.headers["Retry-After"]) >= 1
    assert 0.25 <= waited < 0.9, waited  # it waited in_flight_wait, not for the whole call
    status, body = await task
    assert status == 200
    async with http.post(two.url + CHAT, json=BODY, headers={"Idempotency-Key": "slow"}) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
        assert await r.read() == body
    assert provider.calls["chat"] == 1


@pytest.mark.parametrize("where", ["same-proxy", "other-proxy"])
async def test_duplicate_within_in_flight_wait_gets_the_outcome(make_proxy, store_url, provider, http, where):
    one = await make_proxy(store_url)
    two = one if where == "same-proxy" else await make_proxy(store_url)

    async def call(proxy):
        async with http.post(proxy.url + CHAT, json=BODY, headers={"Idempotency-Key": "w", "X-Fake-Delay": "0.4"}) as r:
            return r.status, r.headers["Idempotent-Replayed"], await r.read()

    task = asyncio.create_task(call(one))
    await wait_for_calls(provider, "chat", 1)
    dup = await call(two)
    first = await task
    assert (first[0], first[1]) == (200, "false")
    assert dup == (200, "true", first[2])
    assert provider.calls["chat"] == 1


async def test_different_request_with_a_key_in_flight_is_422(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    task = asyncio.create_task(http.post(proxy.url + CHAT, json=BODY,
                                         headers={"Idempotency-Key": "k", "X-Fake-Delay": "0.5"}))
    await wait_for_calls(provider, "chat", 1)
    async with http.post(proxy.url + CHAT, json={**BODY, "model": "other"}, headers={"Idempotency-Key": "k"}) as r:
        await problem(r, "key-reused", 422)
    (await task).release()
    assert provider.calls["chat"] == 1


async def test_concurrent_duplicates_across_proxies_cost_one_call(make_proxy, store_url, provider, http):
    proxies = [await make_proxy(store_url), await make_proxy(store_url)]

    async def one(i: int):
        async with http.post(proxies[i % 2].url + CHAT, json=BODY,
                             headers={"Idempotency-Key": "many", "X-Fake-Delay": "0.3"}) as r:
            return r.status, await r.read()

    results = await asyncio.gather(*(one(i) for i in range(30)))
    assert {status for status, _ in results} == {200}
    assert len({body for _, body in results}) == 1
    assert provider.calls["chat"] == 1


@pytest.mark.slow  # a call that outlives several leases
async def test_lease_is_renewed_while_the_call_is_in_flight(make_proxy, store_url, provider, http):
    """A call longer than the lease keeps its claim: another proxy does not take it over."""
    one = await make_proxy(store_url, store={"lease": "0.45s"})
    two = await make_proxy(store_url, store={"lease": "0.45s"})

    async def call(proxy, **extra):
        async with http.post(proxy.url + CHAT, json=BODY, headers={"Idempotency-Key": "long", **extra}) as r:
            return r.status, r.headers["Idempotent-Replayed"], await r.read()

    task = asyncio.create_task(call(one, **{"X-Fake-Delay": "1.2"}))
    await wait_for_calls(provider, "chat", 1)
    await asyncio.sleep(0.7)  # well past the first lease
    dup = await call(two)
    first = await task
    assert dup == (200, "true", first[2])
    assert provider.calls["chat"] == 1


@pytest.mark.slow  # a proxy subprocess SIGKILLed, then its lease runs out
@pytest.mark.parametrize("upstream, expect", [("openai", "retry"), ("tools", "quarantine")])
async def test_lease_of_a_dead_proxy_expires(make_proxy, proxy_process, store_url, provider, http,
                                             upstream, expect):
    """A proxy killed mid-call leaves a claim that expires and counts as an ambiguous outcome."""
    sections = proxy_sections(provider.url, store_url, store={"lease": "0.6s"})
    doomed = proxy_process(sections)
    path = CHAT if upstream == "openai" else "/tools/send"
    name = "chat" if upstream == "openai" else "tool:send"
    key = {"Idempotency-Key": "dead-holder"}

    async def first():
        try:
            async with http.post(doomed.url + path, json=BODY, headers={**key, "X-Fake-Delay": "1"}) as r:
                return r.status
        except aiohttp.ClientError:
            return None

    task = asyncio.create_task(first())
    await wait_for_calls(provider, name, 1, timeout=10)
    doomed.kill()  # SIGKILL while the call is in flight: nobody renews its lease now
    assert await task is None

    survivor = await make_proxy(store_url, store={"lease": "0.6s"})
    t0 = time.perf_counter()
    async with http.post(survivor.url + path, json=BODY, headers=key) as r:
        if expect == "retry":
            assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"
            assert provider.calls[name] == 2
        else:
            await problem(r, "outcome-unknown", 502)
            assert provider.calls[name] == 1
    assert time.perf_counter() - t0 < 3.0  # within about one lease, not an upstream timeout
