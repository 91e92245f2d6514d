"""MCP upstreams (issue 12, SPEC §12), end to end with the official MCP Python SDK.

The tool server is examples/mcp_tool_server.py (an SDK ``MCPServer`` over Streamable HTTP,
served by uvicorn in the test's event loop) whose tools count their executions; the agent is
the SDK's ``Client`` pointed at the proxy, speaking 2025-11-25 (``mode="legacy"``:
``initialize``, ``Mcp-Session-Id``) or 2026-07-28 (stateless, ``Mcp-Method``/``Mcp-Name``).
The server answers SSE streams (``sse``) or JSON (``json``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import httpx2
import pytest
import uvicorn
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

import services

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import mcp_tool_server as tool_server  # noqa: E402

LEGACY, STATELESS = "legacy", "2026-07-28"
REVISIONS = [LEGACY, STATELESS]


class InLoopServer(uvicorn.Server):
    """uvicorn in the test's event loop; the test runner keeps its signal handlers."""

    def capture_signals(self):
        return contextlib.nullcontext()


class ToolServer:
    def __init__(self, json_response: bool):
        self.ledger = tool_server.Ledger()
        self.port = services.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = InLoopServer(uvicorn.Config(
            tool_server.create_app(self.ledger, json_response=json_response), host="127.0.0.1",
            port=self.port, log_level="warning", lifespan="on"))
        self.task: asyncio.Task | None = None

    @property
    def calls(self):
        return self.ledger.calls

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


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
        live = text(await agent.call_tool("send_email", {"to": "p9@x", "subject": "s"}))
    assert replayed == first
    assert tools.calls["send_email"] == 5 and live.endswith("p9@x")
