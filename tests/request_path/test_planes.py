"""The two planes (data_plane.py, control_plane.py): the dispatcher hands proxied calls to the
data plane past aiohttp's router, and no answer changes for it.

Every target below is sent over a raw socket to two servers of one configuration: one that
dispatches, as ``idemproxy serve`` runs, and one where the control plane's router decides
everything (handing what it finds to be a proxied call to the data plane). Both must answer
alike, refusals included.
"""

from __future__ import annotations

import orjson
import pytest
from aiohttp.test_utils import TestServer

from idemproxy.proxy.cli.serving import build_app
from idemproxy.proxy.data_plane import proxied_target
from rawhttp import raw_request

CHAT = orjson.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
UPSTREAMS = {"openai": None, "tools": None}


@pytest.fixture
async def two_ways(make_proxy, sqlite_url):
    """(dispatched, routed only): two servers on one store and configuration."""
    dispatched = await make_proxy(sqlite_url)
    routed = TestServer(build_app(dispatched.settings, supervise=False), host="127.0.0.1")
    await routed.start_server()
    yield dispatched.url, str(routed.make_url("")).rstrip("/")
    await routed.close()


async def answers(url: str, method: str, target: str, *headers: str, body: bytes = b""):
    head = "\n".join([f"{method} {target} HTTP/1.1", "Host: proxy", *headers,
                      f"Content-Length: {len(body)}"])
    resp = await raw_request(url, head, body)
    kind = resp.headers.get("Content-Type", "").split(";")[0]
    problem = resp.json()["type"] if kind == "application/problem+json" else None
    return resp.status, kind, problem


@pytest.mark.parametrize("method, target", [
    ("POST", "/openai/v1/chat/completions"),
    ("GET", "/openai/v1/models?limit=2"),
    ("POST", "/runs/fd-run/epochs/0/openai/v1/chat/completions"),
    ("POST", "/runs/fd-run/openai/v1/chat/completions"),
    ("POST", "/runs/fd%2Frun/epochs/0/openai/v1/chat/completions"),  # the router decodes: not dispatched
    ("POST", "/runs/fd-run/epochs/0%31/openai/v1/chat/completions"),
    ("POST", "/runs/fd-run/epochs/x/openai/v1/chat/completions"),
    ("POST", "/runs/fd-run?a=/epochs/0/openai/v1/chat/completions"),
    ("POST", "/runs/fd-run/epochs/0/nope/v1/chat/completions"),
    ("POST", "/openai/../healthz"),
    ("POST", "/openai/%2e%2e/admin/runs"),
    ("GET", "/openai"),
    ("POST", "/nope/v1/chat/completions"),
    ("GET", "/healthz"),
    ("GET", "/runs/fd-run"),
    ("GET", "/admin/runs"),
    ("GET", "//openai/v1/models"),
    ("OPTIONS", "*"),
    ("CONNECT", "/tools/send"),  # an authority is all CONNECT names: refused, whatever it says
    ("POST", "/tools/send%0A"),  # no route has a line break in it; the proxy refuses one too
    ("GET", "/openai/v1/models%0D%0AX-Injected:%201"),
    ("POST", "/runs/fd-run/epochs/0/openai/v1/chat/completions%0A"),
    ("GET", "/openai/v1/models%0D"),
])
async def test_the_dispatch_changes_no_answer(two_ways, method, target):
    dispatched, routed = two_ways
    headers = ("Content-Type: application/json", "Idem-Policy: passthrough")
    body = CHAT if method == "POST" else b""
    assert await answers(dispatched, method, target, *headers, body=body) == \
        await answers(routed, method, target, *headers, body=body)


async def test_a_recorded_call_is_the_same_either_way(two_ways, provider):
    """Recorded through the dispatcher, replayed through the router, and the other way."""
    dispatched, routed = two_ways
    for first, second, key in ((dispatched, routed, "fd-1"), (routed, dispatched, "fd-2")):
        headers = ("Content-Type: application/json", f"Idempotency-Key: {key}")
        recorded = await raw_request(first, "\n".join([
            "POST /openai/v1/chat/completions HTTP/1.1", "Host: proxy", *headers,
            f"Content-Length: {len(CHAT)}"]), CHAT)
        replayed = await raw_request(second, "\n".join([
            "POST /openai/v1/chat/completions HTTP/1.1", "Host: proxy", *headers,
            f"Content-Length: {len(CHAT)}"]), CHAT)
        assert recorded.status == replayed.status == 200
        assert recorded.headers["Idempotent-Replayed"] == "false"
        assert replayed.headers["Idempotent-Replayed"] == "true"
        assert replayed.body == recorded.body
    assert provider.calls["chat"] == 2


async def test_expect_100_continue_is_answered_before_the_body(two_ways, http):
    """aiohttp's router sends 100 Continue; the dispatcher leaves such requests to it."""
    dispatched, _ = two_ways
    async with http.post(dispatched + "/openai/v1/chat/completions", data=CHAT, expect100=True,
                         headers={"Content-Type": "application/json", "Idempotency-Key": "fd-expect"}) as resp:
        assert resp.status == 200
        assert resp.headers["Idempotent-Replayed"] == "false"


@pytest.mark.parametrize("target, proxied", [
    ("/openai/v1/chat/completions", True),
    ("/openai/", True),
    ("/tools/x?y=1", True),
    ("/runs/r1/epochs/0/openai/v1/chat/completions", True),
    ("/runs/r1/epochs/0/", True),
    ("/openai", False),  # too short to be sure: routed (to the proxy all the same)
    ("/nope/v1", False),
    ("/runs/r1/openai/v1", False),  # the runs API's routes come first
    ("/runs/r%2F1/epochs/0/openai/v1", False),
    ("/runs/r1/epochs/0?x/openai/v1", False),
    ("/runs//epochs/0/openai/v1", False),
    ("/runs/r1/epochs/0", False),
    ("/healthz", False),
    ("*", False),
    ("example.com:443", False),
])
def test_which_targets_the_dispatcher_gives_the_data_plane(target, proxied):
    assert proxied_target(target, UPSTREAMS) is proxied


@pytest.mark.parametrize("line", ["POST /tools/send%0A HTTP/1.1", "CONNECT /tools/send HTTP/1.1",
                                  "POST /tools/send%00 HTTP/1.1"])
async def test_a_refused_target_reaches_no_upstream(make_proxy, sqlite_url, provider, line):
    """Targets that once went straight to the upstream, and were recorded: refused before it."""
    proxy = await make_proxy(sqlite_url)
    resp = await raw_request(proxy.url, line + "\nHost: p\nIdempotency-Key: k1\nContent-Type: application/json"
                                               "\nContent-Length: 2", b"{}")
    assert resp.status == 400 and resp.json()["type"].endswith("/invalid-request")
    assert provider.seen == []
