"""The error boundary (proxy/errors.py): every Problem and store failure a route raises
becomes one problem+json answer, and a proxied request is counted by its outcome."""

from __future__ import annotations

import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from idemproxy.proxy.errors import problem_middleware
from idemproxy.proxy.exchange import EXCHANGE, Exchange
from idemproxy.proxy.observability.metrics import Metrics
from idemproxy.proxy.problems import PROBLEMS, Problem
from idemproxy.proxy.replay import start_stream
from idemproxy.proxy.store import StoreUnavailable
from rawhttp import problem

CHAT = "/openai/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def _refuse(request: web.Request) -> web.StreamResponse:
    raise Problem("in-flight", "still going", headers={"Retry-After": "1"}, attempt=2)


async def _store_down(request: web.Request) -> web.StreamResponse:
    raise StoreUnavailable("connection refused")


async def _break_stream(request: web.Request) -> web.StreamResponse:
    request[EXCHANGE] = Exchange(time.perf_counter())  # as the proxy handler makes it
    stream = await start_stream(request, 200, [("Content-Type", "text/event-stream")])
    await stream.write(b"data: 1\n\n")
    raise StoreUnavailable("gone mid-stream")


@pytest.fixture
async def boundary():
    app = web.Application(middlewares=[problem_middleware(Metrics())])
    app.router.add_get("/refuse", _refuse)
    app.router.add_get("/store-down", _store_down)
    app.router.add_get("/break", _break_stream)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


def test_every_problem_type_has_a_status_title_and_outcome_slot():
    for slug, kind in PROBLEMS.items():
        assert 400 <= kind.status < 600 and kind.title, slug
    with pytest.raises(ValueError):
        Problem("no-such-slug", "typo")


async def test_a_problem_from_any_route_is_problem_json(boundary, http):
    async with http.get(boundary + "/refuse") as r:
        body = await problem(r, "in-flight", 409)
        assert r.headers["Retry-After"] == "1"
        assert "Server-Timing" not in r.headers  # only the proxy handler's answers carry it
    assert body["instance"] == "/refuse" and body["attempt"] == 2 and body["detail"] == "still going"


async def test_a_store_failure_from_any_route_is_503(boundary, http):
    async with http.get(boundary + "/store-down") as r:
        await problem(r, "store-unavailable", 503)


async def test_a_failure_after_the_head_is_sent_cuts_the_stream_short(boundary, http):
    async with http.get(boundary + "/break") as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()


async def test_requests_are_counted_by_outcome(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url)
    chat = proxy.url + CHAT
    for _ in range(2):  # recorded, then replayed
        async with http.post(chat, json=BODY, headers={"Idempotency-Key": "k"}) as r:
            assert r.status == 200
    async with http.post(chat, json={**BODY, "n": 2}, headers={"Idempotency-Key": "k"}) as r:
        await problem(r, "key-reused", 422)
    async with http.post(proxy.url + "/runs/r/epochs/1" + CHAT, json=BODY) as r:
        assert r.status == 200
    async with http.post(proxy.url + "/runs/r/epochs/0" + CHAT, json=BODY) as r:
        await problem(r, "stale-epoch", 412)
    async with http.get(proxy.url + "/nope/x") as r:
        await problem(r, "unknown-upstream", 404)
    async with http.get(chat) as r:
        assert r.status < 500  # GET passes through
    async with http.get(proxy.url + "/admin/runs") as r:
        await problem(r, "unauthorized", 401)  # not a proxied request: not counted
    async with http.get(proxy.url + "/metrics") as r:
        text = await r.text()
    counts = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("idemproxy_requests_total{")}
    assert counts == {"recorded": 2, "replayed": 1, "conflict": 1, "fenced": 1, "rejected": 1,
                      "passthrough": 1}
