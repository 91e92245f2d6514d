"""A recorded stream whose proxy is SIGKILLed mid-way (docs/guarantees.md).

A replay is the whole recorded answer or nothing. The bytes a dead proxy shared through
the store are not an answer: a retry that finds them waits as for any key in flight (409
``in-flight`` after ``in_flight_wait``; after the lease, what any expired claim gets), and a
request that had joined the stream is broken off, never ended cleanly. Real proxy processes
on every store, really killed; the retries go to another process on the same store.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import aiohttp
import pytest

from conftest import BACKENDS, backend_url, proxy_sections
from rawhttp import check_problem

pytestmark = pytest.mark.slow  # proxy subprocesses, one SIGKILLed, one SIGSTOPped

CHAT = "/openai/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "a long answer"}], "stream": True}
# 39 content events, the finish event and [DONE]: 41 events over about 4 s
SLOW_STREAM = {"X-Fake-Chunks": "39", "X-Fake-Chunk-Delay": "0.1"}
EVENTS = 41


@dataclass
class Answer:
    status: int
    replayed: str | None
    body: bytes
    broken: bool  # the connection was broken off before the answer's end

    @property
    def complete_stream(self) -> bool:
        return not self.broken and self.body.count(b"data: ") == EVENTS and self.body.endswith(b"data: [DONE]\n\n")


async def answer_of(resp: aiohttp.ClientResponse) -> Answer:
    body, broken = bytearray(), False
    try:
        async for chunk in resp.content.iter_any():
            body += chunk
    except aiohttp.ClientPayloadError:
        broken = True
    return Answer(resp.status, resp.headers.get("Idempotent-Replayed"), bytes(body), broken)


def never_a_cut_replay(answer: Answer) -> None:
    """The rule itself: a 200 presented as the recorded answer that ends cleanly is the
    whole of it (one broken off is an error to every HTTP client)."""
    if answer.status == 200 and answer.replayed == "true" and not answer.broken:
        assert answer.complete_stream, (answer.body.count(b"data: "), answer.body[-60:])


async def read_events(resp: aiohttp.ClientResponse, n: int) -> bytes:
    data = bytearray()
    while data.count(b"data: ") < n:
        chunk = await resp.content.readany()
        assert chunk, "the stream ended early"
        data += chunk
    return bytes(data)


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    url, cleanup = backend_url(request.param, tmp_path)
    yield url
    cleanup()


@pytest.fixture
async def client():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def start(proxy_process, sections, n: int):
    return await asyncio.gather(*(asyncio.to_thread(proxy_process, sections) for _ in range(n)))


async def test_a_retry_after_the_kill_waits_and_a_frozen_joiner_is_cut_off(store, provider, proxy_process, client):
    """on_ambiguous = retry. A records the stream and is killed; B had joined it and is frozen
    (SIGSTOP) through what follows; C gets the retries: within the lease 409 in-flight, after
    it the call goes upstream again. B's joiner, woken when C has recorded the new answer,
    must be broken off, not given A's bytes followed by the end of C's answer."""
    lease = 3.0
    sections = proxy_sections(provider.url, store, server={"in_flight_wait": "1s"}, store={"lease": f"{lease}s"})
    a, b, c = await start(proxy_process, sections, 3)
    key = {"Idempotency-Key": "killed-mid-stream"}
    frozen = False
    try:
        async with client.post(a.url + CHAT, json=BODY, headers={**key, **SLOW_STREAM}) as first:
            assert first.status == 200 and first.headers["Idempotent-Replayed"] == "false"
            await read_events(first, 3)
            async with client.post(b.url + CHAT, json=BODY, headers=key) as joiner:
                assert joiner.status == 200 and joiner.headers["Idempotent-Replayed"] == "true"
                await read_events(joiner, 1)
                await read_events(first, 9)
                os.kill(b.proc.pid, signal.SIGSTOP)
                frozen = True
                a.kill()  # SIGKILL, mid-stream
                killed = time.monotonic()
                answer = await answer_of(first)
                assert answer.broken and b"[DONE]" not in answer.body

                async with client.post(c.url + CHAT, json=BODY, headers=key) as retry:
                    answer = await answer_of(retry)
                never_a_cut_replay(answer)
                assert answer.status == 409, (answer.status, answer.replayed, answer.body[:200])
                assert b"/problems/in-flight" in answer.body
                assert time.monotonic() - killed < lease - 0.5  # answered within the lease

                await asyncio.sleep(max(0.0, killed + lease + 0.2 - time.monotonic()))
                async with client.post(c.url + CHAT, json=BODY, headers={**key, "X-Fake-Chunks": "39"}) as again:
                    answer = await answer_of(again)
                never_a_cut_replay(answer)
                assert (answer.status, answer.replayed) == (200, "false")  # expired claim, retry: upstream again
                assert answer.complete_stream
                assert provider.calls["chat"] == 2

                os.kill(b.proc.pid, signal.SIGCONT)
                frozen = False
                joined = await answer_of(joiner)
                never_a_cut_replay(joined)
                assert joined.broken, joined.body[-80:]
    finally:
        if frozen:
            os.kill(b.proc.pid, signal.SIGCONT)


async def test_under_quarantine_a_retry_after_the_kill_gets_outcome_unknown(store, provider, proxy_process, client):
    """on_ambiguous = quarantine, in_flight_wait longer than the lease: the retry waits out
    the dead claim's lease and gets what any expired claim gets, 502 outcome-unknown; a
    request that had joined before the kill is broken off."""
    lease = 2.0
    sections = proxy_sections(provider.url, store, server={"in_flight_wait": "8s"}, store={"lease": f"{lease}s"},
                              upstreams__openai={"on_ambiguous": "quarantine"})
    a, b = await start(proxy_process, sections, 2)
    key = {"Idempotency-Key": "killed-under-quarantine"}
    async with client.post(a.url + CHAT, json=BODY, headers={**key, **SLOW_STREAM}) as first:
        await read_events(first, 2)
        async with client.post(b.url + CHAT, json=BODY, headers=key) as joiner:
            assert joiner.status == 200
            await read_events(joiner, 1)
            await read_events(first, 9)
            a.kill()
            killed = time.monotonic()
            async with client.post(b.url + CHAT, json=BODY, headers=key) as retry:
                waited = time.monotonic() - killed
                answer = await answer_of(retry)
                content_type = retry.headers.get("Content-Type", "")
            joined = await answer_of(joiner)
    never_a_cut_replay(answer)
    check_problem(answer.status, content_type, answer.body, "outcome-unknown", 502)
    assert waited > lease / 2  # it waited for the lease: the claim was not given up at once
    never_a_cut_replay(joined)
    assert joined.broken and b"[DONE]" not in joined.body
    assert provider.calls["chat"] == 1


async def test_a_live_stream_silent_past_in_flight_wait_is_still_joined(store, provider, proxy_process, client):
    """The other side of the rule: a stream whose proxy lives is joined from another
    replica even while its upstream is silent for longer than ``in_flight_wait`` (a model
    thinking): the recording proxy shares a sign of life while the stream is quiet."""
    sections = proxy_sections(provider.url, store, server={"in_flight_wait": "1.5s"})
    a, b = await start(proxy_process, sections, 2)
    key = {"Idempotency-Key": "quiet-stream"}
    # the finish event, 3 s of silence, then [DONE]
    async with client.post(a.url + CHAT, json=BODY, headers={**key, "X-Fake-Chunks": "0",
                                                             "X-Fake-Chunk-Delay": "3"}) as first:
        head = await read_events(first, 1)
        await asyncio.sleep(0.5)  # shared with the store by now: the silence has begun
        async with client.post(b.url + CHAT, json=BODY, headers=key) as joiner:
            joined = await answer_of(joiner)
        rest = await answer_of(first)
    assert (joined.status, joined.replayed) == (200, "true"), (joined.status, joined.body[:200])
    assert not joined.broken and joined.body == head + rest.body
    assert joined.body.endswith(b"data: [DONE]\n\n")
    assert provider.calls["chat"] == 1
