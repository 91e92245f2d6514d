"""Record once, replay after: the heart of the proxy, on every backend."""

import asyncio

from rawhttp import raw_request


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


async def test_a_head_answer_keeps_its_content_length_passed_recorded_and_replayed(make_proxy, store_url, provider):
    """A HEAD answer's Content-Length is the length a GET would get (RFC 9110 §9.3.2), not a
    body's framing: the agent gets the upstream's, in passthrough, record and replay.
    Replayed by a second proxy too, from the store, not from memory."""
    first = await make_proxy(store_url)
    second = await make_proxy(store_url)
    head = "HEAD /raw/blob HTTP/1.1\nHost: proxy\nX-Fake-Size: 5000"
    recorded = head + "\nIdem-Policy: record\nIdempotency-Key: head-1"
    answers = [await raw_request(first.url, head), await raw_request(first.url, recorded),
               await raw_request(first.url, recorded), await raw_request(second.url, recorded)]
    for answer in answers:
        assert answer.status == 200
        assert answer.headers.getall("Content-Length") == ["5000"], answer.headers
        assert answer.body == b""
        assert "Transfer-Encoding" not in answer.headers
    assert [a.headers.get("Idempotent-Replayed") for a in answers[1:]] == ["false", "true", "true"]
    assert provider.calls["blob"] == 2
