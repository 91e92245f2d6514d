"""Header bytes pass as received (docs/guarantees.md): an upstream's header value
with obs-text (latin-1 ``café``, 0xFF, 0x80) or UTF-8 reaches the agent byte for byte, in a
passthrough, in the answer that records it, and in every replay (from the journal, from the
answer cache, from a restarted attempt's journal in memory), whole or streamed, on every store.
Both ends are raw sockets: the test compares bytes, never decoded strings."""

from __future__ import annotations

import orjson
import pytest

from rawhttp import exchange
from scripted_upstream import ScriptedUpstream, replying

# obs-text (RFC 9110 §5.5): not UTF-8. Before the fix, recording failed ("surrogates not
# allowed") and a passthrough lost the bytes.
OBS = b"caf\xe9 \xff\x80 na\xefve"
UTF8 = "caf\u00e9 \u2603".encode()
WHOLE = b'{"ok": true}'
EVENTS = b"data: {\"n\": 1}\n\ndata: {\"n\": 2}\n\ndata: [DONE]\n\n"


def answer(target: bytes) -> bytes:
    """``/stream``: an event stream in chunks; ``/fail``: a 503; anything else: a JSON body
    with its length. All carry the two header values above."""
    if target.endswith(b"/fail"):
        return b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n"
    fields = b"X-Obs: " + OBS + b"\r\nX-Utf8: " + UTF8 + b"\r\n"
    if target.endswith(b"/stream"):
        events = [event + b"\n\n" for event in EVENTS.split(b"\n\n")[:-1]]
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(event), event) for event in events)
        return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + fields +
                b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + fields +
            b"Content-Length: %d\r\n\r\n" % len(WHOLE) + WHOLE)


@pytest.fixture
async def raw_upstream():
    upstream = ScriptedUpstream(default=replying(answer))
    await upstream.start()
    yield upstream
    await upstream.close()


def assert_exact(head: bytes, replayed: str) -> None:
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert b"\r\nX-Obs: " + OBS + b"\r\n" in head, head
    assert b"\r\nX-Utf8: " + UTF8 + b"\r\n" in head, head
    assert b"\r\nIdempotent-Replayed: " + replayed.encode() + b"\r\n" in head, head


async def proxy_to(make_proxy, store_url: str, upstream: ScriptedUpstream):
    return await make_proxy(store_url, upstreams__obs={"url": upstream.url, "kind": "tool"})


async def test_a_passthrough_passes_header_bytes_exactly(make_proxy, sqlite_url, raw_upstream):
    proxy = await proxy_to(make_proxy, sqlite_url, raw_upstream)
    for target in ("/obs/read", "/obs/stream"):
        head, body = await exchange(proxy.url, "GET", target)
        assert head.startswith(b"HTTP/1.1 200 ") and b"\r\nX-Obs: " + OBS + b"\r\n" in head, head
        assert b"\r\nX-Utf8: " + UTF8 + b"\r\n" in head
        assert body == (EVENTS if target.endswith("stream") else WHOLE)


@pytest.mark.parametrize("target, expected", [("/obs/send", WHOLE), ("/obs/stream", EVENTS)], ids=["whole", "stream"])
async def test_recorded_header_bytes_replay_exactly_on_every_store(make_proxy, store_url, raw_upstream,
                                                                   target, expected):
    proxy = await proxy_to(make_proxy, store_url, raw_upstream)
    keyed = {"Idempotency-Key": "obs-1", "Content-Type": "application/json"}
    head, body = await exchange(proxy.url, "POST", target, keyed, b'{"a": 1}')
    assert_exact(head, "false")
    assert body == expected
    head, body = await exchange(proxy.url, "POST", target, keyed, b'{"a": 1}')  # answered from memory
    assert_exact(head, "true")
    assert body == expected
    assert proxy.proxy.metrics.replayed_from_cache == 1

    fresh = await proxy_to(make_proxy, store_url, raw_upstream)  # nothing in memory: the journal's copy
    head, body = await exchange(fresh.url, "POST", target, keyed, b'{"a": 1}')
    assert_exact(head, "true")
    assert body == expected
    assert len(raw_upstream.requests) == 1  # recorded once, never sent again


async def test_a_restarted_attempt_replays_header_bytes_from_memory(make_proxy, store_url, raw_upstream):
    proxy = await proxy_to(make_proxy, store_url, raw_upstream)
    json = {"Content-Type": "application/json"}
    for target in ("/runs/r1/epochs/0/obs/send", "/runs/r1/epochs/0/obs/stream"):
        head, _ = await exchange(proxy.url, "POST", target, json, b'{"step": 1}')
        assert_exact(head, "false")
    for target, expected in (("/runs/r1/epochs/1/obs/send", WHOLE), ("/runs/r1/epochs/1/obs/stream", EVENTS)):
        head, body = await exchange(proxy.url, "POST", target, json, b'{"step": 1}')
        assert_exact(head, "true")
        assert body == expected
    assert proxy.proxy.metrics.replayed_from_memory == 2
    assert len(raw_upstream.requests) == 2


ADMIN = {"Authorization": "Bearer test-admin-token"}


async def test_operators_read_and_write_header_values_as_text(make_proxy, store_url, raw_upstream):
    """The admin API shows a kept value as its bytes read as UTF-8 (U+FFFD for obs-text), and an
    operator's answer for a quarantined key replays its values as their UTF-8 bytes."""
    proxy = await proxy_to(make_proxy, store_url, raw_upstream)
    json = {"Content-Type": "application/json"}
    head, _ = await exchange(proxy.url, "POST", "/runs/op/obs/send", {**json, "Idempotency-Key": "seen"}, b"{}")
    assert_exact(head, "false")
    _, shown = await exchange(proxy.url, "GET", "/admin/runs/op?bodies=1", ADMIN)
    (step,) = [s for s in orjson.loads(shown)["steps"] if s["key"] == "seen"]
    assert ["X-Obs", "caf\ufffd \ufffd\ufffd na\ufffdve"] in step["headers"]
    assert ["X-Utf8", "caf\u00e9 \u2603"] in step["headers"]

    keyed = {**json, "Idempotency-Key": "unknown"}
    head, _ = await exchange(proxy.url, "POST", "/runs/op/obs/fail", keyed, b"{}")
    assert head.startswith(b"HTTP/1.1 503 ")
    _, problem = await exchange(proxy.url, "POST", "/runs/op/obs/fail", keyed, b"{}")
    kid = orjson.loads(problem)["kid"]
    typed = [["Content-Type", "text/plain"], ["X-Latin", "caf\u00e9"], ["X-Snow", "caf\u00e9 \u2603"]]
    resolution = orjson.dumps({"action": "respond", "status": 200, "body": "done", "headers": typed})
    head, _ = await exchange(proxy.url, "POST", f"/admin/journal/{kid}/resolve", {**ADMIN, **json}, resolution)
    assert head.startswith(b"HTTP/1.1 200 "), head
    head, body = await exchange(proxy.url, "POST", "/runs/op/obs/fail", keyed, b"{}")
    assert head.startswith(b"HTTP/1.1 200 ") and body == b"done", head
    assert b"\r\nX-Latin: caf\xc3\xa9\r\n" in head and b"\r\nX-Snow: caf\xc3\xa9 \xe2\x98\x83\r\n" in head, head
    _, entry = await exchange(proxy.url, "GET", f"/admin/journal/{kid}", ADMIN)
    assert orjson.loads(entry)["headers"] == typed
    assert len(raw_upstream.requests) == 2
