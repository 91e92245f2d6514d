"""Edge cases found in review: each test failed before its fix."""

import asyncio
import sqlite3

import aiohttp
import pytest
from multidict import CIMultiDict

from idemproxy.proxy.config import ConfigError, load_settings, mask_url
from idemproxy.proxy.store.model import EntryState, Scope
from idemproxy.proxy.store.waking import Waiters
from config_files import write_config
from rawhttp import problem, raw_request

CHAT = "/openai/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.slow  # a stream split with pauses, about 2 s
async def test_a_terminal_event_split_across_reads_waits_for_the_record(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url)
    body = {**BODY, "stream": True}
    headers = {"Idempotency-Key": "split", "X-Fake-Split": "0.3"}
    kid = Scope.of_key(proxy.proxy.tenants.of_credential(CIMultiDict()), None, "openai", "split").kid
    seen = b""
    async with http.post(proxy.url + CHAT, json=body, headers=headers) as resp:
        async for chunk in resp.content.iter_any():
            seen += chunk
            if b"[DONE]" in seen:  # the SDK stops here and the agent moves on
                entry = await proxy.store.journal.get(kid)
                assert entry is not None and entry.state == EntryState.COMPLETE
                break
    assert b"[DONE]" in seen


async def test_a_passthrough_stream_that_breaks_is_cut_short_not_patched(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url)
    body = {**BODY, "stream": True}
    async with http.post(proxy.url + CHAT, json=body, headers={"Idem-Policy": "passthrough",
                                                               "X-Fake-Break": "2"}) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()  # no problem+json spliced into the body, no clean end


async def test_a_duplicate_of_a_released_call_goes_upstream_itself(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url)
    headers = {"Idempotency-Key": "busy", "X-Fake-Status": "429", "X-Fake-Delay": "0.3"}

    async def call():
        async with http.post(proxy.url + CHAT, json=BODY, headers=headers) as r:
            return r.status, r.headers.get("Idempotent-Replayed")

    first, second = await asyncio.gather(call(), call())
    assert first == second == (429, "false")  # nothing happened upstream: not a replay
    assert provider.calls["chat"] == 2


@pytest.mark.slow  # a store outage and its timeouts
async def test_passthrough_in_a_run_works_while_the_store_is_down(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url, store={"timeout": "0.5s"})
    blocker = sqlite3.connect(sqlite_url[len("sqlite:///"):], isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # a new run cannot be written now
    try:
        async with http.get(proxy.url + "/runs/new-run/epochs/0/raw/echo/x") as r:
            assert r.status == 200
        async with http.post(proxy.url + "/runs/new-run/epochs/0" + CHAT, json=BODY) as r:
            await problem(r, "store-unavailable", 503)
        await asyncio.sleep(0.6)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert provider.calls["chat"] == 0


async def test_an_answer_whose_claim_was_lost_is_withheld(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url)

    async def call():
        async with http.post(proxy.url + "/runs/lost/epochs/0" + CHAT, json=BODY,
                             headers={"Idempotency-Key": "lost", "X-Fake-Delay": "0.5"}) as r:
            return r.status, await r.read()

    pending = asyncio.create_task(call())
    await asyncio.sleep(0.25)
    assert await proxy.store.journal.delete_run("default", "lost") == 1  # the claim vanishes mid-call
    status, body = await pending
    assert status == 409 and b"in-flight" in body
    async with http.post(proxy.url + "/runs/lost/epochs/0" + CHAT, json=BODY,
                         headers={"Idempotency-Key": "lost"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"


async def test_an_agent_key_cannot_pose_as_a_derived_key(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url)
    url = proxy.url + "/runs/pose/epochs/0" + CHAT
    async with http.post(url, json=BODY) as r:
        assert r.status == 200
    (entry,) = await proxy.store.journal.entries("default", "pose")
    async with http.post(url, json=BODY, headers={"Idempotency-Key": entry.key}) as r:
        assert r.headers["Idempotent-Replayed"] == "false"  # its own scope, not the derived entry
    assert provider.calls["chat"] == 2


async def test_recorded_calls_feed_the_latency_histograms(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url)
    async with http.post(proxy.url + CHAT, json=BODY, headers={"Idempotency-Key": "h"}) as r:
        assert r.status == 200
    async with http.get(proxy.url + "/metrics") as r:
        text = await r.text()
    assert "idemproxy_upstream_seconds_count 1.0" in text


@pytest.mark.parametrize("target", ["/raw/..;/admin", "/raw/%2e%2e;x/admin", "/raw/a/..;jsessionid=1/b"])
async def test_matrix_parameter_escapes_are_refused(make_proxy, sqlite_url, provider, http, target):
    proxy = await make_proxy(sqlite_url)
    async with http.get(proxy.url + target) as r:
        await problem(r, "invalid-request", 400)
    assert sum(provider.calls.values()) == 0


async def test_epochs_are_bounded_to_what_every_store_keeps_exact(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url)
    async with http.post(proxy.url + "/runs/big/epochs/9007199254740993" + CHAT, json=BODY) as r:
        await problem(r, "invalid-header", 400)


def test_an_upstream_may_not_take_a_reserved_name(tmp_path):
    path = write_config(tmp_path / "c.toml", {"upstreams.healthz": {"url": "http://127.0.0.1:1"}})
    with pytest.raises(ConfigError, match="reserved"):
        load_settings(path, env={})


def test_secrets_in_urls_are_masked():
    assert mask_url("redis://:hunter2@h:6379/0?password=p2&prefix=x") == "redis://:***@h:6379/0?password=***&prefix=x"
    settings = load_settings(None, env={"IDEMPROXY_UPSTREAMS_OPENAI_URL": "https://u:pw@api.example/?token=t"})
    assert "pw" not in repr(settings.upstreams["openai"]) and "token=***" in repr(settings.upstreams["openai"])


async def test_waiters_leave_nothing_behind():
    waiters = Waiters(poll_s=0.01)
    await asyncio.gather(*(waiters.wait("k", 0.05) for _ in range(5)))
    assert waiters._events == {} and waiters._waiting == {}


async def test_replays_count_the_tokens_and_cost_they_saved(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, upstreams__openai={"prices": {"m": [2.0, 8.0]}})
    for _ in range(3):  # one recorded call, two replays
        async with http.post(proxy.url + CHAT, json=BODY, headers={"Idempotency-Key": "paid"}) as r:
            assert r.status == 200
    async with http.get(proxy.url + "/metrics") as r:
        text = await r.text()
    # the fake provider reports 10 prompt and 5 completion tokens: 2 x (10*2 + 5*8) / 1e6 USD
    assert 'idemproxy_tokens_saved_total{kind="prompt_tokens",model="m",upstream="openai"} 20.0' in text
    assert 'idemproxy_cost_saved_usd_total{model="m",upstream="openai"} 0.00012' in text


async def test_the_upstream_gets_the_agents_headers_and_no_client_defaults(make_proxy, sqlite_url):
    proxy = await make_proxy(sqlite_url)
    resp = await raw_request(proxy.url, "POST /raw/echo/h HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                             "X-Agent: yes\r\n", b"{}")
    seen = {k.lower() for k in resp.json()["headers"]}
    assert "x-agent" in seen
    assert not seen & {"accept", "accept-encoding", "user-agent", "content-type"}  # none added


async def test_a_stream_too_large_to_record_passes_whole_in_bounded_memory(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, server={"max_record_bytes": 2000})
    body = {**BODY, "stream": True}
    headers = {"Idempotency-Key": "huge", "X-Fake-Chunks": "40", "X-Fake-Chunk-Delay": "0.01"}
    kept = []
    async with http.post(proxy.url + CHAT, json=body, headers=headers) as resp:
        received = b""
        async for chunk in resp.content.iter_any():
            received += chunk
            kept += [sum(map(len, call.chunks)) for call in proxy.proxy.calls.values()]
    assert received.count(b"data: ") == 42 and received.endswith(b"data: [DONE]\n\n")  # whole
    assert len(received) > 3 * 2000 and max(kept) <= 2000 + 400  # never more than a chunk over
    async with http.post(proxy.url + CHAT, json=body, headers={"Idempotency-Key": "huge"}) as again:
        await problem(again, "not-replayable", 409)
