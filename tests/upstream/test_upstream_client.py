"""The upstream client (proxy/upstream/) against raw upstreams on real sockets: each
upstream here answers with the exact bytes a test gives it, so framing, keep-alive and
failures are seen as a proxy meets them, not as a well-behaved server would send them."""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import struct
import subprocess
import time

import pytest

from idemproxy.proxy.upstream.connection import Connection
from idemproxy.proxy.upstream.errors import (ConnectTimeout, HeadTooLarge, NotSent, UnsendableRequest, UpstreamError,
                                             UpstreamTimeout)
from idemproxy.proxy.upstream.pool import BODYLESS_METHODS, UpstreamPool

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def answer_after(seconds: float, answer: bytes = OK):
    async def late(writer):
        await asyncio.sleep(seconds)
        writer.write(answer)
    return late


async def stream_then_silence(writer):
    """The head of an event stream (no length, not chunked: ended by the close), then nothing."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
    await asyncio.sleep(5)


class RawUpstream:
    """Reads one request head (and its Content-Length body) at a time and answers each with
    the next of ``answers``: bytes, or a callable given the writer (for slow answers)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if callable(answer):
                    await answer(writer)
                else:
                    writer.write(answer)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client went, or the test ended mid-answer
        finally:
            writer.close()

    async def close(self) -> None:
        self.server.close()


@pytest.fixture
async def upstream():
    started = []

    async def start(*answers, **pool_settings) -> tuple[RawUpstream, UpstreamPool]:
        raw = RawUpstream(answers)
        url = await raw.start()
        pool = UpstreamPool(url, **{"max_connections": 4, "connect_timeout": 2.0, "read_timeout": 2.0,
                                    **pool_settings})
        started.append((raw, pool))
        return raw, pool
    yield start
    for raw, pool in started:
        await pool.close()
        await raw.close()


async def fetch(pool: UpstreamPool, method="POST", target="/v1/x", headers=(), body=b"{}", **options):
    resp = await pool.request(method, target, list(headers), body, **options)
    try:
        return resp.status, resp.headers, await resp.read()
    finally:
        resp.release()


async def test_a_connection_is_kept_alive_and_reused(upstream):
    raw, pool = await upstream(OK, OK, OK)
    for _ in range(3):
        status, headers, body = await fetch(pool)
        assert (status, headers["Content-Type"], body) == (200, "application/json", b"{}")
    assert raw.connections == 1
    first = raw.requests[0].decode()
    assert first.startswith("POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:")
    assert "Content-Length: 2\r\n\r\n{}" in first


async def test_a_chunked_answer_arrives_decoded_and_the_connection_stays_usable(upstream):
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    raw, pool = await upstream(chunked, OK)
    assert (await fetch(pool))[2] == b"hello world"
    assert (await fetch(pool))[2] == b"{}"
    assert raw.connections == 1


async def test_a_body_delimited_by_the_close_is_whole_and_the_connection_not_reused(upstream):
    raw, pool = await upstream(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\neverything until the end")
    assert (await fetch(pool))[2] == b"everything until the end"
    assert pool._open == 0 or not pool._idle


async def test_a_head_answer_announces_a_length_it_never_sends(upstream):
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"
    raw, pool = await upstream(head, OK)
    status, headers, body = await fetch(pool, "HEAD", body=b"")
    assert (status, headers["Content-Length"], body) == (200, "1000", b"")
    assert (await fetch(pool))[2] == b"{}"  # a new connection: the old one's parser waited for 1000 bytes
    assert raw.connections == 2
    assert b"Content-Length" not in raw.requests[0]


async def test_an_informational_answer_is_skipped_and_a_bodyless_status_has_no_body(upstream):
    raw, pool = await upstream(b"HTTP/1.1 100 Continue\r\n\r\n" + OK,
                               b"HTTP/1.1 204 No Content\r\n\r\n", OK)
    assert (await fetch(pool))[:1] == (200,)
    assert (await fetch(pool))[::2] == (204, b"")
    assert (await fetch(pool))[2] == b"{}"
    assert raw.connections == 1


async def test_a_smuggling_answer_is_refused(upstream):
    both = (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"0\r\n\r\n")
    _, pool = await upstream(both)
    with pytest.raises(UpstreamError) as caught:
        await fetch(pool)
    assert not isinstance(caught.value, NotSent)


async def test_bytes_after_the_answer_poison_the_connection(upstream):
    raw, pool = await upstream(OK + b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbad", OK)
    assert (await fetch(pool))[2] == b"{}"
    assert (await fetch(pool))[2] == b"{}"
    assert raw.connections == 2


async def test_a_line_break_in_a_header_is_refused_before_anything_is_sent(upstream):
    raw, pool = await upstream(OK)
    with pytest.raises(UnsendableRequest):  # a NotSent: a recorded call gives its key back
        await fetch(pool, headers=[("X-Evil", "a\r\nX-Injected: 1")])
    with pytest.raises(UnsendableRequest):
        await fetch(pool, target="/x HTTP/1.1\r\nX-Injected: 1\r\n\r\nGET /y")
    assert raw.connections == 0 and raw.requests == []


async def test_the_upstream_closing_before_its_answer_is_sent_not_never_sent(upstream):
    async def hang_up(writer):
        writer.close()
    _, pool = await upstream(hang_up)
    with pytest.raises(UpstreamError) as caught:
        await fetch(pool)
    assert not isinstance(caught.value, NotSent)


async def test_a_refused_connection_was_never_sent(unused_tcp_port):
    pool = UpstreamPool(f"http://127.0.0.1:{unused_tcp_port}", max_connections=2, connect_timeout=2.0,
                        read_timeout=2.0)
    with pytest.raises(NotSent):
        await fetch(pool)
    assert pool._open == 0
    await pool.close()


async def test_silence_longer_than_the_read_timeout_is_a_timeout(upstream):
    async def head_then_silence(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await asyncio.sleep(5)
    _, pool = await upstream(head_then_silence, read_timeout=0.3)
    resp = await pool.request("POST", "/", [], b"")
    try:
        assert await resp.readany() == b"abc"
        with pytest.raises(UpstreamTimeout):
            await resp.readany()
    finally:
        resp.release()
    await asyncio.sleep(0.05)  # the aborted connection's close is seen on the loop's next turns
    assert pool._open == 0


async def test_a_full_pool_makes_the_next_request_wait_then_time_out_unsent(upstream):
    raw, pool = await upstream(answer_after(0.5), OK, max_connections=1, connect_timeout=0.2)
    first = asyncio.create_task(fetch(pool))
    await asyncio.sleep(0.05)
    with pytest.raises(ConnectTimeout) as caught:
        await fetch(pool)
    assert isinstance(caught.value, NotSent) and isinstance(caught.value, UpstreamTimeout)
    assert (await first)[2] == b"{}"
    waiting = asyncio.create_task(fetch(pool))  # the slot is free again: served on the same connection
    assert (await waiting)[2] == b"{}"
    assert raw.connections == 1


async def test_a_waiting_request_gets_the_connection_released_before_its_timeout(upstream):
    raw, pool = await upstream(answer_after(0.2), OK, max_connections=1, connect_timeout=2.0)
    answers = await asyncio.gather(fetch(pool), fetch(pool))
    assert [a[2] for a in answers] == [b"{}", b"{}"]
    assert raw.connections == 1


async def test_a_large_streamed_body_arrives_whole_in_bounded_reads(upstream):
    big = bytes(range(256)) * 4096  # 1 MiB
    raw, pool = await upstream(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big, OK)
    resp = await pool.request("GET", "/big", [], b"")
    got = bytearray()
    try:
        while chunk := await resp.readany():
            got += chunk
            await asyncio.sleep(0)
    finally:
        resp.release()
    assert bytes(got) == big
    assert (await fetch(pool))[2] == b"{}"
    assert raw.connections == 1


async def test_a_large_body_read_whole_is_not_held_back(upstream):
    big = bytes(range(256)) * 4096  # 1 MiB: past the unread bytes at which a stream is paused
    _, pool = await upstream(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
    resp = await pool.request("GET", "/big", [], b"")
    await asyncio.sleep(0.2)  # all of it arrives before anyone reads
    try:
        assert await resp.read() == big
    finally:
        resp.release()


async def test_a_closed_answer_wakes_its_reader_and_frees_the_slot(upstream):
    _, pool = await upstream(stream_then_silence)
    resp = await pool.request("GET", "/events", [], b"")
    reader = asyncio.create_task(resp.readany())
    await asyncio.sleep(0.05)
    resp.close()
    with pytest.raises(UpstreamError):
        await reader
    await asyncio.sleep(0.05)
    assert pool._open == 0


async def test_closing_the_pool_closes_busy_connections_too(upstream):
    _, pool = await upstream(stream_then_silence)
    resp = await pool.request("GET", "/events", [], b"")
    reader = asyncio.create_task(resp.readany())
    await asyncio.sleep(0.05)
    await pool.close()
    with pytest.raises(UpstreamError):
        await reader
    assert pool._open == 0


async def test_the_base_path_host_and_url_credentials_go_upstream():
    raw = RawUpstream([OK])
    url = await raw.start()
    pool = UpstreamPool(url.replace("http://", "http://us%40er:p%3Ass@") + "/base/", max_connections=1,
                        connect_timeout=2.0, read_timeout=2.0)
    try:
        await fetch(pool, target="/v1/x?a=%2F", headers=[("Authorization", "Bearer agent")])
    finally:
        await pool.close()
        await raw.close()
    sent = raw.requests[0].decode()
    assert sent.startswith("POST /base/v1/x?a=%2F HTTP/1.1\r\n")
    assert "Bearer agent" not in sent
    assert "Authorization: Basic " + base64.b64encode(b"us@er:p:ss").decode() in sent


@pytest.fixture
def localhost_cert(tmp_path):
    """A self-signed certificate for ``localhost``, made by the openssl command."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True)
    return cert, key


async def test_an_https_upstream_is_verified_and_an_unverified_one_never_sent(localhost_cert, monkeypatch):
    cert, key = localhost_cert
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    raw = RawUpstream([OK, OK])
    raw.server = await asyncio.start_server(raw._serve, "127.0.0.1", 0, ssl=context)
    url = f"https://localhost:{raw.server.sockets[0].getsockname()[1]}"
    untrusted = UpstreamPool(url, max_connections=1, connect_timeout=2.0, read_timeout=2.0)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # OpenSSL's default trust, as an operator would set it
    trusted = UpstreamPool(url, max_connections=1, connect_timeout=2.0, read_timeout=2.0)
    try:
        assert (await fetch(trusted))[::2] == (200, b"{}")
        assert raw.requests[0].startswith(b"POST /v1/x HTTP/1.1\r\nHost: localhost:")
        with pytest.raises(NotSent):  # the certificate is not one the system trusts
            await fetch(untrusted)
        assert len(raw.requests) == 1
    finally:
        await trusted.close()
        await untrusted.close()
        await raw.close()


async def test_a_connection_left_paused_is_read_again_when_reused(upstream):
    big = b"x" * 100_000  # past the unread bytes at which reading pauses
    raw, pool = await upstream(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big, OK,
                               max_connections=1)
    resp = await pool.request("GET", "/big", [], b"")
    await asyncio.sleep(0.2)  # all of it in, none of it read: the relay stopped (its agent left)
    resp.release()
    assert (await fetch(pool))[2] == b"{}"
    assert raw.connections == 1


async def test_the_start_of_a_second_answer_poisons_the_connection(upstream):
    raw, pool = await upstream(OK + b"HTTP/1.1 500 Oops\r\nX-Stale: ", OK)
    assert (await fetch(pool))[2] == b"{}"
    status, headers, body = await fetch(pool)
    assert (status, body, "X-Stale" in headers) == (200, b"{}", False)
    assert raw.connections == 2


async def test_a_slot_handed_to_a_leaving_waiter_goes_to_the_next(upstream):
    raw, pool = await upstream(OK, OK, OK, max_connections=1, connect_timeout=1.0)
    first = await pool.request("POST", "/", [], b"")
    await first.read()
    leaving, staying = asyncio.create_task(fetch(pool)), asyncio.create_task(fetch(pool))
    await asyncio.sleep(0.05)
    first.release()  # wakes `leaving`...
    leaving.cancel()  # ...which goes in the same turn
    assert (await asyncio.wait_for(staying, 0.5))[2] == b"{}"


async def test_a_connect_cancelled_once_made_frees_its_slot_once(upstream, monkeypatch):
    raw, pool = await upstream(OK, OK, max_connections=1)
    made = Connection.connection_made

    def made_then_cancelled(conn, transport):  # the cancel lands before create_connection returns
        made(conn, transport)
        task.cancel()
    monkeypatch.setattr(Connection, "connection_made", made_then_cancelled)
    task = asyncio.create_task(fetch(pool))
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.setattr(Connection, "connection_made", made)
    await asyncio.sleep(0.05)
    assert pool._open == 0
    assert (await fetch(pool))[2] == b"{}"


async def test_a_reset_is_no_end_of_a_body_delimited_by_the_close(upstream):
    async def reset_mid_body(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: part")
        await asyncio.sleep(0.1)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # lingering 0 s: a reset, not a close
    _, pool = await upstream(reset_mid_body)
    with pytest.raises(UpstreamError):
        await fetch(pool)


async def test_a_missing_last_chunk_is_no_end_of_a_body(upstream):
    async def cut_chunked(writer):  # chunked is the last coding across two fields
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n")
        await asyncio.sleep(0.1)
        writer.close()
    _, pool = await upstream(cut_chunked)
    with pytest.raises(UpstreamError):
        await fetch(pool)


async def close_without_answer(writer):
    writer.close()


async def test_a_passthrough_get_on_a_reused_connection_that_closed_is_sent_again(upstream):
    raw, pool = await upstream(OK, close_without_answer, OK, OK, close_without_answer)
    assert (await fetch(pool, "GET", body=b"", may_resend=True))[2] == b"{}"
    # its close crossed our request: sent again (RFC 9110 §9.2.2)
    assert (await fetch(pool, "GET", body=b"", may_resend=True))[2] == b"{}"
    assert (len(raw.requests), raw.connections) == (3, 2)
    assert (await fetch(pool, may_resend=True))[2] == b"{}"
    with pytest.raises(UpstreamError) as caught:  # a POST is not sent twice, even in passthrough
        await fetch(pool, may_resend=True)
    assert not isinstance(caught.value, NotSent)


@pytest.mark.parametrize("method", ["PUT", "DELETE", "GET"])
async def test_a_recorded_call_is_never_sent_twice_whatever_its_method(upstream, method):
    """The upstream acts, then closes the reused connection without answering: the pool
    says so (sent, outcome unknown) instead of acting twice (docs/guarantees.md#sending-once)."""
    raw, pool = await upstream(OK, close_without_answer, OK)
    assert (await fetch(pool, method, body=b""))[0] == 200
    with pytest.raises(UpstreamError) as caught:
        await fetch(pool, method, body=b"")
    assert not isinstance(caught.value, NotSent)
    assert len(raw.requests) == 2


async def test_a_silent_upstream_is_not_asked_twice(upstream):
    raw, pool = await upstream(OK, answer_after(5), OK, read_timeout=0.3)
    assert (await fetch(pool, "GET", body=b""))[2] == b"{}"
    with pytest.raises(UpstreamTimeout):  # a timeout is no crossed close: one wait, not two
        await fetch(pool, "GET", body=b"")
    assert len(raw.requests) == 2


# -- the upstream boundary (docs/guarantees.md): connections per tenant, poisoned connections, heads --

def answer_twice(first: bytes, second: bytes, after: float = 0.08):
    """A broken or malicious upstream: a second, unasked-for answer ``after`` the first."""
    async def twice(writer):
        writer.write(first)
        await asyncio.sleep(after)
        writer.write(second)
    return twice


def ok(text: str) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text.encode())


async def test_a_connection_is_never_shared_between_tenants(upstream):
    raw, pool = await upstream(OK, OK, OK, OK)
    await fetch(pool, tenant="alice")
    await fetch(pool, tenant="bob")  # alice's idle connection is not bob's
    await fetch(pool, tenant="alice")
    await fetch(pool, tenant="bob")
    assert raw.connections == 2


@pytest.mark.parametrize("max_connections", [1, 4])
async def test_a_late_second_answer_never_reaches_another_tenant(upstream, max_connections):
    """A connection belongs to one tenant: the upstream answers alice's call twice, 80 ms
    apart; bob's call, sent in between, gets its own answer from a connection of his own."""
    raw, pool = await upstream(answer_twice(ok("alice"), ok("stray")), ok("bob"),
                               max_connections=max_connections)
    assert (await fetch(pool, tenant="alice"))[2] == b"alice"
    assert (await fetch(pool, tenant="bob"))[2] == b"bob"  # at once, before the stray answer
    await asyncio.sleep(0.2)
    assert raw.connections == 2


async def test_a_tenant_at_the_cap_closes_another_tenants_idle_connection(upstream):
    raw, pool = await upstream(OK, OK, OK, max_connections=1)
    await fetch(pool, tenant="alice")
    await fetch(pool, tenant="bob")
    await fetch(pool, tenant="alice")
    assert raw.connections == 3 and pool._open == 1


async def test_bytes_on_an_idle_connection_poison_it(upstream):
    raw, pool = await upstream(answer_twice(ok("first"), ok("stray"), after=0.05), ok("second"))
    assert (await fetch(pool, tenant="alice"))[2] == b"first"
    await asyncio.sleep(0.2)  # the stray answer arrives while the connection is idle
    assert (await fetch(pool, tenant="alice"))[2] == b"second"
    assert raw.connections == 2


@pytest.mark.parametrize("method", sorted(BODYLESS_METHODS - {"HEAD"}))
async def test_a_connection_that_carried_a_body_the_upstream_may_ignore_is_not_reused(upstream, method):
    """No CL.0 desync: an upstream that ignores a GET's body reads it as a request of
    its own; the connection is closed after the GET's answer, so that answer reaches nobody."""
    raw, pool = await upstream(OK, OK)
    assert (await fetch(pool, method, body=b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"))[0] == 200
    assert (await fetch(pool))[0] == 200
    assert raw.connections == 2


async def test_a_bodyless_get_keeps_its_connection(upstream):
    raw, pool = await upstream(OK, OK)
    await fetch(pool, "GET", body=b"")
    await fetch(pool, "GET", body=b"")
    assert raw.connections == 1


async def test_an_endless_head_line_is_refused_in_bounded_memory(upstream):
    async def endless(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: ")
        for _ in range(400):  # 400 x 64 KiB = 25 MiB, if it were all read
            writer.write(b"a" * 65536)
            await writer.drain()
    _, pool = await upstream(endless, max_head_bytes=64 * 1024)
    started = time.monotonic()
    with pytest.raises(HeadTooLarge, match="over 65536 bytes"):
        await fetch(pool)
    assert time.monotonic() - started < 1.5


async def test_a_head_with_too_many_fields_is_refused(upstream):
    fields = b"".join(b"X-F%d: v\r\n" % i for i in range(300))
    _, pool = await upstream(b"HTTP/1.1 200 OK\r\n" + fields + b"Content-Length: 2\r\n\r\n{}")
    with pytest.raises(HeadTooLarge, match="over 256 fields"):
        await fetch(pool)


async def test_a_head_just_under_the_caps_with_its_body_in_the_same_read_is_taken(upstream):
    fields = b"".join(b"X-F%d: %s\r\n" % (i, b"v" * 200) for i in range(250))  # ~53 KiB
    body = b"x" * 60000  # arrives with the head: not counted as head
    raw, pool = await upstream(b"HTTP/1.1 200 OK\r\n" + fields + b"Content-Length: 60000\r\n\r\n" + body)
    status, headers, got = await fetch(pool)
    assert (status, len(headers), got) == (200, 251, body)


async def test_idle_connections_expire_after_keepalive_timeout(upstream):
    raw, pool = await upstream(OK, OK, OK, keepalive_timeout=0.3)
    await fetch(pool)
    await fetch(pool)  # within 0.3 s: reused
    await asyncio.sleep(0.4)
    await fetch(pool)
    assert raw.connections == 2


async def test_keepalive_timeout_zero_never_reuses(upstream):
    raw, pool = await upstream(OK, OK, keepalive_timeout=0)
    await fetch(pool)
    await fetch(pool)
    assert raw.connections == 2


async def test_the_servers_keep_alive_timeout_is_honoured_with_a_margin(upstream):
    """``Keep-Alive: timeout=1.5`` (Node sends timeout=5): reused within 0.5 s, not after."""
    hinted = b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=1.5, max=100\r\nContent-Length: 2\r\n\r\n{}"
    raw, pool = await upstream(hinted, hinted, hinted, keepalive_timeout=30)
    await fetch(pool)
    await fetch(pool)
    assert raw.connections == 1
    await asyncio.sleep(0.6)
    await fetch(pool)
    assert raw.connections == 2


async def test_a_pool_keeps_nothing_for_tenants_without_idle_connections(upstream):
    raw, pool = await upstream(*[OK] * 20, max_connections=2)
    for n in range(20):
        await fetch(pool, tenant=f"t{n}")
    assert len(pool._idle) <= 2 and len(pool._idle_order) <= 2 and pool._open <= 2
