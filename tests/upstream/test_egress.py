"""Reaching upstreams as real networks require (proxy/upstream/egress.py;
docs/guarantees.md#reaching-real-networks): which egress proxy the environment names, happy
eyeballs between a name's addresses, and TLS per upstream (a private CA, mTLS). The egress
proxy itself is in test_egress_proxy.py."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time

import pytest
from aiohttp import web

import fake_provider
import services
from config_files import write_config
from private_ca import PrivateCA
from rawhttp import problem

from idemproxy.proxy.config import ConfigError, load_settings
from idemproxy.proxy.config_view import effective
from idemproxy.proxy.upstream.egress import Egress, ProxyURL, choose_proxy

CORP = "http://proxy.corp:3128"


@pytest.mark.parametrize("url, env, expected", [
    ("https://api.openai.com", {"HTTPS_PROXY": CORP}, CORP),
    ("https://api.openai.com", {"HTTP_PROXY": CORP}, None),  # http's proxy is not https's
    ("http://tools:9000", {"HTTP_PROXY": CORP}, CORP),
    ("http://tools:9000", {"HTTP_PROXY": "http://upper:1", "http_proxy": CORP}, CORP),  # lowercase wins
    ("http://tools:9000", {"HTTP_PROXY": CORP, "http_proxy": ""}, None),  # an empty lowercase one unsets
    ("http://tools:9000", {"HTTP_PROXY": "proxy.corp:3128"}, CORP),  # no scheme: http, as curl takes it
    ("https://api.openai.com", {"HTTPS_PROXY": CORP, "NO_PROXY": "*"}, None),
    ("https://api.openai.com", {"HTTPS_PROXY": CORP, "no_proxy": "localhost,openai.com"}, None),  # a suffix
    ("https://api.openai.com", {"HTTPS_PROXY": CORP, "NO_PROXY": ".openai.com"}, None),
    ("https://api.openai.com", {"HTTPS_PROXY": CORP, "NO_PROXY": "penai.com"}, CORP),  # not a label
    ("https://api.openai.com", {"HTTPS_PROXY": CORP, "NO_PROXY": "api.openai.com:443"}, None),
    ("https://api.openai.com", {"HTTPS_PROXY": CORP, "NO_PROXY": "api.openai.com:8443"}, CORP),
    ("http://10.1.2.3:9000", {"HTTP_PROXY": CORP, "NO_PROXY": "10.0.0.0/8"}, None),  # a network, as curl
    ("http://[fd00::5]:9000", {"HTTP_PROXY": CORP, "NO_PROXY": "fd00::/8"}, None),
    ("http://11.1.2.3:9000", {"HTTP_PROXY": CORP, "NO_PROXY": "10.0.0.0/8"}, CORP),
    # loopback never takes the environment's proxy (Go's rule): the proxy's loopback is not ours
    ("http://127.0.0.1:9000", {"HTTP_PROXY": CORP}, None),
    ("http://localhost:9000", {"HTTP_PROXY": CORP}, None),
    ("https://[::1]:9443", {"HTTPS_PROXY": CORP}, None),
])
def test_the_environment_names_the_proxy_as_curl_and_httpx_read_it(url, env, expected):
    chosen = choose_proxy(url, "env", env)
    assert (chosen and f"http://{chosen.host}:{chosen.port}") == expected


def test_the_upstreams_proxy_option_overrides_the_environment():
    env = {"HTTPS_PROXY": CORP, "NO_PROXY": "openai.com"}
    assert choose_proxy("https://api.openai.com", "", env) is None  # "" goes direct
    chosen = choose_proxy("https://api.openai.com", "http://other:8080", env)  # NO_PROXY is the env's
    assert (chosen.host, chosen.port) == ("other", 8080)
    assert choose_proxy("http://127.0.0.1:9000", "http://other:8080", env) is not None  # loopback too


def test_an_unusable_proxy_is_refused_not_bypassed():
    with pytest.raises(ValueError, match="HTTPS_PROXY: .*http://"):
        choose_proxy("https://api.openai.com", "env", {"HTTPS_PROXY": "socks5://proxy.corp:1080"})


def test_proxy_credentials_become_proxy_authorization_and_are_never_shown(tmp_path):
    proxy = ProxyURL("http://alice:p%40ss@proxy.corp:3128")
    assert proxy.authorization == "Basic YWxpY2U6cEBzcw=="  # alice:p@ss
    forward = Egress("http://tools:9000/base", proxy=proxy)
    assert forward.target_prefix == "http://tools:9000"  # absolute-form
    assert forward.header_lines == ("Proxy-Authorization: Basic YWxpY2U6cEBzcw==",)
    tunnel = Egress("https://api.openai.com", proxy=proxy)
    assert tunnel.target_prefix == "" and tunnel.header_lines == ()  # those go in CONNECT only
    for shown in (repr(proxy), repr(forward), repr(tunnel)):
        assert "p%40ss" not in shown and "alice" not in shown and "proxy.corp:3128" in shown
    config = write_config(tmp_path / "c.toml", {"upstreams.tools": {"url": "http://tools:9000",
                                                                    "proxy": "http://alice:pw@proxy.corp:3128"}})
    settings = load_settings(config, env={})
    assert settings.upstreams["tools"].proxy == "http://alice:pw@proxy.corp:3128"
    assert effective(settings)["upstreams"]["tools"]["proxy"] == "http://alice:***@proxy.corp:3128"


@pytest.mark.parametrize("options, refusal", [
    ({"proxy": "https://proxy.corp:3128"}, "upstreams.tools.proxy: .*http://"),
    ({"proxy": "socks5://proxy.corp:1080"}, "upstreams.tools.proxy"),
    ({"url": "http://tools:9000", "ca_file": "ca.pem"}, "ca_file need an https url"),
    ({"client_key": "client.key"}, "client_key needs client_cert"),
    ({"ca_file": "missing.pem"}, "cannot load ca_file"),
    ({"client_cert": "server.crt", "client_key": "other.key"}, "cannot load client_cert, client_key"),
])
def test_egress_options_are_checked_when_the_configuration_loads(tmp_path, options, refusal):
    ca = PrivateCA(tmp_path)
    issued, other = ca.issue("tools"), ca.issue("other")
    issued.cert.rename(tmp_path / "server.crt")
    other.key.rename(tmp_path / "other.key")
    (tmp_path / "ca.pem").write_bytes(ca.cert_file.read_bytes())
    files = {k: str(tmp_path / v) if k in ("ca_file", "client_cert", "client_key") else v for k, v in options.items()}
    config = write_config(tmp_path / "c.toml", {"upstreams.tools": {"url": "https://tools:9443", **files}})
    with pytest.raises(ConfigError, match=refusal):
        load_settings(config, env={})


# -- happy eyeballs -------------------------------------------------------------------------

@pytest.fixture
async def two_addresses(monkeypatch):
    """``twoaddr.test`` resolves to two addresses: 127.0.0.2 first, a listening socket whose
    backlog is full (Linux drops the SYNs: a blackhole), then 127.0.0.1, the fake provider.
    Only the resolver's answer is made up; both connections are real."""
    app = fake_provider.create_app()
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    blackhole = services.Blackhole("127.0.0.2", port)
    loop = asyncio.get_running_loop()
    resolve = loop.getaddrinfo

    async def getaddrinfo(host, port, *args, **kwargs):
        if host != "twoaddr.test":
            return await resolve(host, port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))
                for address in ("127.0.0.2", "127.0.0.1")]
    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    yield f"http://twoaddr.test:{port}", app
    blackhole.close()
    await runner.cleanup()


async def test_a_blackholed_first_address_costs_a_quarter_second_not_connect_timeout(
        two_addresses, make_proxy, sqlite_url, http):
    url, app = two_addresses
    with pytest.raises(TimeoutError):  # the premise: the first address answers nothing
        await asyncio.wait_for(asyncio.open_connection("127.0.0.2", int(url.rsplit(":", 1)[1])), 0.5)
    proxy = await make_proxy(sqlite_url, upstreams__tools={"url": url + "/tools", "connect_timeout": "5s"})
    started = time.monotonic()
    async with http.post(proxy.url + "/tools/send", json={}, headers={"Idempotency-Key": "k1"}) as r:
        assert r.status == 200, await r.text()
    elapsed = time.monotonic() - started
    assert 0.2 < elapsed < 1.0, elapsed  # the second address 250 ms after the first (RFC 8305 §5)
    assert app[fake_provider.CALLS]["tool:send"] == 1


# -- TLS per upstream ---------------------------------------------------------------------

@pytest.fixture
async def tls_server(tmp_path):
    """Factory: the fake provider over TLS for ``localhost``, certified by a private CA
    (``require_client_cert``: mTLS); ``(url, app, ca, names)``, names: the SNI each
    handshake carried."""
    ca = PrivateCA(tmp_path)
    runners = []

    async def start(require_client_cert: bool = False):
        context = ca.server_context("localhost", require_client_cert=require_client_cert)
        names: list[str | None] = []
        context.sni_callback = lambda sslobj, name, ctx: names.append(name)
        app = fake_provider.create_app()
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
        runners.append(runner)
        return f"https://localhost:{runner.addresses[0][1]}", app, ca, names

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_an_upstreams_ca_file_is_trusted_and_its_name_checked(tls_server, make_proxy, sqlite_url, http):
    url, app, ca, names = await tls_server()
    port = url.rsplit(":", 1)[1]
    ca_file = str(ca.cert_file)
    proxy = await make_proxy(sqlite_url, upstreams__tools={"url": url + "/tools", "ca_file": ca_file},
                             upstreams__system={"url": url + "/tools", "kind": "tool"},
                             upstreams__byaddress={"url": f"https://127.0.0.1:{port}/tools", "kind": "tool",
                                                   "ca_file": ca_file})
    async with http.post(proxy.url + "/tools/send", json={}, headers={"Idempotency-Key": "k1"}) as r:
        assert r.status == 200, await r.text()
    assert names == ["localhost"]  # SNI from the URL
    # the system's trust store knows nothing of our CA; the certificate names localhost only
    for name in ("system", "byaddress"):
        async with http.post(f"{proxy.url}/{name}/send", json={}, headers={"Idempotency-Key": name}) as r:
            assert "nothing was sent" in (await problem(r, "upstream-unavailable", 502))["detail"]
    assert app[fake_provider.CALLS]["tool:send"] == 1


async def test_a_client_certificate_opens_an_mtls_server_that_refuses_others(
        tls_server, make_proxy, sqlite_url, http):
    url, app, ca, _ = await tls_server(require_client_cert=True)
    client = ca.issue("idemproxy", client=True)
    proxy = await make_proxy(sqlite_url, upstreams__tools={"url": url + "/tools", "ca_file": str(ca.cert_file),
                                                           "client_cert": str(client.cert),
                                                           "client_key": str(client.key)},
                             upstreams__anonymous={"url": url + "/tools", "kind": "tool",
                                                   "ca_file": str(ca.cert_file)})
    async with http.post(proxy.url + "/tools/send", json={}, headers={"Idempotency-Key": "k1"}) as r:
        assert r.status == 200, await r.text()
    async with http.get(proxy.url + "/anonymous/lookup") as r:  # a passthrough: no key to settle
        await problem(r, "upstream-unavailable", 502)
    assert app[fake_provider.CALLS] == {"tool:send": 1}  # the refused one never reached the tool
    # the premise: a client without a certificate gets no answer (TLS 1.3: the server's alert
    # comes after the client's handshake is done, as a reset or an SSL error on reading)
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", int(url.rsplit(":", 1)[1]), ssl=ssl.create_default_context(cafile=ca.cert_file),
        server_hostname="localhost")
    writer.write(b"GET /tools/x HTTP/1.1\r\nHost: localhost\r\n\r\n")
    try:
        answer = await reader.read()
    except (ssl.SSLError, ConnectionError) as exc:
        answer = repr(exc).encode()
    writer.close()
    assert not answer.startswith(b"HTTP/"), answer
    assert app[fake_provider.CALLS] == {"tool:send": 1}
