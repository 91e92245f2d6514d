"""The official SDKs pointed at the proxy: an unmodified agent replays with a base URL change.

The sync clients block, so they run in a thread while the proxy serves on the test's loop.
"""

from __future__ import annotations

import asyncio

import anthropic
import openai

MESSAGES = [{"role": "user", "content": "plan step one"}]


def openai_attempt(proxy_url: str, epoch: int) -> dict:
    """One run attempt of a tiny agent: a plain call, then a streamed one."""
    with openai.OpenAI(base_url=f"{proxy_url}/runs/r1/epochs/{epoch}/openai/v1", api_key="sk-test",
                       max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(model="gpt-test", messages=MESSAGES)
        plain = raw.parse()
        with client.chat.completions.create(model="gpt-test", messages=MESSAGES, stream=True) as stream:
            chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return {"plain": plain.choices[0].message.content, "plain_id": plain.id, "usage": plain.usage.total_tokens,
            "streamed": streamed, "stream_ids": {c.id for c in chunks},
            "replayed": raw.headers.get("Idempotent-Replayed")}


async def test_openai_sdk_plain_and_stream_replay_on_the_next_attempt(make_proxy, store_url, provider):
    proxy = await make_proxy(store_url)
    first = await asyncio.to_thread(openai_attempt, proxy.url, 0)
    assert first["replayed"] == "false"
    assert first["plain"].startswith("reply ") and first["streamed"].count("reply ") == 5
    assert provider.calls["chat"] == 2

    second = await asyncio.to_thread(openai_attempt, proxy.url, 1)  # the restarted attempt
    assert second["replayed"] == "true"
    assert {k: v for k, v in second.items() if k != "replayed"} == \
        {k: v for k, v in first.items() if k != "replayed"}
    assert provider.calls["chat"] == 2  # zero new upstream calls

    stale = openai.OpenAI(base_url=f"{proxy.url}/runs/r1/epochs/0/openai/v1", api_key="sk-test", max_retries=0)
    with stale:  # the superseded attempt is fenced
        try:
            await asyncio.to_thread(stale.chat.completions.create, model="gpt-test", messages=MESSAGES)
            raise AssertionError("a zombie attempt was answered")
        except openai.APIStatusError as refused:
            assert refused.status_code == 412
            assert refused.response.json()["type"].endswith("/stale-epoch")
    assert provider.calls["chat"] == 2


async def test_async_openai_sdk(make_proxy, store_url, provider):
    proxy = await make_proxy(store_url)

    async def attempt(epoch: int) -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=f"{proxy.url}/runs/ra/epochs/{epoch}/openai/v1",
                                      api_key="sk-test", max_retries=0) as client:
            plain = await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
            stream = await client.chat.completions.create(model="gpt-test", messages=MESSAGES, stream=True)
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return plain.choices[0].message.content, "".join(pieces)

    first = await attempt(0)
    assert provider.calls["chat"] == 2
    assert await attempt(1) == first
    assert provider.calls["chat"] == 2


def anthropic_attempt(proxy_url: str, epoch: int) -> dict:
    with anthropic.Anthropic(base_url=f"{proxy_url}/runs/r2/epochs/{epoch}/anthropic", api_key="sk-ant-test",
                             max_retries=0) as client:
        plain = client.messages.create(model="claude-test", max_tokens=64, messages=MESSAGES)
        with client.messages.stream(model="claude-test", max_tokens=64, messages=MESSAGES) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    return {"plain": plain.content[0].text, "plain_id": plain.id, "streamed": text, "stream_id": final.id,
            "stop": final.stop_reason, "output_tokens": final.usage.output_tokens}


async def test_anthropic_sdk_plain_and_stream_replay_on_the_next_attempt(make_proxy, store_url, provider):
    proxy = await make_proxy(store_url)
    first = await asyncio.to_thread(anthropic_attempt, proxy.url, 0)
    assert first["plain"].startswith("claude reply") and first["streamed"].startswith("claude reply")
    assert first["stop"] == "end_turn"
    assert provider.calls["messages"] == 2
    assert await asyncio.to_thread(anthropic_attempt, proxy.url, 1) == first
    assert provider.calls["messages"] == 2
