"""A stdio MCP server with side effects, the kind most MCP servers are: run locally, spoken to
over stdin and stdout, which no HTTP proxy can see.

Its tools append one JSON line per execution to an outbox file (``--outbox``, default
examples/frameworks/outbox.jsonl): no deduplication of their own, twice is two emails. Put it
behind the ``mcp-proxy`` bridge (stdio -> Streamable HTTP) and the bridge behind idemproxy's
``kind = "mcp"`` upstream, and its tools/call are journaled like any MCP server's:

    mcp-proxy --port 9300 -- python examples/frameworks/stdio_tools.py --outbox /tmp/outbox.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

SENDS = ToolAnnotations(destructiveHint=True, idempotentHint=False)


def create_server(outbox: str) -> MCPServer:
    mcp = MCPServer("stdio-order-tools")

    def execute(tool: str, **args) -> int:
        """The side effect: a line in the outbox. Returns its number."""
        with open(outbox, "a+", encoding="utf-8") as out:
            out.seek(0)
            n = sum(1 for _ in out) + 1
            out.write(json.dumps({"n": n, "tool": tool, "args": args, "pid": os.getpid(), "at": time.time()}) + "\n")
        return n

    @mcp.tool(annotations=SENDS)
    def send_email(to: str, subject: str) -> str:
        """Email a customer."""
        return f"email {execute('send_email', to=to, subject=subject)} sent"

    @mcp.tool(annotations=SENDS)
    def charge_card(order: str, amount_cents: int) -> str:
        """Charge the card on file for an order."""
        return f"charge {execute('charge_card', order=order, amount_cents=amount_cents)} made"

    @mcp.tool(annotations=SENDS)
    def send_receipt(to: str, order: str) -> str:
        """Send the receipt of an order."""
        return f"receipt {execute('send_receipt', to=to, order=order)} sent"

    return mcp


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outbox", default="examples/frameworks/outbox.jsonl")
    create_server(parser.parse_args().outbox).run("stdio")
