"""MCP upstreams (docs/mcp.md), end to end with the official MCP Python SDK.

The tool server is examples/mcp_tool_server.py (an SDK ``MCPServer`` over Streamable HTTP,
served by uvicorn in the test's event loop) whose tools count their executions; the agent is
the SDK's ``Client`` pointed at the proxy, speaking 2025-11-25 (``mode="legacy"``:
``initialize``, ``Mcp-Session-Id``) or 2026-07-28 (stateless, ``Mcp-Method``/``Mcp-Name``).
The server answers SSE streams (``sse``) or JSON (``json``). Tests where the store matters (replay
across attempts, single flight, quarantine, re-issue) run on every backend; the rest on SQLite.
"""

from __future__ import annotations

import asyncio
import json
import contextlib

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPDeprecationWarning, MCPError

from idemproxy.proxy.mcp.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, PROXY_ERROR
from idemproxy.proxy.mcp.messages import META_KEY

from mcp_tools import ToolServer

LEGACY, STATELESS = "legacy", "2026-07-28"
REVISIONS = [LEGACY, STATELESS]


@pytest.fixture(params=["sse", "json"])
async def tools(request):
    server = ToolServer(json_response=request.param == "json")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def sse_tools():
    server = ToolServer(json_response=False)
    await server.start()
    yield server
    await server.stop()


def mcp_sections(tools_url: str, **upstream) -> dict:
    return {"upstreams__mcp": {"url": tools_url, "kind": "mcp", **upstream}}


@contextlib.asynccontextmanager
async def client(url: str, revision: str, headers: dict | None = None, **kwargs):
    """The SDK's client over Streamable HTTP, with these headers on every POST."""
    async with httpx2.AsyncClient(headers=headers or {}, timeout=httpx2.Timeout(30, read=300)) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=revision, **kwargs) as agent:
            yield agent


def run_url(proxy, run: str, epoch: int = 0) -> str:
    return f"{proxy.url}/runs/{run}/epochs/{epoch}/mcp/mcp"


def text(result) -> str:
    return result.content[0].text


@pytest.mark.parametrize("revision", REVISIONS)
async def test_a_restarted_agent_replays_its_tool_calls(make_proxy, store_url, tools, revision):
    proxy = await make_proxy(store_url, **mcp_sections(tools.url))
    async with client(run_url(proxy, "r1"), revision) as agent:
        first = [text(await agent.call_tool("send_email", {"to": f"p{n}@x", "subject": "s"})) for n in range(3)]
        again = text(await agent.call_tool("send_email", {"to": "p0@x", "subject": "s"}))  # a new step
    assert tools.calls["send_email"] == 4 and again != first[0]
    # the restarted attempt opens a new session (legacy) and asks with ids of its own
    async with client(run_url(proxy, "r1", epoch=1), revision) as agent:
        await agent.list_tools()
        replayed = [text(await agent.call_tool("send_email", {"subject": "s", "to": f"p{n}@x"})) for n in range(3)]
        assert text(await agent.call_tool("send_email", {"to": "p0@x", "subject": "s"})) == again
        assert proxy.proxy.metrics.replayed_from_memory == 4  # the attempt's journal, loaded in one read
        live = text(await agent.call_tool("send_email", {"to": "p9@x", "subject": "s"}))
    assert replayed == first
    assert tools.calls["send_email"] == 5 and live.endswith("p9@x")
    assert proxy.proxy.replay_cache.get("default", "r1", 1) is None  # live: the memory is let go


@pytest.mark.parametrize("revision", REVISIONS)
async def test_a_replayed_stream_brings_its_progress_under_the_callers_ids(make_proxy, sqlite_url, sse_tools,
                                                                          revision):
    proxy = await make_proxy(sqlite_url, **mcp_sections(sse_tools.url))
    seen: dict[int, list] = {0: [], 1: []}
    results = {}
    for epoch in (0, 1):
        async def progress(done, total, message, epoch=epoch):
            seen[epoch].append((done, total, message))
        async with client(run_url(proxy, "r2", epoch), revision) as agent:
            for _ in range(epoch * 3):  # the restarted agent's ids and progress tokens differ
                await agent.list_tools()
            results[epoch] = await agent.call_tool("build_report", {"title": "q3", "pages": 3},
                                                   progress_callback=progress)
    assert sse_tools.calls["build_report"] == 1
    assert text(results[1]) == text(results[0])
    assert seen[1] == seen[0] == [(n, 3, f"page {n} of 3") for n in (1, 2, 3)]


async def test_the_key_ignores_ids_and_meta_and_the_answer_takes_the_callers_id(make_proxy, sqlite_url, tools, http):
    proxy = await make_proxy(sqlite_url, **mcp_sections(tools.url))
    answers = []
    for epoch, request_id, meta in ((0, 1, {"progressToken": "t-1", "traceparent": "00-aa-01"}), (1, "again-7", {})):
        body = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                "params": {"name": "send_email", "arguments": {"to": "a@x", "subject": "s"},
                           "_meta": {**meta, "io.modelcontextprotocol/protocolVersion": STATELESS,
                                     "io.modelcontextprotocol/clientCapabilities": {}}}}
        headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": STATELESS,
                   "Mcp-Method": "tools/call", "Mcp-Name": "send_email"}
        async with http.post(run_url(proxy, "r3", epoch), json=body, headers=headers) as resp:
            answers.append((resp.headers["Idempotent-Replayed"], await resp.text()))
    assert tools.calls["send_email"] == 1
    assert [replayed for replayed, _ in answers] == ["false", "true"]
    first, again = (tool_server_answer(body) for _, body in answers)
    assert first["id"] == 1 and again["id"] == "again-7" and first["result"] == again["result"]


def tool_server_answer(body: str) -> dict:
    """The JSON-RPC response in an answer, JSON or SSE."""
    data = [line[5:].strip() for line in body.splitlines() if line.startswith("data:")]
    return json.loads(data[-1] if data else body)


@pytest.mark.parametrize("revision", REVISIONS)
async def test_concurrent_duplicates_run_once(make_proxy, store_url, sse_tools, revision):
    proxy = await make_proxy(store_url, **mcp_sections(sse_tools.url))
    async with client(run_url(proxy, "r4"), revision) as agent:
        same = await asyncio.gather(*(agent.call_tool("wait", {"seconds": 0.3}) for _ in range(5)))
    assert sse_tools.calls["wait"] == 1
    assert len({text(result) for result in same}) == 1


@pytest.mark.parametrize("revision", REVISIONS)
async def test_everything_but_tools_call_passes_through(make_proxy, sqlite_url, tools, revision):
    proxy = await make_proxy(sqlite_url, **mcp_sections(tools.url))
    for epoch in (0, 1):
        async with client(run_url(proxy, "r5", epoch), revision) as agent:
            if revision == LEGACY:  # gone in 2026-07-28, and the SDK says so
                with pytest.warns(MCPDeprecationWarning):
                    await agent.send_ping()
            assert "lookup" in {tool.name for tool in (await agent.list_tools()).tools}
            assert (await agent.read_resource("demo://readme")).contents[0].text == "demo tools"
            assert "hello" in (await agent.get_prompt("greet", {"name": "Ada"})).messages[0].content.text
            assert text(await agent.call_tool("lookup", {"name": "ada"})) == "ada: found"
    assert tools.calls["lookup"] == 2  # readOnlyHint: a read goes upstream every time
    assert await proxy.store.journal.entries("default", "r5") == []


async def test_annotations_steer_the_policy(make_proxy, sqlite_url, sse_tools):
    proxy = await make_proxy(sqlite_url, **mcp_sections(sse_tools.url, read_only_tools="record"))
    for epoch in (0, 1):
        async with client(run_url(proxy, "r6", epoch), STATELESS) as agent:
            await agent.list_tools()
            await agent.call_tool("lookup", {"name": "ada"})
    assert sse_tools.calls["lookup"] == 1


@pytest.mark.parametrize("revision", REVISIONS)
async def test_outcomes_is_error_and_invalid_params_recorded_internal_errors_quarantined(
        make_proxy, store_url, sse_tools, revision):
    proxy = await make_proxy(store_url, **mcp_sections(sse_tools.url))
    failures = []
    for epoch in (0, 1):
        async with client(run_url(proxy, "r7", epoch), revision) as agent:
            declined = await agent.call_tool("charge", {"amount": 5000})
            assert declined.is_error and "declined" in text(declined)
            with pytest.raises(MCPError) as refused:
                await agent.call_tool("charge", {"amount": -1})
            assert refused.value.code == INVALID_PARAMS
            with pytest.raises(MCPError) as failed:
                await agent.call_tool("flaky", {})
            failures.append(failed.value)
    assert sse_tools.calls["charge"] == 1 and sse_tools.calls["flaky"] == 1
    assert failures[0].code == INTERNAL_ERROR
    # the replay of an ambiguous outcome: a JSON-RPC error carrying the problem
    assert failures[1].code == PROXY_ERROR and failures[1].data["type"].endswith("/outcome-unknown")
    states = sorted(entry.state for entry in await proxy.store.journal.entries("default", "r7"))
    assert states == ["complete", "complete", "unknown"]


async def test_a_transport_failure_is_quarantined(make_proxy, sqlite_url, sse_tools):
    proxy = await make_proxy(sqlite_url, **mcp_sections(sse_tools.url, read_timeout="0.3s"))
    for epoch, slug in ((0, "upstream-timeout"), (1, "outcome-unknown")):
        async with client(run_url(proxy, "r8", epoch), STATELESS) as agent:
            with pytest.raises(MCPError) as failed:
                await agent.call_tool("wait", {"seconds": 1.0})
        assert failed.value.code == PROXY_ERROR and failed.value.data["type"].endswith("/" + slug)
    assert sse_tools.calls["wait"] == 1


async def test_a_batch_with_a_tools_call_is_refused_whole(make_proxy, sqlite_url, sse_tools, http):
    proxy = await make_proxy(sqlite_url, **mcp_sections(sse_tools.url))
    batch = [{"jsonrpc": "2.0", "id": 1, "method": "tools/call",
              "params": {"name": "send_email", "arguments": {"to": "a@x", "subject": "s"}}},
             {"jsonrpc": "2.0", "id": 2, "method": "ping"}]
    async with http.post(run_url(proxy, "r9"), json=batch,
                         headers={"Accept": "application/json, text/event-stream"}) as resp:
        assert resp.status == 400 and resp.content_type == "application/json"
        error = (await resp.json())
    assert error["id"] is None and error["error"]["code"] == INVALID_REQUEST
    assert "batch" in error["error"]["message"] and error["error"]["data"]["type"].endswith("/invalid-request")
    assert sse_tools.calls["send_email"] == 0


@pytest.mark.slow  # waits out timeouts or retention (>1 s)
@pytest.mark.parametrize("finished", [False, True], ids=["joins", "replays"])
async def test_a_call_reissued_after_a_broken_stream_runs_once(make_proxy, store_url, sse_tools, finished):
    """2026-07-28: a client whose response stream breaks re-issues the call with a new id."""
    proxy = await make_proxy(store_url, **mcp_sections(sse_tools.url))
    seen = []

    async def progress(done, total, message):
        seen.append(done)
    async with client(run_url(proxy, "r10"), STATELESS) as agent:
        with pytest.raises((MCPError, TimeoutError)):  # the stream is cut mid-progress
            await agent.call_tool("build_report", {"title": "t", "pages": 8}, read_timeout_seconds=0.15,
                                  progress_callback=progress)
        if finished:
            await asyncio.sleep(0.6)
        seen.clear()
        again = await agent.call_tool("build_report", {"title": "t", "pages": 8}, progress_callback=progress)
        assert text(again).endswith("(build #1)")
        assert seen == [1, 2, 3, 4, 5, 6, 7, 8]  # the progress so far, then the rest (or all, replayed)
        # answered: the same call again is the next step
        assert text(await agent.call_tool("build_report", {"title": "t", "pages": 8})).endswith("(build #2)")
    assert sse_tools.calls["build_report"] == 2


async def test_an_explicit_key_reused_with_other_arguments_is_422(make_proxy, sqlite_url, sse_tools):
    proxy = await make_proxy(sqlite_url, **mcp_sections(sse_tools.url))
    async with client(f"{proxy.url}/mcp/mcp", STATELESS, headers={"Idempotency-Key": "pay-1"}) as agent:
        assert text(await agent.call_tool("charge", {"amount": 10})) == "charged 10 (charge #1)"
        with pytest.raises(MCPError) as reused:
            await agent.call_tool("charge", {"amount": 20})
    assert reused.value.code == PROXY_ERROR and reused.value.data["type"].endswith("/key-reused")
    assert reused.value.data["status"] == 422
    async with client(f"{proxy.url}/mcp/mcp", LEGACY) as agent:  # the key in _meta, no run
        meta = {META_KEY: "pay-2"}
        assert text(await agent.call_tool("charge", {"amount": 30}, meta=meta)) == "charged 30 (charge #2)"
        assert text(await agent.call_tool("charge", {"amount": 30}, meta=meta)) == "charged 30 (charge #2)"
        with pytest.raises(MCPError) as reused:
            await agent.call_tool("charge", {"amount": 31}, meta=meta)
    assert reused.value.data["type"].endswith("/key-reused")
    assert sse_tools.calls["charge"] == 2


async def test_tenants_never_see_each_others_tool_calls(make_proxy, sqlite_url, sse_tools):
    proxy = await make_proxy(sqlite_url, **mcp_sections(sse_tools.url))
    answers = {}
    for epoch, order in ((0, "ab"), (1, "ba")):
        for who in order:
            async with client(run_url(proxy, "r11", epoch), STATELESS,
                              headers={"Authorization": f"Bearer key-{who}"}) as agent:
                answers[who, epoch] = text(await agent.call_tool("send_email", {"to": "x@y", "subject": "s"}))
    assert sse_tools.calls["send_email"] == 2
    assert answers["a", 0] != answers["b", 0]
    assert answers["a", 1] == answers["a", 0] and answers["b", 1] == answers["b", 0]


async def test_a_tool_call_without_a_credential_is_refused_unless_anonymous_callers_share(
        make_proxy, sqlite_url, sse_tools):
    """As for any recorded call (docs/guarantees.md): callers without a credential would replay each
    other's tool calls, so a recorded tools/call (here in a run) without one gets
    `credential-required`, under the caller's JSON-RPC id; listing tools (passed through) still works."""
    proxy = await make_proxy(sqlite_url, tenants={"anonymous": "refuse"}, **mcp_sections(sse_tools.url))
    async with client(run_url(proxy, "r-anon"), STATELESS) as agent:
        assert {t.name for t in (await agent.list_tools()).tools} >= {"send_email"}
        with pytest.raises(MCPError) as refused:
            await agent.call_tool("send_email", {"to": "x@y", "subject": "s"})
    assert refused.value.data["type"].endswith("/credential-required")
    assert sse_tools.calls["send_email"] == 0
    async with client(run_url(proxy, "r-anon"), STATELESS, headers={"Authorization": "Bearer key-a"}) as agent:
        assert text(await agent.call_tool("send_email", {"to": "x@y", "subject": "s"})).endswith("to x@y")
    assert sse_tools.calls["send_email"] == 1
    shared = await make_proxy(sqlite_url, tenants={"anonymous": "refuse"},
                              **mcp_sections(sse_tools.url, anonymous="shared"))
    async with client(run_url(shared, "r-anon"), STATELESS) as agent:
        assert text(await agent.call_tool("send_email", {"to": "x@y", "subject": "t"})).endswith("to x@y")
    assert sse_tools.calls["send_email"] == 2


async def test_mcp_traffic_keeps_its_run_alive(make_proxy, sqlite_url, sse_tools):
    proxy = await make_proxy(sqlite_url, **mcp_sections(sse_tools.url))
    async with client(run_url(proxy, "r12"), STATELESS) as agent:
        await agent.list_tools()
        await proxy.proxy.heartbeats.flush()
        (run,) = await proxy.store.runs.find("default", "r12")
        await asyncio.sleep(0.05)
        await agent.call_tool("build_report", {"title": "t", "pages": 2})
        await proxy.proxy.heartbeats.flush()
        (later,) = await proxy.store.runs.find("default", "r12")
    assert later.last_seen > run.last_seen


@pytest.mark.slow  # waits out timeouts or retention (>1 s)
async def test_a_json_answer_whose_agent_gave_up_is_joined_by_the_reissue(make_proxy, sqlite_url, sse_tools):
    """The same for a JSON answer (a tool that sends no progress): the agent's connection is
    gone when its answer is ready, so that answer did not count as delivered."""
    proxy = await make_proxy(sqlite_url, **mcp_sections(sse_tools.url))
    async with client(run_url(proxy, "r13"), STATELESS) as agent:
        with pytest.raises((MCPError, TimeoutError)):
            await agent.call_tool("wait", {"seconds": 0.4}, read_timeout_seconds=0.1)
        assert text(await agent.call_tool("wait", {"seconds": 0.4})).endswith("(wait #1)")
        await asyncio.sleep(0.5)
        assert text(await agent.call_tool("wait", {"seconds": 0.4})).endswith("(wait #2)")
    assert sse_tools.calls["wait"] == 2
