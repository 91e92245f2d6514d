"""Compressed request bodies (docs/guarantees.md): a body goes upstream byte for byte
with its Content-Encoding, the fingerprint and the size cap read its decoded content, and a
body that cannot be decoded is a 400 problem+json that changes nothing. Both ends are raw
sockets, so the test sees the bytes the upstream received, not a library's decoding of them."""

from __future__ import annotations

import gzip
import logging
import zlib

import orjson
import pytest

from conftest import proxy_sections
from rawhttp import PROBLEM_TYPE_BASE, exchange
from scripted_upstream import ScriptedUpstream, replying

JSON = {"Content-Type": "application/json"}
CONTENT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def ok(_target: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"


@pytest.fixture
async def raw_upstream():
    upstream = ScriptedUpstream(default=replying(ok))
    await upstream.start()
    yield upstream
    await upstream.close()


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


# name: (Content-Encoding, the body as sent, its content), for every coding the proxy reads
ENCODED = {"gzip": ("gzip", gzip.compress(CONTENT), CONTENT),
           "x-gzip": ("x-gzip", gzip.compress(CONTENT), CONTENT),
           "deflate-zlib": ("deflate", zlib.compress(CONTENT), CONTENT),
           "deflate-bare": ("deflate", raw_deflate(CONTENT), CONTENT),
           "gzip-two-members": ("gzip", gzip.compress(CONTENT[:20]) + gzip.compress(CONTENT[20:]), CONTENT),
           "gzip-then-deflate": ("gzip, deflate", zlib.compress(gzip.compress(CONTENT)), CONTENT),
           "identity-then-gzip": ("identity, gzip", gzip.compress(CONTENT), CONTENT),
           "nothing-in-gzip": ("deflate, gzip", gzip.compress(b""), b"")}  # an inner coding of nothing
# What cannot be decoded: malformed, cut short, followed by stray bytes, or a coding not read
UNDECODABLE = {"gzip-malformed": ("gzip", b"\x1f\x8bnot gzip at all"),
               "gzip-no-trailer": ("gzip", gzip.compress(CONTENT)[:-4]),
               "gzip-cut": ("gzip", gzip.compress(CONTENT)[:25]),
               "gzip-then-junk": ("gzip", gzip.compress(CONTENT) + b"junk"),
               "deflate-malformed": ("deflate", b"\x78\x9cnot deflate"),
               "deflate-cut": ("deflate", zlib.compress(CONTENT)[:-6]),
               "deflate-then-junk": ("deflate", zlib.compress(CONTENT) + b"x"),
               "br": ("br", b"\x0b\x02\x80hello\x03"), "zstd": ("gzip, zstd", gzip.compress(CONTENT))}


def sent(upstream: ScriptedUpstream, index: int = -1) -> tuple[dict[bytes, bytes], bytes]:
    """The headers (lower-case names) and body of a request the upstream received."""
    request = upstream.requests[index]
    lines = request.head.rstrip(b"\r\n").split(b"\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}, request.body


def status_of(head: bytes) -> int:
    return int(head.split(b" ", 2)[1])


def assert_problem(head: bytes, body: bytes, slug: str, status: int) -> None:
    assert status_of(head) == status, (head, body)
    assert b"\r\nContent-Type: application/problem+json" in head, head
    assert orjson.loads(body)["type"] == PROBLEM_TYPE_BASE + slug


async def proxy_to(make_proxy, store_url: str, upstream: ScriptedUpstream, **extra):
    return await make_proxy(store_url, upstreams__packed={"url": upstream.url, "kind": "tool"}, **extra)


@pytest.mark.parametrize("coding, body, content", ENCODED.values(), ids=ENCODED)
async def test_a_compressed_body_goes_upstream_as_received(make_proxy, sqlite_url, raw_upstream, coding, body,
                                                           content):
    """... in a passthrough and in a recorded call; its content sent plain is that call."""
    proxy = await proxy_to(make_proxy, sqlite_url, raw_upstream)
    keyed = {"Idempotency-Key": "one-call"}
    for headers in ({"Idem-Policy": "passthrough"}, keyed):
        head, answer = await exchange(proxy.url, "POST", "/packed/send", {**JSON, **headers,
                                                                          "Content-Encoding": coding}, body)
        assert status_of(head) == 200, (head, answer)
        fields, received = sent(raw_upstream)
        assert received == body
        assert fields[b"content-encoding"] == coding.encode()
        assert fields[b"content-length"] == str(len(body)).encode()
    head, _ = await exchange(proxy.url, "POST", "/packed/send", {**JSON, **keyed}, content)
    assert status_of(head) == 200 and b"\r\nIdempotent-Replayed: true\r\n" in head, head
    assert len(raw_upstream.requests) == 2


async def test_the_fingerprint_reads_the_decoded_content_on_every_store(make_proxy, store_url, raw_upstream):
    """The same content compressed or plain (or with its keys in another order) is the same
    call; other content under the same key is not."""
    proxy = await proxy_to(make_proxy, store_url, raw_upstream)
    keyed = {**JSON, "Idempotency-Key": "one-call"}
    packed = gzip.compress(CONTENT)
    head, _ = await exchange(proxy.url, "POST", "/packed/send", {**keyed, "Content-Encoding": "gzip"}, packed)
    assert status_of(head) == 200 and b"\r\nIdempotent-Replayed: false\r\n" in head, head
    assert sent(raw_upstream)[1] == packed

    reordered = orjson.dumps(dict(reversed(orjson.loads(CONTENT).items())))
    for encoding, body in (("identity", reordered), ("deflate", zlib.compress(CONTENT))):
        head, _ = await exchange(proxy.url, "POST", "/packed/send", {**keyed, "Content-Encoding": encoding}, body)
        assert status_of(head) == 200 and b"\r\nIdempotent-Replayed: true\r\n" in head, head
    head, body = await exchange(proxy.url, "POST", "/packed/send", {**keyed, "Content-Encoding": "gzip"},
                                gzip.compress(CONTENT.replace(b"hi", b"ho")))
    assert_problem(head, body, "key-reused", 422)
    assert len(raw_upstream.requests) == 1


@pytest.mark.parametrize("coding, body", UNDECODABLE.values(), ids=UNDECODABLE)
async def test_an_undecodable_body_is_refused_with_400(make_proxy, sqlite_url, raw_upstream, caplog,
                                                       coding, body):
    proxy = await proxy_to(make_proxy, sqlite_url, raw_upstream)
    caplog.set_level(logging.INFO)
    for headers in ({"Idem-Policy": "passthrough"}, {"Idempotency-Key": "k"}, {}):
        head, answer = await exchange(proxy.url, "POST", "/packed/send",
                                      {**JSON, **headers, "Content-Encoding": coding}, body)
        assert_problem(head, answer, "undecodable-body", 400)
    assert raw_upstream.requests == []
    troubles = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not troubles, [r.getMessage() for r in troubles]


async def test_a_refused_body_claims_nothing_on_every_store(make_proxy, store_url, raw_upstream):
    proxy = await proxy_to(make_proxy, store_url, raw_upstream)
    keyed = {**JSON, "Idempotency-Key": "after-refusal", "Content-Encoding": "gzip"}
    head, body = await exchange(proxy.url, "POST", "/packed/send", keyed, gzip.compress(CONTENT)[:-4])
    assert_problem(head, body, "undecodable-body", 400)
    head, _ = await exchange(proxy.url, "POST", "/packed/send", keyed, gzip.compress(CONTENT))
    # the key was left free: a claim left behind would make this wait, then 409 in-flight
    assert status_of(head) == 200 and b"\r\nIdempotent-Replayed: false\r\n" in head, head
    assert len(raw_upstream.requests) == 1


async def test_max_request_bytes_holds_for_the_decoded_content(make_proxy, sqlite_url, raw_upstream):
    """Exactly the limit decoded passes (as received); one byte more is 413, however small it
    came: a 50 MB bomb of ~50 KB is decoded no further than the limit."""
    limit = 64 * 1024
    proxy = await proxy_to(make_proxy, sqlite_url, raw_upstream, server={"max_request_bytes": limit})
    passthrough = {"Idem-Policy": "passthrough", "Content-Encoding": "gzip"}
    at_limit = gzip.compress(b"a" * limit)
    head, _ = await exchange(proxy.url, "POST", "/packed/send", passthrough, at_limit)
    assert status_of(head) == 200, head
    assert sent(raw_upstream)[1] == at_limit
    for content in (b"a" * (limit + 1), bytes(50 << 20)):
        packed = gzip.compress(content, compresslevel=9)
        assert len(packed) < limit
        head, body = await exchange(proxy.url, "POST", "/packed/send", passthrough, packed)
        assert_problem(head, body, "too-large", 413)
    assert len(raw_upstream.requests) == 1


async def test_the_runs_api_reads_compressed_bodies_and_refuses_broken_ones(make_proxy, sqlite_url, raw_upstream):
    proxy = await proxy_to(make_proxy, sqlite_url, raw_upstream)
    packed = {**JSON, "Content-Encoding": "gzip"}
    head, body = await exchange(proxy.url, "POST", "/runs/r1", packed, gzip.compress(b'{"timeout_s": 30}'))
    assert status_of(head) == 201, (head, body)
    assert orjson.loads(body)["timeout_s"] == 30
    head, _ = await exchange(proxy.url, "POST", "/runs/r1/heartbeat", packed, gzip.compress(b'{"epoch": 0}'))
    assert status_of(head) == 200, head
    for action in ("heartbeat", "attach", "complete"):
        head, body = await exchange(proxy.url, "POST", f"/runs/r1/{action}", packed, b"\x1f\x8b broken")
        assert_problem(head, body, "undecodable-body", 400)


@pytest.mark.slow  # a proxy process: `idemproxy serve` makes its connections itself (server.Gate)
async def test_idemproxy_serve_forwards_compressed_bodies_as_received(proxy_process, provider, sqlite_url,
                                                                     raw_upstream):
    proc = proxy_process(proxy_sections(provider.url, sqlite_url,
                                        upstreams__packed={"url": raw_upstream.url, "kind": "tool"}))
    packed = gzip.compress(CONTENT)
    head, _ = await exchange(proc.url, "POST", "/packed/send", {**JSON, "Idempotency-Key": "k",
                                                               "Content-Encoding": "gzip"}, packed)
    assert status_of(head) == 200, head
    assert sent(raw_upstream)[1] == packed
    head, body = await exchange(proc.url, "POST", "/packed/send", {**JSON, "Content-Encoding": "gzip"},
                                packed[:-4])
    assert_problem(head, body, "undecodable-body", 400)
    assert len(raw_upstream.requests) == 1
