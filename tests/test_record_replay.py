"""Record once, replay after: the heart of the proxy, on every backend."""

import asyncio


async def test_second_call_with_same_key_is_replayed(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Idempotency-Key": "step-1", "Authorization": "Bearer sk-a"}
    async with http.post(f"{proxy.url}/openai/v1/chat/completions", json=body, headers=headers) as r1:
        first = await r1.read()
        assert r1.status == 200
        assert r1.headers["Idempotent-Replayed"] == "false"
    async with http.post(f"{proxy.url}/openai/v1/chat/completions", json=body, headers=headers) as r2:
        assert await r2.read() == first
        assert r2.headers["Idempotent-Replayed"] == "true"
        assert "Set-Cookie" not in r2.headers
        assert r2.headers["Server-Timing"].startswith("idemproxy;dur=")
    assert provider.calls["chat"] == 1


async def test_fifty_concurrent_duplicates_cost_one_upstream_call(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    body = {"model": "m", "messages": [{"role": "user", "content": "once"}]}
    headers = {"Idempotency-Key": "same", "X-Fake-Delay": "0.2"}

    async def one():
        async with http.post(f"{proxy.url}/openai/v1/chat/completions", json=body, headers=headers) as r:
            return r.status, await r.read()

    results = await asyncio.gather(*(one() for _ in range(50)))
    assert {status for status, _ in results} == {200}
    assert len({body for _, body in results}) == 1
    assert provider.calls["chat"] == 1
