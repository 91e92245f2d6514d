"""The upstream boundary (docs/guarantees.md), through the whole proxy on every store: a
scripted upstream sends what a broken or malicious server sends (an answer to a GET's body, a
second answer, a close after acting, an endless head, a trickle, a reset), and each rule is
checked for passthrough, record and replay. Each of these failed on the proxy before the
upstream boundary was hardened."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest

from rawhttp import problem
from scripted_upstream import ScriptedUpstream, answer, says

ATTACKER = {"Authorization": "Bearer sk-attacker"}
VICTIM = {"Authorization": "Bearer sk-victim"}


@pytest.fixture
async def scripted():
    started = []

    async def start(scripts, **options) -> tuple[ScriptedUpstream, dict]:
        upstream = ScriptedUpstream(scripts, **options)
        url = await upstream.start()
        started.append(upstream)
        return upstream, {"url": url, "kind": "tool", "on_ambiguous": "quarantine"}
    yield start
    for upstream in started:
        await upstream.close()


async def answers_twice(request, writer):
    """A broken or malicious upstream: its answer, then another 80 ms later that nobody asked for."""
    writer.write(answer("yours"))
    await writer.drain()
    await asyncio.sleep(0.08)
    writer.write(answer("STRAY"))


async def call(http, method, url, headers=None, data=b"{}"):
    async with http.request(method, url, headers=headers or {}, data=data) as r:
        return r.status, await r.read(), r.headers.get("Idempotent-Replayed")


async def test_an_answer_to_a_get_body_never_reaches_another_call(make_proxy, store_url, http, scripted):
    """CL.0: this upstream ignores a GET's body and answers it as a request of its own (slowly,
    as an attacker would pick). The victim's recorded call must get, record and replay its
    own answer — and so must the attacker's own next call."""
    async def slow_steal(request, writer):
        await asyncio.sleep(0.15)
        writer.write(answer("SMUGGLED"))
    upstream, evil = await scripted({"search": says("results"), "steal": slow_steal, "pay": says("paid")},
                                    ignore_body_on=frozenset({"GET"}))
    proxy = await make_proxy(store_url, upstreams__evil=evil)
    smuggled = b"POST /steal HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    assert await call(http, "GET", proxy.url + "/evil/search", ATTACKER, smuggled) == (200, b"results", None)
    for who in (VICTIM, ATTACKER):
        headers = {**who, "Idempotency-Key": "pay-1"}
        assert await call(http, "POST", proxy.url + "/evil/pay", headers) == (200, b"paid", "false")
        assert await call(http, "POST", proxy.url + "/evil/pay", headers) == (200, b"paid", "true")
    assert upstream.executed("pay") == 2


@pytest.mark.parametrize("max_connections", [1, 256])
async def test_a_late_second_answer_never_reaches_another_tenant(make_proxy, store_url, http, scripted,
                                                                 max_connections):
    upstream, evil = await scripted({"double": answers_twice, "pay": says("paid")})
    proxy = await make_proxy(store_url, upstreams__evil={**evil, "max_connections": max_connections})
    first = {**ATTACKER, "Idempotency-Key": "double-1"}
    assert await call(http, "POST", proxy.url + "/evil/double", first) == (200, b"yours", "false")
    victim = {**VICTIM, "Idempotency-Key": "pay-1"}
    assert await call(http, "POST", proxy.url + "/evil/pay", victim) == (200, b"paid", "false")
    await asyncio.sleep(0.15)
    assert await call(http, "POST", proxy.url + "/evil/pay", victim) == (200, b"paid", "true")
    assert await call(http, "POST", proxy.url + "/evil/double", first) == (200, b"yours", "true")


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
async def test_a_recorded_call_the_upstream_acted_on_is_never_sent_again(make_proxy, store_url, http,
                                                                         scripted, method):
    """The upstream acts, then closes the (reused) connection without answering: one
    execution, the outcome unknown and quarantined — not a second execution and a clean 200."""
    upstream = None

    async def act_then_close(request, writer):
        if upstream.executed("charge") == 1:
            writer.close()
        else:
            writer.write(answer("charged"))
    upstream, evil = await scripted({"warm": says("ok"), "charge": act_then_close})
    proxy = await make_proxy(store_url, upstreams__evil=evil)
    assert (await call(http, method, proxy.url + "/evil/warm", {**VICTIM, "Idempotency-Key": "w"}))[0] == 200
    headers = {**VICTIM, "Idempotency-Key": "charge-1"}
    async with http.request(method, proxy.url + "/evil/charge", headers=headers, data=b"{}") as r:
        await problem(r, "upstream-unavailable", 502)
    async with http.request(method, proxy.url + "/evil/charge", headers=headers, data=b"{}") as r:
        await problem(r, "outcome-unknown", 502)
    assert upstream.executed("charge") == 1


@pytest.mark.parametrize("policy", ["record", "passthrough"])
async def test_an_endless_head_is_cut_off_with_502(make_proxy, store_url, http, scripted, policy):
    async def endless(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: ")
        for _ in range(3200):  # 200 MiB if it were all read
            writer.write(b"a" * 65536)
            await writer.drain()

    async def crowded(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"X-F: v\r\n" * 200_000 + b"Content-Length: 0\r\n\r\n")
    upstream, evil = await scripted({"big": endless, "many": crowded})
    proxy = await make_proxy(store_url, upstreams__evil=evil)
    for name, why in (("big", "over 65536 bytes"), ("many", "over 256 fields")):
        headers = {**VICTIM, "Idem-Policy": policy, "Idempotency-Key": name}
        started = time.monotonic()
        async with http.post(proxy.url + f"/evil/{name}", headers=headers, data=b"{}") as r:
            assert why in (await problem(r, "upstream-unavailable", 502))["detail"]
        assert time.monotonic() - started < 3


async def test_a_request_crossing_a_tool_servers_idle_close_goes_on_a_new_connection(make_proxy, store_url,
                                                                                      http, scripted):
    """gunicorn closes a connection idle for 2 s, whatever crosses that close. A connection
    idle longer than a tool's keepalive_timeout (1.5 s by default) is not used again."""
    upstream, evil = await scripted({"step": says("done")}, idle_close_s=1.7)
    proxy = await make_proxy(store_url, upstreams__evil=evil)
    for n in range(2):
        headers = {**VICTIM, "Idempotency-Key": f"step-{n}"}
        assert await call(http, "POST", proxy.url + "/evil/step", headers) == (200, b"done", "false")
        await asyncio.sleep(1.8 if n == 0 else 0)
    assert upstream.connections == 2 and upstream.executed("step") == 2


async def test_a_servers_keep_alive_timeout_is_honoured(make_proxy, store_url, http, scripted):
    """Node says ``Keep-Alive: timeout=5`` and closes at 5 s: trusted for a second less."""
    async def hinted(request, writer):
        writer.write(answer("done", extra=b"Keep-Alive: timeout=2\r\n"))
    upstream, evil = await scripted({"step": hinted}, idle_close_s=1.2)
    proxy = await make_proxy(store_url, upstreams__evil={**evil, "keepalive_timeout": 30})
    for n, pause in enumerate((0.3, 1.4, 0)):
        headers = {**VICTIM, "Idempotency-Key": f"step-{n}"}
        assert await call(http, "POST", proxy.url + "/evil/step", headers) == (200, b"done", "false")
        await asyncio.sleep(pause)
    assert upstream.connections == 2  # the first two shared one; the third found it expired


async def test_a_trickled_answer_is_recorded_and_replayed_whole(make_proxy, store_url, http, scripted):
    text = answer("a trickled answer, one byte at a time")

    async def trickle(request, writer):
        for i in range(len(text)):
            writer.write(text[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0.002)
    upstream, evil = await scripted({"slow": trickle})
    proxy = await make_proxy(store_url, upstreams__evil=evil)
    headers = {**VICTIM, "Idempotency-Key": "slow-1"}
    for replayed in ("false", "true"):
        assert await call(http, "POST", proxy.url + "/evil/slow", headers) == (
            200, b"a trickled answer, one byte at a time", replayed)
    assert upstream.executed("slow") == 1


async def test_a_reset_mid_answer_is_an_unknown_outcome_never_a_record(make_proxy, store_url, http, scripted):
    async def reset(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf of it")
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    upstream, evil = await scripted({"cut": reset})
    proxy = await make_proxy(store_url, upstreams__evil=evil)
    headers = {**VICTIM, "Idempotency-Key": "cut-1"}
    async with http.post(proxy.url + "/evil/cut", headers=headers, data=b"{}") as r:
        await problem(r, "upstream-unavailable", 502)  # a whole answer is held until its end
    async with http.post(proxy.url + "/evil/cut", headers=headers, data=b"{}") as r:
        await problem(r, "outcome-unknown", 502)
    assert upstream.executed("cut") == 1


async def test_passthrough_callers_outside_runs_keep_their_own_connections(make_proxy, store_url, http,
                                                                           scripted):
    """No run, no namespace: the credential itself keys the connections (HMAC-free)."""
    upstream, evil = await scripted({"double": answers_twice, "pay": says("paid")})
    proxy = await make_proxy(store_url, upstreams__evil=evil)
    passthrough = {"Idem-Policy": "passthrough"}
    assert await call(http, "POST", proxy.url + "/evil/double", {**ATTACKER, **passthrough}) == (200, b"yours", None)
    for _ in range(2):
        assert await call(http, "POST", proxy.url + "/evil/pay", {**VICTIM, **passthrough}) == (200, b"paid", None)
    assert upstream.connections == 2
