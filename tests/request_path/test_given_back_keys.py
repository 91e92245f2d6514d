"""A key the upstream's status gives back (429, 408, 409, 425; a 5xx under ``on_ambiguous =
"retry"``) is free before the agent reads that status (docs/concepts.md, "Which outcomes are
recorded"). SDKs retry the moment they read a 429's status line, with its body unread: if the
key were still claimed, the retry of a derived-key call would take the next occurrence, every
derived key after it would shift, and the restarted attempt would pay for the step again."""

from __future__ import annotations

import asyncio

import pytest

from scripted_upstream import ScriptedUpstream, answer

CREDENTIAL = {"Authorization": "Bearer sk-agent"}


def limited_then_served(status: int):
    """The first call: a chunked ``status`` whose body trickles for a second; later calls: 200."""
    async def script(request, writer):
        if not getattr(script, "limited", False):
            script.limited = True
            writer.write(b"HTTP/1.1 %d Busy\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"err\r\n" % status)
            await writer.drain()
            await asyncio.sleep(1.0)
            writer.write(b"3\r\nor\"}\r\n0\r\n\r\n")
        else:
            writer.write(answer('{"charged": true}'))
    return script


async def status_line(url: str, target: str) -> bytes:
    """Send a POST and read only the answer's status line, then hang up, as an SDK does when
    it retries on the status alone."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {target} HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer sk-agent\r\n"
                 f"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}".encode())
    line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    return line


@pytest.mark.parametrize("status, kind", [(429, "tool"), (503, "model")], ids=["429", "503-retry"])
async def test_a_retry_on_the_status_line_keeps_the_derived_keys(make_proxy, store_url, http, status, kind):
    upstream = ScriptedUpstream({"charge": limited_then_served(status)})
    url = await upstream.start()
    try:
        proxy = await make_proxy(store_url, upstreams__shop={"url": url, "kind": kind, "on_ambiguous": "retry"})
        first = await status_line(proxy.url, "/runs/r1/epochs/0/shop/charge")
        assert first.startswith(b"HTTP/1.1 %d" % status), first
        # the retry, at once: the first answer's body is still on its way from the upstream
        async with http.post(f"{proxy.url}/runs/r1/epochs/0/shop/charge", data=b"{}",
                             headers={**CREDENTIAL, "Content-Type": "application/json"}) as r:
            assert (r.status, r.headers["Idempotent-Replayed"]) == (200, "false")
        # the restarted attempt's first charge is the one the retry recorded
        async with http.post(f"{proxy.url}/runs/r1/epochs/1/shop/charge", data=b"{}",
                             headers={**CREDENTIAL, "Content-Type": "application/json"}) as r:
            assert (r.status, r.headers["Idempotent-Replayed"]) == (200, "true")
            assert await r.read() == b'{"charged": true}'
        assert upstream.executed("charge") == 2
    finally:
        await upstream.close()
