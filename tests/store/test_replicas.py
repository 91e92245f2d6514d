"""Many replicas: two ``idemproxy serve`` processes on one store.

Every test runs two real proxy processes against one store: a PostgreSQL schema, a
Redis prefix, or one SQLite file (the ``--workers`` case). Nothing is shared between
them but the store, so whatever holds here holds across replicas.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from conftest import BACKENDS, backend_url, proxy_sections
from rawhttp import problem

pytestmark = pytest.mark.slow  # two proxy processes per test, one SIGKILLed

CHAT = "/openai/v1/chat/completions"
TOOL = "/tools/send"


def chat(content: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture(params=BACKENDS)
async def replicas(request, tmp_path, provider, proxy_process):
    """Two proxy processes sharing one fresh store of each backend, started together
    (so PostgreSQL migrations and SQLite schema creation race, as on a real rollout)."""
    url, cleanup = backend_url(request.param, tmp_path)
    sections = proxy_sections(provider.url, url)
    started = await asyncio.gather(*(asyncio.to_thread(proxy_process, sections) for _ in range(2)),
                                   return_exceptions=True)
    pair = [proc for proc in started if not isinstance(proc, BaseException)]
    try:
        for failed in started:
            if isinstance(failed, BaseException):
                raise failed
        yield pair
    finally:
        for proc in pair:  # stopped before their store is dropped
            await asyncio.to_thread(proc.stop)
        await asyncio.to_thread(cleanup)


@pytest.fixture
async def client():
    """A client with room for 100 requests at once, and a bound on every one of them."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def wait_for_calls(provider, name: str, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while provider.calls[name] < n:
        assert time.monotonic() < deadline, f"{name} never reached {n} calls: {dict(provider.calls)}"
        await asyncio.sleep(0.01)


async def test_hundred_duplicates_over_two_replicas_cost_one_call(replicas, provider, client):
    a, b = replicas

    async def one(i: int):
        proxy = (a, b)[i % 2]
        async with client.post(proxy.url + CHAT, json=chat("once across replicas"),
                               headers={"Idempotency-Key": "hundred", "X-Fake-Delay": "1.5"}) as r:
            return r.status, r.headers.get("Idempotent-Replayed"), await r.read()

    results = await asyncio.gather(*(one(i) for i in range(100)))
    assert [status for status, _, _ in results] == [200] * 100, [r for r in results if r[0] != 200][:3]
    assert len({body for _, _, body in results}) == 1
    assert sorted(replayed for _, replayed, _ in results) == ["false"] + ["true"] * 99
    assert provider.calls["chat"] == 1
    for proxy in (a, b):  # and afterwards each replica replays it from the store
        async with client.post(proxy.url + CHAT, json=chat("once across replicas"),
                               headers={"Idempotency-Key": "hundred"}) as r:
            assert r.headers["Idempotent-Replayed"] == "true" and await r.read() == results[0][2]
    assert provider.calls["chat"] == 1


async def read_timed(resp: aiohttp.ClientResponse) -> tuple[bytes, list[float]]:
    data, times = bytearray(), []
    async for chunk in resp.content.iter_any():
        data += chunk
        times.append(time.monotonic())
    return bytes(data), times


async def test_stream_in_flight_on_one_replica_is_joined_from_the_other(replicas, provider, client):
    a, b = replicas
    headers = {"Idempotency-Key": "join-across", "X-Fake-Chunks": "12", "X-Fake-Chunk-Delay": "0.12"}
    async with client.post(a.url + CHAT, json=chat("stream", stream=True), headers=headers) as first:
        assert first.status == 200 and first.headers["Idempotent-Replayed"] == "false"
        head = await first.content.readany()  # replica A is streaming now
        rest = asyncio.create_task(read_timed(first))
        async with client.post(b.url + CHAT, json=chat("stream", stream=True),
                               headers={"Idempotency-Key": "join-across"}) as joiner:
            assert joiner.status == 200
            assert joiner.headers["Idempotent-Replayed"] == "true"
            assert joiner.headers["Content-Type"].startswith("text/event-stream")
            joined, join_times = await read_timed(joiner)
        tail, first_times = await rest
    original = head + tail
    assert joined == original  # byte for byte
    assert original.endswith(b"data: [DONE]\n\n") and original.count(b"data: ") == 14
    assert join_times[0] < first_times[-1] - 0.5  # B got bytes while A's call was still running
    assert provider.calls["chat"] == 1

    async with client.post(b.url + CHAT, json=chat("stream", stream=True),
                           headers={"Idempotency-Key": "join-across"}) as again:
        assert again.headers["Idempotent-Replayed"] == "true" and await again.read() == original
    assert provider.calls["chat"] == 1


# a run's steps: (upstream path, request body); repeated bodies get derived keys n = 0, 1, 2
STEPS = [(CHAT, chat("plan")), (CHAT, chat("think")), (CHAT, chat("plan")), (TOOL, {"to": "ops", "n": 1}),
         (CHAT, chat("draft", stream=True)), (CHAT, chat("plan"))]


async def run_steps(client, replicas_for_step, run: str, epoch: int, steps) -> list[tuple[str, bytes]]:
    out = []
    for i, (path, body) in enumerate(steps):
        proxy = replicas_for_step(i)
        async with client.post(f"{proxy.url}/runs/{run}/epochs/{epoch}{path}", json=body) as r:
            assert r.status == 200, (epoch, i, r.status, await r.text())
            out.append((r.headers["Idempotent-Replayed"], await r.read()))
    return out


async def test_a_run_whose_attempts_alternate_between_replicas_replays(replicas, provider, client):
    a, b = replicas
    spent = lambda: (provider.calls["chat"], provider.calls["tool:send"])  # noqa: E731

    first = await run_steps(client, lambda i: a, "alt", 0, STEPS)  # attempt 0 on A: all live
    assert [replayed for replayed, _ in first] == ["false"] * len(STEPS)
    assert len({body for _, body in first}) == len(STEPS)  # "plan" three times: three answers
    assert spent() == (5, 1)

    second = await run_steps(client, lambda i: b, "alt", 1, STEPS)  # attempt 1 on B: all replayed
    assert second == [("true", body) for _, body in first]
    assert spent() == (5, 1)
    (live,) = await run_steps(client, lambda i: b, "alt", 1, [(CHAT, chat("plan"))])  # a 4th "plan": new
    assert live[0] == "false" and spent() == (6, 1)

    # attempt 2 steps back and forth between the replicas; occurrences are counted in the store
    third = await run_steps(client, lambda i: (a, b)[i % 2], "alt", 2, STEPS + [(CHAT, chat("plan"))])
    assert third == [("true", body) for _, body in first] + [("true", live[1])]
    assert spent() == (6, 1)

    for proxy in (a, b):  # the superseded attempts are fenced on either replica
        for epoch in (0, 1):
            async with client.post(f"{proxy.url}/runs/alt/epochs/{epoch}{CHAT}", json=chat("plan")) as r:
                assert (await problem(r, "stale-epoch", 412))["epoch"] == 2
    assert spent() == (6, 1)


async def test_the_fence_holds_across_replicas(replicas, provider, client):
    a, b = replicas
    async with client.post(f"{a.url}/runs/fenced/epochs/0{CHAT}", json=chat("step")) as r:
        assert r.status == 200
        recorded = await r.read()
    async with client.post(f"{b.url}/runs/fenced/attempts") as r:  # a new attempt, started on B
        assert r.status == 201 and (await r.json())["epoch"] == 1
    before = sum(provider.calls.values())

    # the zombie (epoch 0) is refused on A, where it ran, and on B; records, passthrough alike
    for proxy in (a, b):
        for method, path, headers in (("POST", CHAT, {}), ("POST", TOOL, {"Idempotency-Key": "z"}),
                                      ("GET", "/raw/echo/x", {})):
            async with client.request(method, f"{proxy.url}/runs/fenced/epochs/0{path}", json=chat("zombie"),
                                      headers=headers) as r:
                assert (await problem(r, "stale-epoch", 412))["epoch"] == 1
        async with client.post(proxy.url + CHAT, json=chat("zombie"),
                               headers={"Idem-Run": "fenced", "Idem-Epoch": "0"}) as r:
            await problem(r, "stale-epoch", 412)
    assert sum(provider.calls.values()) == before  # nothing forwarded

    # the new attempt replays on A what attempt 0 recorded there
    async with client.post(f"{a.url}/runs/fenced/epochs/1{CHAT}", json=chat("step")) as r:
        assert r.headers["Idempotent-Replayed"] == "true" and await r.read() == recorded

    # traffic alone raises the epoch too, by one: epoch 2 seen on A fences epoch 1 on B
    async with client.post(f"{a.url}/runs/fenced/epochs/2{CHAT}", json=chat("step")) as r:
        assert r.status == 200
    async with client.post(f"{b.url}/runs/fenced/epochs/1{CHAT}", json=chat("late")) as r:
        assert (await problem(r, "stale-epoch", 412))["epoch"] == 2

    # zombies arriving at both replicas at once, all refused, none forwarded
    before = sum(provider.calls.values())

    async def zombie(i: int) -> int:
        async with client.post(f"{(a, b)[i % 2].url}/runs/fenced/epochs/{i % 2}{CHAT}",
                               json=chat(f"zombie {i}")) as r:
            return r.status
    assert set(await asyncio.gather(*(zombie(i) for i in range(40)))) == {412}
    assert sum(provider.calls.values()) == before


async def test_a_joiner_is_cut_short_when_the_streaming_replica_dies(tmp_path, provider, proxy_process, client):
    """Replica A dies mid-stream: B's joiner must not hang, nor take the bytes for a whole answer."""
    url, cleanup = backend_url("sqlite", tmp_path)
    sections = proxy_sections(provider.url, url, store={"lease": "1s"})
    a, b = proxy_process(sections), proxy_process(sections)
    try:
        headers = {"Idempotency-Key": "dies", "X-Fake-Chunks": "60", "X-Fake-Chunk-Delay": "0.1"}
        async with client.post(a.url + CHAT, json=chat("stream", stream=True), headers=headers) as first:
            await first.content.readany()  # A is streaming
            async with client.post(b.url + CHAT, json=chat("stream", stream=True),
                                   headers={"Idempotency-Key": "dies"}) as joiner:
                assert joiner.status == 200
                await joiner.content.readany()  # joined
                a.kill()
                started = time.monotonic()
                with pytest.raises(aiohttp.ClientPayloadError):
                    await joiner.read()
                assert time.monotonic() - started < 5  # within about a lease, never a hang
    finally:
        for proc in (a, b):
            await asyncio.to_thread(proc.stop)
        await asyncio.to_thread(cleanup)
