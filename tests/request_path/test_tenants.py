"""Tenants (docs/security.md): HMAC of the credential, or a trusted header from a trusted source."""

from __future__ import annotations

import pytest

from config_files import write_config
from idemproxy.proxy.config import ConfigError, TenantSettings, UpstreamSettings, load_settings
from rawhttp import problem, raw_request

CHAT = "/openai/v1/chat/completions"


def body(content: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


async def call(http, url, content, **headers):
    async with http.post(url, json=body(content), headers=headers) as r:
        return r.status, r.headers.get("Idempotent-Replayed"), await r.read()


@pytest.mark.parametrize("header, a, b", [
    ("Authorization", "Bearer sk-tenant-a", "Bearer sk-tenant-b"),
    ("x-api-key", "key-a", "key-b"),
    ("api-key", "azure-a", "azure-b"),
])
async def test_two_api_keys_with_the_same_key_never_see_each_other(make_proxy, store_url, provider, http,
                                                                  header, a, b):
    proxy = await make_proxy(store_url)
    url = proxy.url + CHAT
    status_a, replayed_a, answer_a = await call(http, url, "from a", **{header: a, "Idempotency-Key": "shared"})
    # another body under the same key is no 422 for b: b has never used "shared"
    status_b, replayed_b, answer_b = await call(http, url, "from b", **{header: b, "Idempotency-Key": "shared"})
    assert (status_a, replayed_a, status_b, replayed_b) == (200, "false", 200, "false")
    assert b"from a" in answer_a and b"from b" in answer_b
    assert await call(http, url, "from a", **{header: a, "Idempotency-Key": "shared"}) == (200, "true", answer_a)
    assert await call(http, url, "from b", **{header: b, "Idempotency-Key": "shared"}) == (200, "true", answer_b)
    # no credential at all is a tenant of its own too
    assert (await call(http, url, "anon", **{"Idempotency-Key": "shared"}))[1] == "false"
    assert provider.calls["chat"] == 3


async def test_tenant_secret_is_kept_in_the_store_across_restarts(make_proxy, store_url, provider, http):
    auth = {"Authorization": "Bearer sk-stable", "Idempotency-Key": "s1"}
    first = await make_proxy(store_url)
    _, _, answer = await call(http, first.url + CHAT, "x", **auth)
    await first.server.close()
    second = await make_proxy(store_url)  # a new process would generate a new secret if none were kept
    assert await call(http, second.url + CHAT, "x", **auth) == (200, "true", answer)
    assert provider.calls["chat"] == 1


async def test_configured_tenant_secret_is_used(make_proxy, store_url, provider, http):
    auth = {"Authorization": "Bearer sk-conf", "Idempotency-Key": "s2"}
    first = await make_proxy(store_url, tenants={"secret": "configured-secret-1"})
    _, _, answer = await call(http, first.url + CHAT, "x", **auth)
    same = await make_proxy(store_url, tenants={"secret": "configured-secret-1"})
    assert await call(http, same.url + CHAT, "x", **auth) == (200, "true", answer)
    other = await make_proxy(store_url, tenants={"secret": "another-secret"})
    assert (await call(http, other.url + CHAT, "x", **auth))[1] == "false"
    assert provider.calls["chat"] == 2


async def test_trusted_tenant_header_names_the_tenant(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, tenants={"trusted_sources": ["127.0.0.0/8"]})
    url = proxy.url + CHAT
    _, _, answer = await call(http, url, "x", **{"Idem-Tenant": "acme", "Authorization": "Bearer k1",
                                                 "Idempotency-Key": "t"})
    # the tenant is acme whatever the credential: a second key of acme sees acme's record
    assert await call(http, url, "x", **{"Idem-Tenant": "acme", "Authorization": "Bearer k2",
                                         "Idempotency-Key": "t"}) == (200, "true", answer)
    assert (await call(http, url, "x", **{"Idem-Tenant": "globex", "Authorization": "Bearer k1",
                                          "Idempotency-Key": "t"}))[1] == "false"
    assert (await call(http, url, "x", **{"Authorization": "Bearer k1", "Idempotency-Key": "t"}))[1] == "false"
    assert provider.calls["chat"] == 3
    headers = provider.seen[0]["headers"]
    assert not any(k.lower() == "idem-tenant" for k in headers)


@pytest.mark.parametrize("trusted", [None, ["10.0.0.0/8", "::1/128"]])
async def test_tenant_header_from_an_untrusted_source_is_403(make_proxy, store_url, provider, http, trusted):
    extra = {"tenants": {"trusted_sources": trusted}} if trusted else {}
    proxy = await make_proxy(store_url, **extra)
    for path in (CHAT, "/raw/echo/x"):
        async with http.post(proxy.url + path, json=body("x"),
                             headers={"Idem-Tenant": "acme", "Idempotency-Key": "u"}) as r:
            await problem(r, "untrusted-tenant", 403)
    assert sum(provider.calls.values()) == 0


async def test_malformed_trusted_tenant_is_400(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, tenants={"trusted_sources": ["127.0.0.1/32"]})
    async with http.post(proxy.url + CHAT, json=body("x"), headers={"Idem-Tenant": "bad tenant!"}) as r:
        await problem(r, "invalid-header", 400)
    assert sum(provider.calls.values()) == 0


# -- callers with no credential --------------------------------------------------------------

REFUSE = {"tenants": {"anonymous": "refuse"}}  # the product default (conftest shares, for other tests)


def test_refusing_anonymous_callers_is_the_default_and_choices_are_checked(tmp_path):
    assert TenantSettings().anonymous == "refuse" and UpstreamSettings("x", "http://x").anonymous == ""
    for section, body in (("tenants", {"anonymous": "share"}),
                          ("upstreams.x", {"url": "http://127.0.0.1:1", "anonymous": "yes"})):
        with pytest.raises(ConfigError, match="anonymous must be 'refuse' or 'shared'"):
            load_settings(write_config(tmp_path / "c.toml", {section: body}), env={})


@pytest.mark.parametrize("headers", [
    {}, {"Cookie": "session=B"}, {"Authorization": ""}, {"X-Api-Key": "  "}, {"X-Session": "B"},
])
async def test_a_recorded_call_without_a_credential_is_refused_and_changes_nothing(
        make_proxy, store_url, provider, http, headers):
    proxy = await make_proxy(store_url, **REFUSE)
    for extra in ({"Idempotency-Key": "anon"}, {"Idem-Run": "anon-run", "Idem-Epoch": "0"}):
        async with http.post(proxy.url + "/raw/echo/x", json=body("x"), headers={**headers, **extra}) as r:
            refused = await problem(r, "credential-required", 401)
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert 'anonymous = "shared"' in refused["detail"] and "[upstreams.raw]" in refused["detail"]
    assert "authorization" in refused["detail"]
    assert sum(provider.calls.values()) == 0
    assert await proxy.store.runs.find(None, "anon-run") == []
    # what is not recorded still passes, credential or not
    async with http.get(proxy.url + "/raw/echo/x", headers=headers) as r:
        assert r.status == 200
    async with http.post(proxy.url + "/raw/echo/x", json=body("x"), headers=headers) as r:
        assert r.status == 200
    assert provider.calls["echo"] == 2


async def test_a_cookie_caller_is_never_served_another_cookie_callers_record(make_proxy, store_url, provider,
                                                                            http):
    # once a leak: Cookie: session=B was served session=A's recorded answer
    proxy = await make_proxy(store_url, **REFUSE)
    url = proxy.url + CHAT
    assert (await call(http, url, "x", Cookie="session=A", **{"Idempotency-Key": "c"}))[0] == 401
    assert (await call(http, url, "x", Cookie="session=B", **{"Idempotency-Key": "c"}))[0] == 401
    assert provider.calls["chat"] == 0


async def test_credential_cookies_make_cookie_callers_tenants_of_their_own(make_proxy, store_url, provider,
                                                                          http):
    proxy = await make_proxy(store_url, tenants={"anonymous": "refuse", "credential_cookies": ["session"]})
    url = proxy.url + CHAT
    key = {"Idempotency-Key": "c"}
    status, replayed, answer_a = await call(http, url, "x", Cookie="theme=dark; session=A", **key)
    assert (status, replayed) == (200, "false")
    assert await call(http, url, "x", Cookie="session=A; theme=light", **key) == (200, "true", answer_a)
    for other in ("session=B", "session=A; session=B"):  # a second session cookie is another caller
        status, replayed, answer = await call(http, url, "x", Cookie=other, **key)
        assert (status, replayed) == (200, "false") and answer != answer_a, other
    for no_credential in ("theme=dark", "session="):
        assert (await call(http, url, "x", Cookie=no_credential, **key))[0] == 401, no_credential
    assert provider.calls["chat"] == 3


async def test_anonymous_callers_share_records_only_where_configured(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, tenants={"anonymous": "refuse"}, upstreams__raw={"anonymous": "shared"})
    first = await call(http, proxy.url + "/raw/echo/x", "x", **{"Idempotency-Key": "s"})
    assert first[:2] == (200, "false")
    # shared on purpose: another caller without a credential gets the same record
    assert await call(http, proxy.url + "/raw/echo/x", "x", Cookie="session=B",
                      **{"Idempotency-Key": "s"}) == (200, "true", first[2])
    assert (await call(http, proxy.url + CHAT, "x", **{"Idempotency-Key": "s"}))[0] == 401
    # and the other way round: shared by default, refused for one upstream
    proxy = await make_proxy(store_url, tenants={"anonymous": "shared"}, upstreams__openai={"anonymous": "refuse"})
    assert (await call(http, proxy.url + CHAT, "x", **{"Idempotency-Key": "s2"}))[0] == 401
    assert (await call(http, proxy.url + "/anthropic/v1/messages", "x", **{"Idempotency-Key": "s2"}))[0] == 200
    assert provider.calls["echo"] == 1 and provider.calls["chat"] == 0


async def test_a_trusted_tenant_header_is_a_credential(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, tenants={"anonymous": "refuse", "trusted_sources": ["127.0.0.0/8"]})
    status, _, _ = await call(http, proxy.url + CHAT, "x", **{"Idem-Tenant": "acme", "Idempotency-Key": "t"})
    assert status == 200 and provider.calls["chat"] == 1


async def test_a_credential_that_is_not_utf8_names_a_tenant_of_its_own(make_proxy, store_url, provider):
    # found by tests/request_path/test_fuzz.py: a latin-1 byte in Authorization made the tenant's HMAC raise (500)
    proxy = await make_proxy(store_url, **REFUSE)
    answers = []
    for credential in ("Bearer caf\xe9", "Bearer caf\xe9", "Bearer caf\xe8"):
        resp = await raw_request(proxy.url, f"POST /raw/echo/x HTTP/1.1\nHost: x\nAuthorization: {credential}\n"
                                            "Idempotency-Key: latin\nContent-Length: 2", b"{}")
        answers.append((resp.status, resp.headers["Idempotent-Replayed"]))
    assert answers == [(200, "false"), (200, "true"), (200, "false")]
    assert provider.calls["echo"] == 2
