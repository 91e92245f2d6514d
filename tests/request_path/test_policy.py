"""Policy (docs/concepts.md): what is recorded, what is released, what an ambiguous outcome does."""

from __future__ import annotations

import pytest

from idemproxy.proxy.config import Rule, UpstreamSettings, ambiguous_policy
from idemproxy.proxy.policy import Policy, Verdict, decide, verdict
from rawhttp import problem

CHAT = "/openai/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# -- the decision, as a function -----------------------------------------------------------

def upstream(**kw) -> UpstreamSettings:
    return UpstreamSettings(name=kw.pop("name", "tools"), url=kw.pop("url", "http://tools.internal:9000"), **kw)


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
def test_safe_methods_pass_through_by_default(method):
    assert decide(upstream(), method, "/x", override=None, has_key=True, has_run=True) is Policy.PASSTHROUGH


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_other_methods_record_with_a_key_or_a_run(method):
    up = upstream()
    assert decide(up, method, "/x", override=None, has_key=True, has_run=False) is Policy.RECORD
    assert decide(up, method, "/x", override=None, has_key=False, has_run=True) is Policy.RECORD
    assert decide(up, method, "/x", override=None, has_key=False, has_run=False) is Policy.PASSTHROUGH


def test_rules_then_override():
    # as configuration gives them: names, turned into Policy members by decide()
    up = upstream(rules=(Rule("GET /search/*", "passthrough"), Rule("/send", "record"),
                         Rule("POST /lookup*", "passthrough"), Rule("* /v1/*", "record")))
    assert decide(up, "GET", "/search/q", override=None, has_key=True, has_run=True) is Policy.PASSTHROUGH
    assert decide(up, "GET", "/send", override=None, has_key=False, has_run=False) is Policy.RECORD  # any method
    assert decide(up, "POST", "/lookup/1", override=None, has_key=True, has_run=True) is Policy.PASSTHROUGH
    assert decide(up, "GET", "/v1/models", override=None, has_key=False, has_run=False) is Policy.RECORD
    assert decide(up, "POST", "/lookup/1", override=Policy.RECORD, has_key=False, has_run=False) is Policy.RECORD
    assert decide(up, "GET", "/send", override=Policy.PASSTHROUGH, has_key=True, has_run=True) is Policy.PASSTHROUGH


@pytest.mark.parametrize("status, expected", [
    (200, Verdict.RECORD), (201, Verdict.RECORD), (204, Verdict.RECORD), (301, Verdict.RECORD),
    (400, Verdict.RECORD), (401, Verdict.RECORD), (404, Verdict.RECORD), (422, Verdict.RECORD),
    (408, Verdict.RELEASE), (409, Verdict.RELEASE), (425, Verdict.RELEASE), (429, Verdict.RELEASE),
    (500, Verdict.AMBIGUOUS), (502, Verdict.AMBIGUOUS), (503, Verdict.AMBIGUOUS), (504, Verdict.AMBIGUOUS),
])
def test_which_outcomes_are_recorded(status, expected):
    assert verdict(status) is expected


def test_ambiguous_defaults_by_kind():
    assert ambiguous_policy(upstream(name="openai", url="https://api.openai.com")) == "retry"
    assert ambiguous_policy(upstream(name="llm", url="https://api.anthropic.com")) == "retry"
    assert ambiguous_policy(upstream()) == "quarantine"
    assert ambiguous_policy(upstream(kind="model")) == "retry"
    assert ambiguous_policy(upstream(name="openai", url="https://api.openai.com", on_ambiguous="quarantine")) \
        == "quarantine"


# -- through the proxy ---------------------------------------------------------------------

async def post(http, url, key, **headers):
    async with http.post(url, json=BODY, headers={"Idempotency-Key": key, **headers}) as r:
        return r.status, r.headers.copy(), await r.read()


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_4xx_outcomes_are_recorded_and_replayed(make_proxy, store_url, provider, http, status):
    proxy = await make_proxy(store_url)
    s1, h1, b1 = await post(http, proxy.url + CHAT, "k4", **{"X-Fake-Status": str(status)})
    s2, h2, b2 = await post(http, proxy.url + CHAT, "k4")
    assert (s1, h1["Idempotent-Replayed"]) == (status, "false")
    assert (s2, h2["Idempotent-Replayed"], b2) == (status, "true", b1)
    assert provider.calls["chat"] == 1


@pytest.mark.parametrize("status", [408, 409, 425, 429])
async def test_nothing_happened_statuses_release_the_key(make_proxy, store_url, provider, http, status):
    proxy = await make_proxy(store_url)
    s1, _, _ = await post(http, proxy.url + CHAT, "kr", **{"X-Fake-Status": str(status)})
    s2, h2, _ = await post(http, proxy.url + CHAT, "kr")
    s3, h3, _ = await post(http, proxy.url + CHAT, "kr")
    assert s1 == status
    assert (s2, h2["Idempotent-Replayed"]) == (200, "false")  # the retry went upstream
    assert (s3, h3["Idempotent-Replayed"]) == (200, "true")
    assert provider.calls["chat"] == 2


@pytest.mark.parametrize("status", [500, 503])
async def test_5xx_on_a_retry_upstream_releases_the_key(make_proxy, store_url, provider, http, status):
    proxy = await make_proxy(store_url)  # openai: a model provider, on_ambiguous = retry
    s1, _, _ = await post(http, proxy.url + CHAT, "k5", **{"X-Fake-Status": str(status)})
    s2, h2, _ = await post(http, proxy.url + CHAT, "k5")
    assert s1 == status
    assert (s2, h2["Idempotent-Replayed"]) == (200, "false")
    assert provider.calls["chat"] == 2


async def test_5xx_on_a_quarantine_upstream_is_outcome_unknown(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)  # tools: on_ambiguous = quarantine
    s1, _, _ = await post(http, proxy.url + "/tools/send", "q1", **{"X-Fake-Status": "503"})
    assert s1 == 503  # the first caller sees what the upstream said
    for _ in range(2):
        async with http.post(proxy.url + "/tools/send", json=BODY, headers={"Idempotency-Key": "q1"}) as r:
            await problem(r, "outcome-unknown", 502)
    assert provider.calls["tool:send"] == 1
    async with http.get(proxy.url + "/tools/send") as r:  # passthrough is not affected
        assert r.status == 200


async def test_timeout_on_a_quarantine_upstream_is_outcome_unknown(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, upstreams__tools={"read_timeout": "0.3s"})
    async with http.post(proxy.url + "/tools/send", json=BODY,
                         headers={"Idempotency-Key": "qt", "X-Fake-Delay": "1"}) as r:
        await problem(r, "upstream-timeout", 504)
    async with http.post(proxy.url + "/tools/send", json=BODY, headers={"Idempotency-Key": "qt"}) as r:
        await problem(r, "outcome-unknown", 502)
    assert provider.calls["tool:send"] == 1


async def test_on_ambiguous_is_configurable_per_upstream(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, upstreams__openai={"on_ambiguous": "quarantine"},
                             upstreams__tools={"on_ambiguous": "retry"})
    await post(http, proxy.url + CHAT, "a1", **{"X-Fake-Status": "502"})
    async with http.post(proxy.url + CHAT, json=BODY, headers={"Idempotency-Key": "a1"}) as r:
        await problem(r, "outcome-unknown", 502)
    await post(http, proxy.url + "/tools/send", "a2", **{"X-Fake-Status": "500"})
    s, h, _ = await post(http, proxy.url + "/tools/send", "a2")
    assert (s, h["Idempotent-Replayed"]) == (200, "false")
    assert (provider.calls["chat"], provider.calls["tool:send"]) == (1, 2)


async def test_unreachable_upstream_releases_the_key(make_proxy, store_url, http):
    import services

    proxy = await make_proxy(store_url, upstreams__gone={"url": f"http://127.0.0.1:{services.free_port()}",
                                                         "on_ambiguous": "quarantine"})
    for _ in range(2):  # nothing was sent, so nothing is quarantined: the key stays free
        async with http.post(proxy.url + "/gone/send", json=BODY, headers={"Idempotency-Key": "g"}) as r:
            await problem(r, "upstream-unavailable", 502)


async def test_default_policies_through_the_proxy(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    url = proxy.url + "/tools/t"
    for _ in range(2):
        async with http.post(url, json=BODY) as r:  # no key, no run: passthrough
            assert r.status == 200 and "Idempotent-Replayed" not in r.headers
        async with http.get(url, headers={"Idempotency-Key": "g1"}) as r:  # GET: passthrough
            assert r.status == 200
    assert provider.calls["tool:t"] == 4
    for epoch in range(2):
        await post(http, url, "p1")  # POST with a key: record
        async with http.post(f"{proxy.url}/runs/pr/epochs/{epoch}/tools/t", json=BODY) as r:  # in a run: record
            assert r.headers["Idempotent-Replayed"] == ("true" if epoch else "false")
    assert provider.calls["tool:t"] == 6


async def test_per_request_override(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    url = proxy.url + "/tools/o"
    for _ in range(2):
        await post(http, url, "o1", **{"Idem-Policy": "passthrough"})
    assert provider.calls["tool:o"] == 2
    for _ in range(2):
        async with http.get(url, headers={"Idempotency-Key": "o2", "Idem-Policy": "record"}) as r:
            assert r.status == 200
    assert provider.calls["tool:o"] == 3
    for _ in range(2):  # record with neither key nor run: the request is its own key
        async with http.post(url, json=BODY, headers={"Idem-Policy": "record"}) as r:
            last = r.headers["Idempotent-Replayed"]
    assert (provider.calls["tool:o"], last) == (4, "true")


async def test_configured_rules(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, upstreams__tools={"rules": [
        {"match": "POST /lookup", "policy": "passthrough"}, {"match": "GET /send*", "policy": "record"}]})
    for _ in range(2):
        await post(http, proxy.url + "/tools/lookup", "r1")
        async with http.get(proxy.url + "/tools/sendmail", headers={"Idempotency-Key": "r2"}) as r:
            assert r.status == 200
    assert (provider.calls["tool:lookup"], provider.calls["tool:sendmail"]) == (2, 1)
    for _ in range(2):  # the per-request override beats the rule
        await post(http, proxy.url + "/tools/lookup", "r3", **{"Idem-Policy": "record"})
    assert provider.calls["tool:lookup"] == 3


# -- the idempotency key forwarded to upstreams that deduplicate too -----------------------

def forwarded(provider, name: str, header: str = "Idempotency-Key") -> list[str | None]:
    return [{k.lower(): v for k, v in seen["headers"].items()}.get(header.lower())
            for seen in provider.seen if seen["name"] == name]


async def test_derived_key_is_forwarded_and_stable_across_a_retry(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, upstreams__tools={"on_ambiguous": "retry"})
    await post(http, proxy.url + "/tools/pay", "agent-key", **{"X-Fake-Status": "503"})
    s, _, _ = await post(http, proxy.url + "/tools/pay", "agent-key")
    assert s == 200
    first, retry = forwarded(provider, "tool:pay")
    assert first == retry  # the provider can deduplicate the retry
    assert first.startswith("idem-") and "agent-key" not in first
    await post(http, proxy.url + "/tools/pay", "other-key")
    assert forwarded(provider, "tool:pay")[2] != first

    # a derived key (a run, no Idempotency-Key) is stable across a retry too
    for extra in ({"X-Fake-Status": "500"}, {}):
        async with http.post(proxy.url + "/runs/fr/epochs/0/tools/mail", json=BODY, headers=extra) as r:
            assert r.status == (500 if extra else 200)
    first, retry = forwarded(provider, "tool:mail")
    assert first == retry and first.startswith("idem-")


async def test_forwarded_key_header_name_is_configurable(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, upstreams__tools={"idempotency_header": "X-Dedupe-Key"})
    await post(http, proxy.url + "/tools/pay", "k")
    assert forwarded(provider, "tool:pay", "X-Dedupe-Key")[0].startswith("idem-")
    await post(http, proxy.url + CHAT, "k")  # openai has no idempotency_header: no derived key
    headers = provider.seen[-1]["headers"]
    assert not any(str(v).startswith("idem-") for v in headers.values())
