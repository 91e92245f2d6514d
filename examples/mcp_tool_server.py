"""An MCP tool server (official MCP Python SDK, Streamable HTTP) whose tools count what they do.

Tools with side effects and no deduplication of their own, like most real ones:

- ``send_email(to, subject)``: "sends" an email (appends it to the outbox) and answers its id.
- ``build_report(title, pages)``: writes a report page by page, with a progress notification
  per page; its answer is an SSE stream (progress, then the result).
- ``charge(amount)``: charges a card; refuses a non-positive amount with a JSON-RPC
  invalid-params error, and declines amounts over 1000 with an ``isError: true`` result.
- ``flaky()``: fails with a JSON-RPC internal error *after* doing its work (an ambiguous outcome).
- ``wait(seconds)``: sleeps, then answers (for timeouts and in-flight duplicates).
- ``lookup(name)``: a read, annotated ``readOnlyHint: true``.

Every execution is counted; ``GET /calls`` answers the counts and ``GET /outbox`` the emails.
The MCP endpoint is ``/mcp``: it speaks 2025-11-25 (``initialize``, ``Mcp-Session-Id``) and
2026-07-28 (stateless, ``Mcp-Method``/``Mcp-Name``) at once, as the SDK does.

    python examples/mcp_tool_server.py --port 9300            # SSE answers
    python examples/mcp_tool_server.py --port 9300 --json     # JSON answers
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp.types import ToolAnnotations
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse


@dataclass
class Ledger:
    """What the tools did: executions per tool, and the emails sent."""
    calls: collections.Counter = field(default_factory=collections.Counter)
    outbox: list[dict[str, Any]] = field(default_factory=list)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))


def create_server(ledger: Ledger, page_s: float = 0.05) -> MCPServer:
    mcp = MCPServer("idemproxy-demo-tools")

    @mcp.tool(annotations=ToolAnnotations(destructiveHint=True, idempotentHint=False))
    def send_email(to: str, subject: str) -> str:
        """Send an email (no deduplication: twice means two emails)."""
        ledger.calls["send_email"] += 1
        message = {"id": f"msg-{next(ledger.ids)}", "to": to, "subject": subject}
        ledger.outbox.append(message)
        return f"{message['id']} to {to}"

    @mcp.tool()
    async def build_report(title: str, pages: int, ctx: Context) -> str:
        """Write a report page by page, reporting progress after each page."""
        ledger.calls["build_report"] += 1
        for page in range(1, pages + 1):
            await asyncio.sleep(page_s)
            await ctx.report_progress(page, pages, f"page {page} of {pages}")
        return f"report {title!r}: {pages} pages (build #{ledger.calls['build_report']})"

    @mcp.tool()
    def charge(amount: int) -> str:
        """Charge a card."""
        if amount <= 0:
            raise MCPError(INVALID_PARAMS, "amount must be positive")
        ledger.calls["charge"] += 1
        if amount > 1000:
            raise ToolError(f"card declined for {amount}")  # the SDK answers isError: true
        return f"charged {amount} (charge #{ledger.calls['charge']})"

    @mcp.tool()
    def flaky() -> str:
        """Does its work, then fails: the caller cannot know whether it happened."""
        ledger.calls["flaky"] += 1
        raise MCPError(INTERNAL_ERROR, "lost the connection to the mail relay")

    @mcp.tool()
    async def wait(seconds: float) -> str:
        """Sleep, then answer."""
        ledger.calls["wait"] += 1
        await asyncio.sleep(seconds)
        return f"waited {seconds}s (wait #{ledger.calls['wait']})"

    @mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def lookup(name: str) -> str:
        """Look a name up (a read)."""
        ledger.calls["lookup"] += 1
        return f"{name}: found"

    @mcp.resource("demo://readme")
    def readme() -> str:
        return "demo tools"

    @mcp.prompt()
    def greet(name: str) -> str:
        return f"Say hello to {name}."

    @mcp.custom_route("/calls", methods=["GET"])
    async def calls(request: Request) -> JSONResponse:
        return JSONResponse(dict(ledger.calls))

    @mcp.custom_route("/outbox", methods=["GET"])
    async def outbox(request: Request) -> JSONResponse:
        return JSONResponse(ledger.outbox)

    return mcp


def create_app(ledger: Ledger, json_response: bool = False, page_s: float = 0.05) -> Starlette:
    """The ASGI app: the MCP endpoint at /mcp, plus /calls and /outbox."""
    return create_server(ledger, page_s).streamable_http_app(json_response=json_response)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9300)
    parser.add_argument("--json", action="store_true", help="answer JSON, not SSE streams")
    args = parser.parse_args()
    ledger = Ledger()
    print(json.dumps({"event": "listening", "url": f"http://{args.host}:{args.port}/mcp"}), flush=True)
    uvicorn.run(create_app(ledger, args.json), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
