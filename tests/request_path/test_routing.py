"""Routing (docs/guarantees.md): named upstreams only, never an open proxy, headers handled per RFC 9110.

Refusals are sent over a raw socket, because no well-behaved client library sends
absolute-form targets, CONNECT or backslashes; each must be refused by the proxy
itself (problem+json) with nothing reaching the fake provider. An absolute-form target
that names the proxy itself is the one exception (RFC 9112 §3.2.2): it is served as the
origin-form request it stands for.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from yarl import URL

from rawhttp import problem, raw_problem, raw_request


def nothing_forwarded(provider) -> None:
    assert provider.seen == []
    assert sum(provider.calls.values()) == 0


@pytest.fixture
async def echo_proxy(make_proxy, sqlite_url, provider):
    """``raw`` is the provider's root; ``echo`` has a base path below it."""
    return await make_proxy(sqlite_url, upstreams__echo={"url": provider.url + "/echo/base"})


# -- never an open proxy -------------------------------------------------------------------

# How the agent names the proxy: an absolute-form target is taken when its authority is
# the request's Host (routing.origin_form), and routed by its path alone.
PROXY_NAME = "proxy.example:8787"


@pytest.mark.parametrize("request_line", [
    "GET http://example.com/ HTTP/1.1",
    "GET https://example.com:443/v1/chat/completions HTTP/1.1",
    "GET http://{provider}/echo/x HTTP/1.1",  # even a configured upstream's own host
    "POST http://{provider}/v1/chat/completions HTTP/1.1",
    "GET //{provider}/echo/x HTTP/1.1",
    "POST http://example.com/echo/x HTTP/1.1",  # a path the proxy has, at another authority
    "GET http://proxy.example/echo/x HTTP/1.1",  # the proxy's host on another port than Host's
    "GET http://user:pw@proxy.example:8787/echo/x HTTP/1.1",  # userinfo (RFC 9110 §4.2.4)
    "GET http://proxy.example:8787@example.com/echo/x HTTP/1.1",
    "GET ftp://proxy.example:8787/echo/x HTTP/1.1",
    "GET ws://proxy.example:8787/echo/x HTTP/1.1",
    "GET http://example.com/healthz HTTP/1.1",  # not the proxy route: refused all the same
    "GET http://example.com/admin/runs HTTP/1.1",
    "GET http://example.com/runs/r1 HTTP/1.1",
])
async def test_absolute_form_targets_naming_another_authority_are_refused(echo_proxy, provider, request_line):
    line = request_line.format(provider=urlsplit(provider.url).netloc)
    resp = await raw_request(echo_proxy.url, f"{line}\nHost: {PROXY_NAME}\nContent-Length: 2\n"
                             "Idempotency-Key: abs\nAuthorization: Bearer test-admin-token", b"{}")
    raw_problem(resp, "invalid-request", 400)
    nothing_forwarded(provider)


@pytest.mark.parametrize("target, host", [
    ("http://proxy.example:8787/echo/a?q=1", PROXY_NAME),
    ("HTTP://Proxy.Example:8787/echo/a?q=1", PROXY_NAME),  # scheme and host are case-insensitive
    ("https://proxy.example/echo/a?q=1", "proxy.example"),  # behind a TLS-terminating balancer
    ("http://127.0.0.1:8787/echo/a?q=1", "127.0.0.1:8787"),
    ("http://[::1]:8787/echo/a?q=1", "[::1]:8787"),
    ("http://proxy.example:8787/runs/r1/epochs/0/echo/a?q=1", PROXY_NAME),
])
async def test_absolute_form_naming_the_proxy_itself_is_routed_by_its_path(echo_proxy, provider, target, host):
    """RFC 9112 §3.2.2: a server must accept absolute-form; its authority stands for Host."""
    resp = await raw_request(echo_proxy.url, f"GET {target} HTTP/1.1\nHost: {host}")
    assert resp.status == 200, (resp.status, resp.body[:300])
    seen = resp.json()
    assert seen["raw_path"] == "/echo/base/a?q=1"
    assert seen["headers"]["Host"] == urlsplit(provider.url).netloc  # the upstream's, as always
    assert provider.calls["echo"] == 1


async def test_absolute_form_is_recorded_and_replayed_as_its_origin_form(echo_proxy, provider):
    answers = []
    for target in (f"http://{PROXY_NAME}/tools/send", "/tools/send", f"http://{PROXY_NAME}/tools/send"):
        resp = await raw_request(echo_proxy.url, f"POST {target} HTTP/1.1\nHost: {PROXY_NAME}\n"
                                 "Content-Type: application/json\nContent-Length: 2\nIdempotency-Key: abs-1", b"{}")
        assert resp.status == 200, (resp.status, resp.body[:300])
        answers.append((resp.headers["Idempotent-Replayed"], resp.body))
    assert [replayed for replayed, _ in answers] == ["false", "true", "true"]
    assert len({body for _, body in answers}) == 1
    assert provider.calls["tool:send"] == 1


async def test_absolute_form_reaches_the_proxys_own_routes_by_their_path(echo_proxy, provider):
    resp = await raw_request(echo_proxy.url, f"GET http://{PROXY_NAME}/healthz HTTP/1.1\nHost: {PROXY_NAME}")
    assert resp.status == 200 and resp.json() == {"status": "ok"}
    # what a client using us as its forward proxy sends: served as ours, never fetched from there
    resp = await raw_request(echo_proxy.url, "GET http://example.com/ HTTP/1.1\nHost: example.com")
    raw_problem(resp, "unknown-upstream", 404)
    nothing_forwarded(provider)


@pytest.mark.parametrize("target", ["example.com:443", "{provider}"])
async def test_connect_is_refused(echo_proxy, provider, target):
    target = target.format(provider=urlsplit(provider.url).netloc)
    resp = await raw_request(echo_proxy.url, f"CONNECT {target} HTTP/1.1\nHost: {target}")
    assert 400 <= resp.status < 500
    raw_problem(resp, "invalid-request", 400)
    nothing_forwarded(provider)


@pytest.mark.parametrize("path", [
    "/nope/v1/chat/completions",
    "/runs/r1/nope/v1/chat/completions",
    "/runs/r1/epochs/0/nope/v1/chat/completions",
    "/OpenAI/v1/chat/completions",  # names are exact
    "/%6fpenai/v1/chat/completions",  # an encoded name is not the name
])
async def test_unknown_upstreams_are_refused(echo_proxy, provider, path):
    resp = await raw_request(echo_proxy.url, f"POST {path} HTTP/1.1\nHost: x\nContent-Length: 2\n"
                             "Idempotency-Key: k1", b"{}")
    raw_problem(resp, "unknown-upstream", 404)
    nothing_forwarded(provider)


@pytest.mark.parametrize("path", [
    "/echo/..",
    "/echo/../../v1/chat/completions",
    "/echo/a/../../x",
    "/echo/./x",
    "/echo/%2e%2e/x",
    "/echo/%2E%2E/%2e%2e/v1/chat/completions",
    "/echo/.%2e/x",
    "/echo/%2e%2e%2f%2e%2e%2fv1/chat/completions",
    "/echo/%252e%252e/x",  # double-encoded
    "/echo/%25252e%25252e/x",  # triple-encoded
    "/echo/..\\x",  # backslash
    "/echo/a\\..\\..\\x",
    "/echo/%5c..%5cx",  # encoded backslash
    "/echo/..%5c..%5cv1/chat/completions",
    "/echo/%255c..%255cx",
    "/runs/r1/echo/../x",
    "/runs/r1/epochs/0/echo/%2e%2e/x",
    "/runs/../echo/x",
])
async def test_dot_dot_escapes_are_refused(echo_proxy, provider, path):
    for method in ("GET", "POST"):  # passthrough and record alike
        resp = await raw_request(echo_proxy.url, f"{method} {path} HTTP/1.1\nHost: x\nContent-Length: 2\n"
                                 "Content-Type: application/json\nIdempotency-Key: esc", b"{}")
        raw_problem(resp, "invalid-request", 400)
    nothing_forwarded(provider)


# -- what is forwarded ---------------------------------------------------------------------

@pytest.mark.parametrize("path, reached", [
    ("/echo/a/b?x=1&y=%20z&x=2", "/echo/base/a/b?x=1&y=%20z&x=2"),
    ("/echo/a/b%20c", "/echo/base/a/b%20c"),
    ("/echo/deep/er/path?", "/echo/base/deep/er/path"),
    ("/echo?q=1", "/echo/base/?q=1"),
    ("/runs/r1/echo/a?q=1", "/echo/base/a?q=1"),
    ("/runs/r1/epochs/1/echo/a?q=1&r=%2F", "/echo/base/a?q=1&r=%2F"),
    ("/echo/s%7E?sig=a%2Fb%3Fc%3D&odd=%zz&t=%7E", "/echo/base/s%7E?sig=a%2Fb%3Fc%3D&odd=%zz&t=%7E"),
    ("/raw/echo/p?q=v", "/echo/p?q=v"),
    ("/slash/a?z=9", "/echo/base/a?z=9"),  # a trailing slash on the upstream URL
])
async def test_base_path_and_query_are_kept(make_proxy, sqlite_url, provider, http, path, reached):
    proxy = await make_proxy(sqlite_url, upstreams__echo={"url": provider.url + "/echo/base"},
                             upstreams__slash={"url": provider.url + "/echo/base/"})
    async with http.get(URL(proxy.url + path, encoded=True)) as resp:  # sent exactly as written
        assert resp.status == 200
        seen = await resp.json()
    assert seen["raw_path"] == reached
    assert provider.calls["echo"] == 1


async def test_hop_by_hop_and_idem_headers_are_not_forwarded(make_proxy, sqlite_url, provider):
    proxy = await make_proxy(sqlite_url, upstreams__echo={"url": provider.url + "/echo/base"},
                             tenants={"trusted_sources": ["127.0.0.1/32"]})
    resp = await raw_request(proxy.url, "\n".join([
        "GET /echo/h HTTP/1.1",
        "Host: agent.example:1234",
        "Connection: keep-alive, X-Hop-Secret",
        "X-Hop-Secret: must-not-pass",
        "Keep-Alive: timeout=5, max=100",
        "TE: trailers",
        "Trailer: X-Checksum",
        "Proxy-Authorization: Basic cHJveHk6c2VjcmV0",
        "Proxy-Connection: keep-alive",
        "Idem-Run: r-hop",
        "Idem-Epoch: 0",
        "Idem-Policy: passthrough",
        "Idem-Replay: paced",
        "Idem-Tenant: acme",
        "Authorization: Bearer sk-agent",
        "X-Custom: kept",
    ]))
    assert resp.status == 200, resp.body
    seen = {k.lower(): v for k, v in resp.json()["headers"].items()}
    for name in ("connection", "x-hop-secret", "keep-alive", "te", "trailer", "proxy-authorization",
                 "proxy-connection", "idem-run", "idem-epoch", "idem-policy", "idem-replay", "idem-tenant"):
        assert name not in seen, (name, seen)
    assert seen["host"] == urlsplit(provider.url).netloc  # Host is the upstream's
    assert seen["authorization"] == "Bearer sk-agent"  # the agent's credential passes as it is
    assert seen["x-custom"] == "kept"


async def test_configured_set_headers_are_injected(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url, upstreams__echo={
        "url": provider.url + "/echo/base",
        "set_headers": {"Authorization": "Bearer sk-injected", "X-Org": "org-7"}})
    async with http.get(proxy.url + "/echo/x", headers={"Authorization": "Bearer sk-agent"}) as resp:
        seen = (await resp.json())["headers"]
    assert seen["Authorization"] == "Bearer sk-injected"
    assert seen["X-Org"] == "org-7"
    assert "sk-injected" not in repr(proxy.settings)


async def test_upstream_connections_are_pooled_and_kept_alive(make_proxy, sqlite_url, http):
    peers: list[tuple] = []

    async def where_from(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        return web.json_response({"n": len(peers)})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", where_from)
    upstream = TestServer(app, host="127.0.0.1")
    await upstream.start_server()
    try:
        proxy = await make_proxy(sqlite_url, upstreams__pool={"url": str(upstream.make_url("/base"))})
        for i in range(5):
            async with http.post(proxy.url + "/pool/x", json={"i": i},
                                 headers={"Idempotency-Key": f"pool-{i}"} if i % 2 else {}) as resp:
                assert resp.status == 200
        assert len(peers) == 5
        assert len(set(peers)) == 1, peers  # one upstream connection, reused
    finally:
        await upstream.close()


async def test_upstream_read_timeout_is_configurable(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url, upstreams__slow={"url": provider.url + "/tools",
                                                          "read_timeout": "0.3s"})
    async with http.get(proxy.url + "/slow/wait", headers={"X-Fake-Delay": "1"}) as resp:
        await problem(resp, "upstream-timeout", 504)
    assert provider.calls["tool:wait"] == 1


async def test_unreachable_upstream_is_a_problem(make_proxy, sqlite_url, http):
    import services

    proxy = await make_proxy(sqlite_url, upstreams__gone={"url": f"http://127.0.0.1:{services.free_port()}",
                                                          "connect_timeout": "1s"})
    async with http.get(proxy.url + "/gone/x") as resp:
        await problem(resp, "upstream-unavailable", 502)


async def test_problem_body_is_json_with_instance(echo_proxy, http):
    async with http.get(echo_proxy.url + "/nope/x") as resp:
        body = await problem(resp, "unknown-upstream", 404)
    assert body["instance"] == "/nope/x"


async def test_every_answer_carries_server_timing(echo_proxy, provider, http):
    body = {"model": "m", "messages": [{"role": "user", "content": "t"}]}
    chat = echo_proxy.url + "/openai/v1/chat/completions"
    answers = []
    first = asyncio.create_task(http.post(chat, json=body, headers={"Idempotency-Key": "st", "X-Fake-Delay": "0.3"}))
    while provider.calls["chat"] < 1:
        await asyncio.sleep(0.01)
    async with http.post(chat, json=body, headers={"Idempotency-Key": "st"}) as joined:
        answers.append(("joined", joined.status, joined.headers.get("Server-Timing")))
    async with await first as recorded:
        answers.append(("recorded", recorded.status, recorded.headers.get("Server-Timing")))
    async with http.post(chat, json=body, headers={"Idempotency-Key": "st"}) as replayed:
        answers.append(("replayed", replayed.status, replayed.headers.get("Server-Timing")))
    async with http.get(echo_proxy.url + "/echo/x") as passed:
        answers.append(("passthrough", passed.status, passed.headers.get("Server-Timing")))
    async with http.get(echo_proxy.url + "/nope/x") as refused:
        answers.append(("refused", refused.status, refused.headers.get("Server-Timing")))
    connect = await raw_request(echo_proxy.url, "CONNECT example.com:443 HTTP/1.1\nHost: example.com:443")
    answers.append(("connect", connect.status, connect.headers.get("Server-Timing")))
    for what, status, timing in answers:
        assert timing and timing.startswith("idemproxy;dur="), (what, status, timing)


async def test_a_recorded_answer_times_its_body_as_the_upstreams(echo_proxy, provider, http):
    """The head of a whole answer came at once, its body a second later: the proxy's own time
    is what it spent up to the head (a listener is woken only at the end: calls.Call._begin)."""
    headers = {"Idempotency-Key": "slow-body", "X-Fake-Size": str(2 * 65536), "X-Fake-Chunk-Delay": "1"}
    started = time.perf_counter()
    async with http.post(echo_proxy.url + "/raw/flood", headers=headers) as resp:
        assert resp.status == 200 and len(await resp.read()) == 2 * 65536
        timing = resp.headers["Server-Timing"]
    assert time.perf_counter() - started >= 1.0
    own = float(timing.split("idemproxy;dur=")[1].split(",")[0])
    assert own < 500, timing  # milliseconds; 1,000+ when the body's second was counted as ours
