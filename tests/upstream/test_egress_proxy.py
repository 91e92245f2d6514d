"""Upstreams behind a real egress proxy (docs/guarantees.md#reaching-real-networks):
idemproxy in front, Debian's squid in the middle (tests/support/squid.py), a real upstream
behind it. Each upstream is named ``upstream.test``, a name only squid can resolve: a call
that reaches it went through squid."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

import fake_provider
from conftest import proxy_sections, until
from private_ca import PrivateCA
from rawhttp import problem
from squid import Squid

NAME = "upstream.test"
DIRECT = "direct.test"
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch):
    """Each test sets the proxy variables it means; none leak in from the machine."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


@pytest.fixture
def squid():
    started: list[Squid] = []

    def start(**kwargs) -> Squid:
        started.append(Squid(hosts={NAME: "127.0.0.1"}, **kwargs).start())
        return started[-1]

    yield start
    for proxy in started:
        proxy.stop()


@pytest.fixture
async def tls_upstream(tmp_path):
    """The fake provider over TLS with a certificate for ``upstream.test`` from a private CA:
    ``(url, app, ca)``."""
    ca = PrivateCA(tmp_path)
    app = fake_provider.create_app()
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ca.server_context(NAME))
    await site.start()
    port = runner.addresses[0][1]
    yield f"https://{NAME}:{port}", app, ca
    await runner.cleanup()


@pytest.fixture
async def direct_name(monkeypatch):
    """``direct.test``: a name only idemproxy resolves (to the loopback), never squid. Only
    the resolver's answer is made up; the connection is real. (Loopback itself never takes
    the environment's proxy, so the tests that must see one bypassed use this name.)"""
    loop = asyncio.get_running_loop()
    resolve = loop.getaddrinfo

    async def getaddrinfo(host, port, *args, **kwargs):
        return await resolve("127.0.0.1" if host == DIRECT else host, port, *args, **kwargs)
    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    return DIRECT


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


async def closed_and_logged(proxy, egress: Squid, lines: int) -> list[str]:
    """Squid logs a tunnel when it closes: close the proxy (its pools, its kept-alive
    tunnels), then read squid's log once it holds ``lines`` lines."""
    await proxy.server.close()

    async def logged():
        log = egress.access_log()
        return log if len(log) >= lines else None
    return await until(logged, 5.0, f"{lines} lines in squid's access log")


async def test_an_http_upstream_is_reached_through_http_proxy_in_absolute_form(
        monkeypatch, squid, provider, make_proxy, sqlite_url, http):
    egress = squid()
    monkeypatch.setenv("HTTP_PROXY", egress.url)
    upstream = f"http://{NAME}:{port_of(provider.url)}"
    proxy = await make_proxy(sqlite_url, upstreams__tools={"url": upstream + "/tools"})
    for replayed in ("false", "true"):
        async with http.post(proxy.url + "/tools/send", json={"to": "x"}, headers={"Idempotency-Key": "k1"}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Idempotent-Replayed"] == replayed
    assert provider.calls["tool:send"] == 1
    # squid forwards only absolute-form targets; it logs the URL it was given
    assert egress.access_log() == [f"POST {upstream}/tools/send - 200"]
    assert provider.seen[0]["headers"]["Host"] == f"{NAME}:{port_of(provider.url)}"


async def test_an_https_upstream_behind_a_private_ca_is_reached_through_connect(
        monkeypatch, squid, tls_upstream, make_proxy, sqlite_url, http):
    url, app, ca = tls_upstream
    egress = squid()
    monkeypatch.setenv("HTTPS_PROXY", egress.url)
    proxy = await make_proxy(sqlite_url, upstreams__tools={"url": url + "/tools", "ca_file": str(ca.cert_file)},
                             upstreams__untrusted={"url": url + "/tools", "kind": "tool"})
    async with http.post(proxy.url + "/tools/send", json={"to": "x"}, headers={"Idempotency-Key": "k1"}) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["ok"] is True
    # TLS inside the tunnel, checked against upstream.test: without our CA it is refused
    async with http.post(proxy.url + "/untrusted/send", json={}, headers={"Idempotency-Key": "k2"}) as r:
        assert "nothing was sent" in (await problem(r, "upstream-unavailable", 502))["detail"]
    assert app[fake_provider.CALLS]["tool:send"] == 1
    assert await closed_and_logged(proxy, egress, 2) == [f"CONNECT {NAME}:{port_of(url)} - 200"] * 2


async def test_the_proxy_urls_credentials_are_sent_as_proxy_authorization(
        squid, provider, tls_upstream, make_proxy, sqlite_url, http, caplog):
    caplog.set_level(logging.INFO, "idemproxy")
    url, app, ca = tls_upstream
    egress = squid(users={"alice": "s3cret"})
    via = egress.url_as("alice", "s3cret")
    plain = f"http://{NAME}:{port_of(provider.url)}"
    proxy = await make_proxy(sqlite_url, upstreams__tools={"url": plain + "/tools", "proxy": via},
                             upstreams__secure={"url": url + "/tools", "kind": "tool", "proxy": via,
                                                "ca_file": str(ca.cert_file)})
    for name in ("tools", "secure"):
        for key in ("k1", "k2"):  # the second on a kept-alive connection: credentials on each request
            async with http.post(f"{proxy.url}/{name}/send", json={}, headers={"Idempotency-Key": key}) as r:
                assert r.status == 200, await r.text()
    assert provider.calls["tool:send"] == 2 and app[fake_provider.CALLS]["tool:send"] == 2
    log = await closed_and_logged(proxy, egress, 3)
    assert log.count(f"POST {plain}/tools/send alice 200") == 2
    assert f"CONNECT {NAME}:{port_of(url)} alice 200" in log
    assert all(" alice " in line for line in log), log  # squid let nothing through unauthenticated
    assert "Proxy-Authorization" not in provider.seen[0]["headers"]  # for squid's eyes only
    # the log says which proxy each upstream takes, never with its credentials
    assert f"upstream secure goes through the egress proxy ProxyURL('http://***@127.0.0.1:{egress.port}')" \
        in caplog.text
    assert "s3cret" not in caplog.text and "alice" not in caplog.text


async def test_a_proxy_refusing_connect_is_a_502_and_the_key_stays_free(
        squid, tls_upstream, make_proxy, sqlite_url, http, caplog):
    caplog.set_level(logging.DEBUG, "idemproxy")
    url, app, ca = tls_upstream
    egress = squid(users={"alice": "s3cret"})
    tools = {"url": url + "/tools", "ca_file": str(ca.cert_file)}
    refused = await make_proxy(sqlite_url, upstreams__tools={**tools, "proxy": egress.url_as("alice", "wrong")})
    async with http.post(refused.url + "/tools/send", json={}, headers={"Idempotency-Key": "k1"}) as r:
        body = await problem(r, "upstream-unavailable", 502)
        assert "nothing was sent, the key is free" in body["detail"]
        assert "wrong" not in body["detail"]
    assert app[fake_provider.CALLS]["tool:send"] == 0
    assert egress.access_log() == [f"CONNECT {NAME}:{port_of(url)} alice 407"]
    # a tool's ambiguous outcome would be quarantined: the same key, through a proxy that may
    # pass, is a first call
    allowed = await make_proxy(sqlite_url, upstreams__tools={**tools, "proxy": egress.url_as("alice", "s3cret")})
    async with http.post(allowed.url + "/tools/send", json={}, headers={"Idempotency-Key": "k1"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"
    assert app[fake_provider.CALLS]["tool:send"] == 1
    assert "wrong" not in caplog.text and "s3cret" not in caplog.text


async def test_a_forward_proxy_refusing_an_http_call_is_a_502_and_the_key_stays_free(
        squid, provider, make_proxy, sqlite_url, http):
    """Its 407 is the proxy's, not the upstream's: never recorded, the key released."""
    egress = squid(users={"alice": "s3cret"})
    plain = f"http://{NAME}:{port_of(provider.url)}/tools"
    refused = await make_proxy(sqlite_url, upstreams__tools={"url": plain, "proxy": egress.url_as("alice", "no")})
    async with http.post(refused.url + "/tools/send", json={}, headers={"Idempotency-Key": "k1"}) as r:
        assert "nothing was sent, the key is free" in (await problem(r, "upstream-unavailable", 502))["detail"]
    allowed = await make_proxy(sqlite_url, upstreams__tools={"url": plain, "proxy": egress.url_as("alice", "s3cret")})
    async with http.post(allowed.url + "/tools/send", json={}, headers={"Idempotency-Key": "k1"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"
    assert provider.calls["tool:send"] == 1


async def test_no_proxy_sends_a_host_direct(monkeypatch, squid, direct_name, provider, make_proxy, sqlite_url,
                                           http):
    egress = squid()
    # the lowercase forms, as curl and urllib read them; they win over the uppercase ones
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens: used, it would fail
    monkeypatch.setenv("http_proxy", egress.url)
    monkeypatch.setenv("no_proxy", f"localhost,{DIRECT}")
    port = port_of(provider.url)
    proxy = await make_proxy(sqlite_url, upstreams__tools={"url": f"http://{NAME}:{port}/tools"},
                             upstreams__local={"url": f"http://{DIRECT}:{port}/tools", "kind": "tool"})
    for name in ("tools", "local"):
        async with http.post(f"{proxy.url}/{name}/send", json={}, headers={"Idempotency-Key": name}) as r:
            assert r.status == 200, await r.text()
    assert provider.calls["tool:send"] == 2
    assert egress.access_log() == [f"POST http://{NAME}:{port}/tools/send - 200"]  # local went direct


async def test_an_empty_proxy_option_goes_direct_whatever_the_environment(
        monkeypatch, squid, direct_name, provider, make_proxy, sqlite_url, http):
    egress = squid()
    monkeypatch.setenv("HTTP_PROXY", egress.url)
    port = port_of(provider.url)
    proxy = await make_proxy(sqlite_url, upstreams__tools={"url": f"http://{NAME}:{port}/tools"},
                             upstreams__local={"url": f"http://{DIRECT}:{port}/tools", "kind": "tool",
                                               "proxy": ""})
    for name in ("tools", "local"):
        async with http.post(f"{proxy.url}/{name}/send", json={}, headers={"Idempotency-Key": name}) as r:
            assert r.status == 200, await r.text()
    assert provider.calls["tool:send"] == 2
    assert egress.access_log() == [f"POST http://{NAME}:{port}/tools/send - 200"]


async def test_a_loopback_upstream_never_takes_the_environments_proxy(monkeypatch, squid, provider, make_proxy,
                                                                      sqlite_url, http):
    egress = squid()
    monkeypatch.setenv("HTTP_PROXY", egress.url)
    port = port_of(provider.url)
    proxy = await make_proxy(sqlite_url, upstreams__tools={"url": f"http://{NAME}:{port}/tools"},
                             upstreams__local={"url": f"http://127.0.0.1:{port}/tools", "kind": "tool"},
                             upstreams__forced={"url": f"http://127.0.0.1:{port}/tools", "kind": "tool",
                                                "proxy": egress.url})
    for name in ("tools", "local", "forced"):
        async with http.post(f"{proxy.url}/{name}/send", json={}, headers={"Idempotency-Key": name}) as r:
            assert r.status == 200, await r.text()
    assert provider.calls["tool:send"] == 3
    # an explicit proxy is taken even for the loopback: the operator said so
    assert egress.access_log() == [f"POST http://{NAME}:{port}/tools/send - 200",
                                   f"POST http://127.0.0.1:{port}/tools/send - 200"]


@pytest.mark.slow  # a subprocess proxy
async def test_idemproxy_serve_reads_the_environment_and_tunnels_on_its_own_loop(
        squid, tls_upstream, proxy_process, provider, sqlite_url, http):
    """`idemproxy serve` as deployed: its own process, on uvloop where installed (whose
    create_connection has no happy_eyeballs_delay), HTTPS_PROXY from its environment."""
    url, app, ca = tls_upstream
    egress = squid()
    sections = proxy_sections(provider.url, sqlite_url,
                              upstreams__tools={"url": url + "/tools", "ca_file": str(ca.cert_file)})
    server = await asyncio.to_thread(proxy_process, sections, env={"HTTPS_PROXY": egress.url})
    async with http.post(server.url + "/tools/send", json={}, headers={"Idempotency-Key": "k1"}) as r:
        assert r.status == 200, await r.text()
    assert app[fake_provider.CALLS]["tool:send"] == 1
    await asyncio.to_thread(server.stop)

    async def logged():
        return egress.access_log()
    assert await until(logged, 5.0, "the tunnel in squid's log") == [f"CONNECT {NAME}:{port_of(url)} - 200"]
