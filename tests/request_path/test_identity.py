"""Identity (docs/guarantees.md): Idempotency-Key per the IETF draft, run, epoch, policy; derived keys; fencing.

Key parsing is pure and property-tested; what the proxy does with keys, runs and
epochs is tested through real sockets on every store backend.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hmac

from multidict import CIMultiDict, CIMultiDictProxy

from idemproxy.proxy.identity import MAX_KEY_LENGTH, TenantResolver, parse_epoch, parse_key, parse_policy, parse_run
from idemproxy.proxy.policy import Policy
from idemproxy.proxy.problems import Problem
from rawhttp import problem, raw_problem, raw_request

PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
VISIBLE_NO_COMMA = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=',"')


def sf_string(key: str) -> str:
    """RFC 8941 §4.1.6 serialisation of a String."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def refused(values: list[str], slug: str = "invalid-key") -> None:
    with pytest.raises(Problem) as caught:
        parse_key(values)
    assert caught.value.slug == slug
    assert caught.value.status == 400


# -- Idempotency-Key: examples -------------------------------------------------------------

@pytest.mark.parametrize("header, key", [
    ('"abc"', "abc"),
    ("abc", "abc"),
    ("  abc\t", "abc"),
    ('"with space and \\"quote\\" and \\\\ slash"', 'with space and "quote" and \\ slash'),
    ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    ("step:42/run-7", "step:42/run-7"),
    ('" "', " "),
    ("x" * MAX_KEY_LENGTH, "x" * MAX_KEY_LENGTH),
])
def test_key_examples(header, key):
    assert parse_key([header]) == key


@pytest.mark.parametrize("header", [
    '""', "", "   ",  # empty
    "x" * (MAX_KEY_LENGTH + 1), sf_string("x" * (MAX_KEY_LENGTH + 1)),  # too long
    '"unterminated', '"a"b', '"bad \\n escape"', '"tab\there"', '"caf\u00e9"', "caf\u00e9",
    "a b",  # a bare token has no spaces
    "a,b", '"a", "b"', '"a",b', "a, b",  # a list is more than one value
    "ctrl\x01",
])
def test_malformed_keys_are_refused(header):
    refused([header])


def test_no_key_is_none():
    assert parse_key([]) is None


# -- Idempotency-Key: properties -----------------------------------------------------------

@given(st.text(PRINTABLE, min_size=1, max_size=MAX_KEY_LENGTH))
def test_any_valid_key_round_trips_as_sf_string(key):
    assert parse_key([sf_string(key)]) == key


@given(st.text(VISIBLE_NO_COMMA, min_size=1, max_size=MAX_KEY_LENGTH))
def test_any_bare_token_round_trips(key):
    assert parse_key([key]) == key


@given(st.text(PRINTABLE, min_size=MAX_KEY_LENGTH + 1, max_size=MAX_KEY_LENGTH + 40))
def test_keys_over_255_characters_are_refused(key):
    refused([sf_string(key)])


@given(st.text(PRINTABLE, min_size=1, max_size=40), st.text(PRINTABLE, min_size=1, max_size=40))
def test_two_values_are_refused(a, b):
    refused([sf_string(a), sf_string(b)])  # two field lines
    refused([f"{sf_string(a)}, {sf_string(b)}"])  # one line, two list members


@given(st.text(st.characters(codec="utf-8"), max_size=300))
@settings(max_examples=300)
def test_parsing_is_total(header):
    """Any header either yields a 1-255 printable key or is refused as invalid-key."""
    try:
        key = parse_key([header])
    except Problem as refusal:
        assert refusal.slug == "invalid-key"
        return
    assert 1 <= len(key) <= MAX_KEY_LENGTH
    assert all(" " <= ch <= "~" for ch in key)


# -- Idem-Run, Idem-Epoch, Idem-Policy ------------------------------------------------------

def test_run_epoch_policy_parsing():
    assert parse_run("run-1.a:b_C") == "run-1.a:b_C"
    assert parse_run("r" * 128) == "r" * 128
    assert parse_run(None) is None
    assert parse_epoch("0") == 0 and parse_epoch("17") == 17 and parse_epoch(None) is None
    assert parse_policy("record") is Policy.RECORD and parse_policy(" Passthrough ") is Policy.PASSTHROUGH
    for bad in ("", "r" * 129, "a b", "a/b", "ü"):
        with pytest.raises(Problem, match="Idem-Run"):
            parse_run(bad)
    for bad in ("-1", "1.5", "x", "", "0x1"):
        with pytest.raises(Problem, match="Idem-Epoch"):
            parse_epoch(bad)
    with pytest.raises(Problem, match="Idem-Policy"):
        parse_policy("sometimes")


def test_a_credentials_tenant_is_its_hmac_and_never_changes():
    """Journal entries are addressed by it: a tenant worked out differently after an upgrade
    would orphan every record. Pinned to RFC 2104 HMAC-SHA256, under two credentials in turn
    (the keyed HMAC is copied per credential, never fed twice)."""
    secret = b"s" * 32
    resolver = TenantResolver(secret, ("authorization",), "Idem-Tenant", ())
    for credential in ("Bearer sk-one", "Bearer sk-two", "Bearer sk-one"):
        headers = CIMultiDictProxy(CIMultiDict({"Authorization": credential}))
        material = f"authorization={credential}".encode()
        assert resolver.of_credential(headers) == "k:" + hmac.new(secret, material, "sha256").hexdigest()[:32]
    assert resolver.of_credential(CIMultiDictProxy(CIMultiDict())) == "anonymous"


# -- through the proxy ---------------------------------------------------------------------

CHAT = "/openai/v1/chat/completions"


def chat(content: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


async def test_two_key_header_lines_are_refused(make_proxy, store_url, provider):
    proxy = await make_proxy(store_url)
    body = b'{"model":"m","messages":[]}'
    resp = await raw_request(proxy.url, f"POST {CHAT} HTTP/1.1\nHost: x\nContent-Type: application/json\n"
                             f"Content-Length: {len(body)}\nIdempotency-Key: \"a\"\nIdempotency-Key: \"b\"",
                             body)
    raw_problem(resp, "invalid-key", 400)
    assert sum(provider.calls.values()) == 0


@pytest.mark.parametrize("value", ['""', "x" * 256, '"a", "b"', '"nul\\x"'])
async def test_malformed_key_is_400_and_not_forwarded(make_proxy, sqlite_url, provider, http, value):
    proxy = await make_proxy(sqlite_url)
    async with http.post(proxy.url + CHAT, json=chat("x"), headers={"Idempotency-Key": value}) as resp:
        await problem(resp, "invalid-key", 400)
    assert sum(provider.calls.values()) == 0


async def test_sf_string_and_bare_token_are_the_same_key(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    async with http.post(proxy.url + CHAT, json=chat("hi"), headers={"Idempotency-Key": '"k-1"'}) as r1:
        first = await r1.read()
    async with http.post(proxy.url + CHAT, json=chat("hi"), headers={"Idempotency-Key": "k-1"}) as r2:
        assert r2.headers["Idempotent-Replayed"] == "true"
        assert await r2.read() == first
    assert provider.calls["chat"] == 1


@pytest.mark.parametrize("headers, slug", [
    ({"Idem-Run": "bad run"}, "invalid-header"),
    ({"Idem-Run": "r1", "Idem-Epoch": "-1"}, "invalid-header"),
    ({"Idem-Epoch": "0"}, "invalid-header"),  # an epoch needs a run
    ({"Idem-Policy": "maybe"}, "invalid-header"),
])
async def test_malformed_idem_headers_are_400(make_proxy, sqlite_url, provider, http, headers, slug):
    proxy = await make_proxy(sqlite_url)
    async with http.post(proxy.url + CHAT, json=chat("x"), headers=headers) as resp:
        await problem(resp, slug, 400)
    assert sum(provider.calls.values()) == 0


async def test_derived_keys_count_occurrences_per_epoch(make_proxy, store_url, provider, http):
    """An unmodified agent (no keys) replays its n-th identical call onto the n-th record."""
    proxy = await make_proxy(store_url)

    async def step(epoch: int, content: str):
        async with http.post(f"{proxy.url}/runs/agent-1/epochs/{epoch}{CHAT}", json=chat(content)) as r:
            assert r.status == 200
            return r.headers["Idempotent-Replayed"], (await r.json())["choices"][0]["message"]["content"]

    first = [await step(0, c) for c in ("a", "a", "b")]
    assert [replayed for replayed, _ in first] == ["false"] * 3
    assert first[0][1] != first[1][1]  # the same call twice is two calls, two answers
    assert provider.calls["chat"] == 3

    again = [await step(1, c) for c in ("a", "a", "b")]
    assert again == [("true", text) for _, text in first]
    assert provider.calls["chat"] == 3

    replayed, _ = await step(1, "a")  # a third "a" was never recorded: it goes upstream
    assert replayed == "false"
    assert provider.calls["chat"] == 4


async def test_run_header_and_run_path_are_the_same_run(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    async with http.post(proxy.url + CHAT, json=chat("q"), headers={"Idem-Run": "r-h", "Idem-Epoch": "0"}) as r:
        first = await r.read()
    async with http.post(f"{proxy.url}/runs/r-h/epochs/1{CHAT}", json=chat("q")) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
        assert await r.read() == first
    assert provider.calls["chat"] == 1


async def test_explicit_keys_are_scoped_by_run(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    for run, content in (("r-a", "one"), ("r-b", "two")):
        async with http.post(f"{proxy.url}/runs/{run}{CHAT}", json=chat(content),
                             headers={"Idempotency-Key": "same"}) as r:
            assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"
    async with http.post(proxy.url + CHAT, json=chat("three"), headers={"Idempotency-Key": "same"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"
    assert provider.calls["chat"] == 3


@pytest.mark.parametrize("method, path", [("POST", CHAT), ("GET", "/raw/echo/x")])
async def test_stale_epoch_is_412_before_anything_is_forwarded(make_proxy, store_url, provider, http,
                                                               method, path):
    proxy = await make_proxy(store_url)
    for epoch in (1, 2):  # each request may start the next attempt
        async with http.post(f"{proxy.url}/runs/z1/epochs/{epoch}{CHAT}", json=chat(f"attempt {epoch}")) as r:
            assert r.status == 200
    before = sum(provider.calls.values())
    for stale in ("/runs/z1/epochs/1" + path, "/runs/z1/epochs/0" + path):
        async with http.request(method, proxy.url + stale, json=chat("zombie")) as r:
            body = await problem(r, "stale-epoch", 412)
            assert body["epoch"] == 2
    async with http.request(method, proxy.url + path, json=chat("zombie"),
                            headers={"Idem-Run": "z1", "Idem-Epoch": "1", "Idempotency-Key": "zk"}) as r:
        await problem(r, "stale-epoch", 412)
    assert sum(provider.calls.values()) == before
    # no epoch at all: not fenced
    async with http.request(method, f"{proxy.url}/runs/z1{path}", json=chat("unfenced")) as r:
        assert r.status == 200


async def test_one_request_cannot_brick_a_run(make_proxy, store_url, provider, http):
    """A request may start the next attempt (epoch + 1), never one further ahead: a run pushed
    to an epoch past what the proxy parses, or far past its agent's, would be lost."""
    proxy = await make_proxy(store_url)
    async with http.post(f"{proxy.url}/runs/b1/epochs/0{CHAT}", json=chat("step")) as r:
        assert r.status == 200
    for ahead in ("999999999999999", "2"):
        for where in ({"url": f"/runs/b1/epochs/{ahead}{CHAT}"},
                      {"url": CHAT, "headers": {"Idem-Run": "b1", "Idem-Epoch": ahead}}):
            async with http.post(proxy.url + where["url"], json=chat("jump"), headers=where.get("headers")) as r:
                assert (await problem(r, "epoch-ahead", 409))["epoch"] == 0
    async with http.post(f"{proxy.url}/runs/b1/epochs/1000000000000000{CHAT}", json=chat("jump")) as r:
        await problem(r, "invalid-header", 400)  # 16 digits: out of the one range
    async with http.post(f"{proxy.url}/runs/b1/epochs/0{CHAT}", json=chat("step two")) as r:
        assert r.status == 200  # the agent's attempt was not superseded
    async with http.post(f"{proxy.url}/runs/b1/heartbeat", json={"epoch": 10 ** 18}) as r:
        await problem(r, "invalid-body", 400)  # the runs API keeps the same range
    async with http.post(f"{proxy.url}/runs/b1/attempts") as r:
        assert r.status == 201 and (await r.json())["epoch"] == 1  # only by one
    async with http.post(f"{proxy.url}/runs/b1/epochs/2{CHAT}", json=chat("step")) as r:
        assert r.headers["Idempotent-Replayed"] == "true"  # traffic may start the next attempt too
    # an unknown run counts as one at epoch 0, and a refused request creates none
    async with http.post(f"{proxy.url}/runs/b2/epochs/5{CHAT}", json=chat("jump")) as r:
        await problem(r, "epoch-ahead", 409)
    async with http.get(f"{proxy.url}/runs/b2") as r:
        assert r.status == 404
    assert provider.calls["chat"] == 2  # "step" and "step two": no refused request went upstream
