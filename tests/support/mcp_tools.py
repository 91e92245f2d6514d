"""The examples' MCP tool server (examples/mcp_tool_server.py), served by uvicorn in the test's
event loop, its tools counting their executions: for the MCP and console tests."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import uvicorn

import services

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import mcp_tool_server as tool_server  # noqa: E402


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
            port=self.port, log_level="warning", lifespan="on",
            # The proxy under test, torn down after this server, may still hold a stream to it:
            # without a bound, uvicorn's shutdown waits for that forever (CI once hung here 60 s).
            timeout_graceful_shutdown=5))
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
