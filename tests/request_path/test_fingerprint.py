"""Fingerprint (docs/concepts.md): canonical JSON, ignored fields, and what the proxy does with them."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idemproxy.proxy.fingerprint import MAX_DEPTH, canonical_json, fingerprint
from rawhttp import problem

CHAT_PATH = "/v1/chat/completions"

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=6),
    max_leaves=30)


def shuffled(value, rng: random.Random):
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        items = [(k, shuffled(v, rng)) for k, v in value.items()]
        rng.shuffle(items)
        return dict(items)
    if isinstance(value, list):
        return [shuffled(v, rng) for v in value]
    return value


def serialise(value, rng: random.Random) -> bytes:
    """Any of the ways a client might write the same value."""
    style = rng.choice([{}, {"indent": 2}, {"separators": (",", ":")}, {"indent": "\t", "separators": (" ,", " : ")},
                        {"ensure_ascii": False}])
    text = json.dumps(value, **style)
    return (rng.choice(["", " ", "\n", "\r\n\t"]) + text + rng.choice(["", " ", "\n"])).encode()


def fp(body: bytes, ignore=(), method="POST", path=CHAT_PATH, content_type="application/json") -> str:
    return fingerprint(method, "openai", path, body, content_type, ignore)


@given(json_values, st.randoms(use_true_random=False))
@settings(max_examples=150)
def test_fingerprint_ignores_key_order_and_whitespace(value, rng):
    a, b = serialise(value, rng), serialise(shuffled(value, rng), rng)
    assert fp(a) == fp(b)
    assert canonical_json(a) == canonical_json(b)


@given(json_values)
def test_canonical_json_is_a_fixed_point_and_parses_back(value):
    canonical = canonical_json(json.dumps(value).encode())
    assert canonical is not None
    assert canonical_json(canonical) == canonical
    assert json.loads(canonical) == value
    assert canonical_json(json.dumps(value, indent=3).encode()) == canonical


@given(st.dictionaries(st.text(min_size=1, max_size=8), json_scalars, min_size=1, max_size=6),
       json_scalars, json_scalars, st.randoms(use_true_random=False))
def test_ignored_fields_do_not_count_and_others_do(base, ts_a, ts_b, rng):
    doc_a = {**base, "metadata": {"ts": ts_a, "keep": 1}}
    doc_b = {**base, "metadata": {"ts": ts_b, "keep": 1}}
    ignore = ("metadata.ts",)
    assert fp(serialise(doc_a, rng), ignore) == fp(serialise(shuffled(doc_b, rng), rng), ignore)
    changed = {**doc_a, "metadata": {"ts": ts_a, "keep": 2}}
    assert fp(serialise(doc_a, rng), ignore) != fp(serialise(changed, rng), ignore)


def test_ignored_field_paths_with_wildcards():
    a = {"messages": [{"role": "system", "content": "x", "ts": 1}, {"role": "user", "ts": 2}], "n": 1}
    b = {"messages": [{"role": "system", "content": "x", "ts": 9}, {"role": "user", "ts": 8}], "n": 1}
    ignore = ("messages.*.ts",)
    assert fp(json.dumps(a).encode(), ignore) == fp(json.dumps(b).encode(), ignore)
    assert fp(json.dumps(a).encode()) != fp(json.dumps(b).encode())
    assert fp(json.dumps(a).encode(), ("messages.0.ts", "messages.1.ts")) == fp(json.dumps(b).encode(), ignore)


@pytest.mark.parametrize("other", [
    dict(method="PUT"), dict(path="/v1/embeddings"), dict(path=CHAT_PATH + "?stream=1"),
])
def test_method_path_and_query_count(other):
    body = b'{"a":1}'
    assert fp(body) != fp(body, **other)
    assert fingerprint("POST", "openai", CHAT_PATH, body, "application/json") != \
        fingerprint("POST", "anthropic", CHAT_PATH, body, "application/json")


def test_non_json_bodies_are_hashed_as_bytes():
    assert fp(b'{"a": 1, "b": 2}', content_type="text/plain") != fp(b'{"b": 2, "a": 1}', content_type="text/plain")
    assert fp(b"not json {", content_type="application/json") != fp(b"not json  {", content_type="application/json")
    assert fp(b"\x00\xff", content_type="application/octet-stream") == fp(b"\x00\xff", content_type="application/octet-stream")
    assert fp(b"") == fp(b"", content_type="")


def test_numbers_are_compared_as_parsed():
    assert fp(b'{"t": 1e2}') == fp(b'{"t": 100.0}')
    assert fp(b'{"t": 0.5}') != fp(b'{"t": 0.50001}')
    assert fp(b'{"big": 123456789012345678901234567890}') == fp(b'{ "big" : 123456789012345678901234567890 }')


# -- the rule for odd JSON: never an error, never a shared record ----------------------------

LONG_ID = b', "id": 1234567890123456789}'  # 19 digits: the body takes the exact path


@pytest.mark.parametrize("body", [
    b"[" * 1000 + b"]" * 1000,                     # RecursionError before
    b'{"s": "\\ud800"' + LONG_ID,                   # a lone surrogate: UnicodeEncodeError before
    b'{"n": NaN}', b'{"n": -Infinity' + LONG_ID, b'{"n": 1e999}',
    b'{"a": 1, "a": 2}', b"\xef\xbb\xbf{}", b'{"x": 1e-400}', b'"\xff"',
    b'[' + b"9" * 5000 + b']',                     # past Python's int-from-text limit
])
def test_odd_but_valid_or_nearly_valid_json_never_fails(body):
    assert len(fp(body)) == 64 and len(fp(body, ignore=("a",))) == 64
    assert canonical_json(body) is None  # hashed as raw bytes


@pytest.mark.parametrize("a, b", [
    (b'{"n": NaN' + LONG_ID, b'{"n": null' + LONG_ID),
    (b'{"a": 1, "a": 2}', b'{"a": 2}'),
    (b'{"a\\u003a": 1, "a\\u003a": 2}', b'{"a\\u003a": 2}'),   # a key hidden in escapes
    (b'{"a": 1, "a": 2' + LONG_ID, b'{"a": 2' + LONG_ID),
    (b'{"x": 0.12345678901234567}', b'{"x": 0.12345678901234566}'),  # 17 digits: not one double
    (b'{"x": 1e-400}', b'{"x": 0.0}'),
    (b'{"x": 9007199254740993}', b'{"x": 9007199254740992}'),      # past 2**53
    (b'{"x": 123456789012345678901234567890}', b'{"x": 123456789012345678901234567891}'),
    (b'{"x": -0.0}', b'{"x": 0.0}'),
    (b'{"x": 1}', b'{"x": 1.0}'),
])
def test_different_requests_never_share_a_fingerprint(a, b):
    assert fp(a) != fp(b)


def test_a_raw_body_never_matches_a_json_body_canonicalised_to_its_bytes():
    json_body, lookalike = b'{ "b": 1, "a": [1, 2] }', b'{"a":[1,2],"b":1}'
    assert canonical_json(json_body) == lookalike
    assert fp(lookalike, content_type="text/plain") != fp(json_body)
    assert fp(lookalike, content_type="") != fp(lookalike)
    # raw bodies still compare byte for byte, whatever the type
    assert fp(b'{"a":1,"a":1}', content_type="text/plain") == fp(b'{"a":1,"a":1}')


@pytest.mark.parametrize("content_type, canonicalised", [
    ("application/json", True), ("Application/JSON; charset=utf-8", True),
    (" APPLICATION/JSON ;charset=UTF-8", True), ("application/vnd.api+json", True),
    ("application/merge-patch+JSON", True), ("text/plain", False), ("application/x-ndjson", False),
    ("application/jsonl", False), ("text/json", False), ("", False),
])
def test_json_media_types_are_matched_without_case(content_type, canonicalised):
    spaced = fp(b'{ "b": 1,  "a": 2 }', content_type=content_type)
    assert (spaced == fp(b'{"a":2,"b":1}', content_type="application/json")) is canonicalised


@pytest.mark.parametrize("leaf", [b"1", b"12345678901234567890123"])  # fast and exact paths
@pytest.mark.parametrize("opening, closing", [(b"[", b"]"), (b'{"k":', b"}")])
def test_nesting_is_canonicalised_up_to_max_depth(leaf, opening, closing):
    def nested(depth: int) -> bytes:
        return opening * depth + leaf + closing * depth
    assert canonical_json(nested(MAX_DEPTH)) is not None
    assert canonical_json(nested(MAX_DEPTH + 1)) is None
    assert len(fp(nested(MAX_DEPTH + 1))) == 64


# -- through the proxy ---------------------------------------------------------------------

async def test_reordered_body_replays_and_changed_body_is_422(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    url, key = proxy.url + "/openai" + CHAT_PATH, {"Idempotency-Key": "fp-1", "Content-Type": "application/json"}
    async with http.post(url, data=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}', headers=key) as r:
        first = await r.read()
    async with http.post(url, data=b'{\n  "messages": [ {"content": "hi", "role": "user"} ],\n  "model": "m"\n}',
                         headers=key) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
        assert await r.read() == first
    async with http.post(url, data=b'{"model":"m","messages":[{"role":"user","content":"HI"}]}', headers=key) as r:
        body = await r.json(content_type=None)
        assert r.status == 422 and body["type"].endswith("/key-reused")
        assert r.headers["Content-Type"].startswith("application/problem+json")
    async with http.post(url + "?x=1", data=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
                         headers=key) as r:
        assert r.status == 422
    assert provider.calls["chat"] == 1


async def test_configured_ignored_fields_replay(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, upstreams__openai={"ignore_fields": [
        {"match": "POST /v1/chat/*", "fields": ["metadata.sent_at", "messages.0.content"]}]})
    url = proxy.url + "/openai" + CHAT_PATH

    def body(sent_at: str, system: str, user: str) -> dict:
        return {"model": "m", "metadata": {"sent_at": sent_at},
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}

    async with http.post(url, json=body("10:00", "today is monday", "hi"), headers={"Idem-Run": "ig"}) as r:
        first = await r.read()
    async with http.post(url, json=body("10:05", "today is tuesday", "hi"),
                         headers={"Idem-Run": "ig", "Idem-Epoch": "1"}) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
        assert await r.read() == first
    async with http.post(url, json=body("10:05", "today is tuesday", "bye"),
                         headers={"Idem-Run": "ig", "Idem-Epoch": "1"}) as r:
        assert r.headers["Idempotent-Replayed"] == "false"
    assert provider.calls["chat"] == 2


def test_unordered_arrays_are_sets_and_nothing_else_is():
    """``ignore_order``: the named arrays compare as sets of members; every other array, and
    the members themselves, keep their order."""
    def fp(value: dict, unordered=("include", "tools.*.tags")) -> str:
        return fingerprint("POST", "openai", "/v1/responses", json.dumps(value).encode(), "application/json",
                           unordered=unordered)

    base = {"include": ["reasoning.encrypted_content", "message.output_text.logprobs", {"b": 1, "a": [2, 1]}],
            "tools": [{"name": "t", "tags": ["x", "y"]}], "input": ["first", "second"]}
    reordered = {**base, "include": [base["include"][2], base["include"][0], base["include"][1]],
                 "tools": [{"tags": ["y", "x"], "name": "t"}]}
    assert fp(base) == fp(reordered)
    assert fp(base, unordered=()) != fp(reordered, unordered=())          # off unless configured
    assert fp(base) != fp({**base, "input": ["second", "first"]})         # other arrays keep order
    assert fp(base) != fp({**base, "include": base["include"][:2]})       # a member less
    assert fp(base) != fp({**base, "include": base["include"] + [base["include"][0]]})  # a member twice
    assert fp(base) != fp({**base, "include": [*base["include"][:2], {"a": [1, 2], "b": 1}]})  # members' own order
    assert fp({"include": "one"}) == fp({"include": "one"})              # not an array: left as it is
    assert canonical_json(b'{"include":["b","a"]}', unordered=["include"]) == b'{"include":["a","b"]}'
    assert canonical_json(b'{"include":["b","a"]}', ignore=["include"], unordered=["include"]) == b"{}"


async def test_configured_ignore_order_replays_a_reordered_set(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, upstreams__openai={"ignore_order": [
        {"match": "POST /v1/responses", "fields": ["include"]}]})
    url = proxy.url + "/openai/v1/responses"

    def body(include: list[str]) -> dict:
        return {"model": "m", "input": "hi", "include": include}

    async with http.post(url, json=body(["a.b", "c.d"]), headers={"Idem-Run": "io"}) as r:
        assert r.headers["Idempotent-Replayed"] == "false"
        first = await r.read()
    async with http.post(url, json=body(["c.d", "a.b"]), headers={"Idem-Run": "io", "Idem-Epoch": "1"}) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
        assert await r.read() == first
    async with http.post(url, json=body(["c.d"]), headers={"Idem-Run": "io", "Idem-Epoch": "1"}) as r:
        assert r.headers["Idempotent-Replayed"] == "false"
    # the rule is per path: chat completions' arrays keep their order
    chat = proxy.url + "/openai" + CHAT_PATH
    for epoch, include in enumerate((["a.b", "c.d"], ["c.d", "a.b"])):
        async with http.post(chat, json=body(include), headers={"Idem-Run": "io2", "Idem-Epoch": str(epoch)}) as r:
            assert r.headers["Idempotent-Replayed"] == "false"
    assert provider.calls["responses"] == 2 and provider.calls["chat"] == 2


async def test_odd_json_through_the_proxy_is_recorded_and_never_replayed_for_another(make_proxy, store_url,
                                                                                    provider, http):
    proxy = await make_proxy(store_url)
    url = proxy.url + "/raw/echo/odd"
    pairs = [(b"[" * 1000 + b"]" * 1000, b"[" * 999 + b"]" * 999),
             (b'{"s": "\\ud800"' + LONG_ID, b'{"s": "\\ud801"' + LONG_ID),
             (b'{"n": NaN' + LONG_ID, b'{"n": null' + LONG_ID),
             (b'{"a": 1, "a": 2}', b'{"a": 2}')]
    for i, (first, other) in enumerate(pairs):
        headers = {"Content-Type": "Application/JSON; charset=utf-8", "Idempotency-Key": f"odd-{i}"}
        async with http.post(url, data=first, headers=headers) as r:
            assert r.status == 200, await r.text()
            answer = await r.read()
        async with http.post(url, data=first, headers=headers) as r:
            assert (r.status, r.headers["Idempotent-Replayed"], await r.read()) == (200, "true", answer)
        async with http.post(url, data=other, headers=headers) as r:
            await problem(r, "key-reused", 422)
    assert provider.calls["echo"] == len(pairs)
