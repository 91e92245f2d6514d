"""An OpenAI Agents SDK agent using a stdio MCP server, its tools journaled by idemproxy.

The tools live in a local stdio MCP server (examples/frameworks/stdio_tools.py), which no HTTP
proxy can see. The maintained ``mcp-proxy`` bridge serves it over Streamable HTTP, and
idemproxy's ``kind = "mcp"`` upstream sits in front of the bridge:

    agent --HTTP--> idemproxy (journal) --HTTP--> mcp-proxy --stdio--> stdio_tools.py

What changes in a normal Agents SDK agent with an MCP server, marked ``# idemproxy``:

1. ``Run`` around the whole;
2. the SDK's default client on the run's base URL (model calls journaled);
3. ``MCPServerStreamableHttp`` on ``run.mcp_url("mcp")`` instead of ``MCPServerStdio``: each
   ``tools/call`` is journaled under a key derived from the tool, its arguments and its
   occurrence in the attempt — never the JSON-RPC id or the session — and a restarted
   attempt's calls are answered from the journal under its own ids.

    mcp-proxy --port 9300 -- python examples/frameworks/stdio_tools.py &
    IDEM_RUN_ID=order-46 python examples/frameworks/mcp_stdio_agent.py --crash-after charge_card

``--crash-after TOOL`` SIGKILLs the process as soon as the SDK has that tool's result; the
supervisor starts this file again (hook ``mcp_stdio`` in examples/frameworks/config.toml).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from agents import Agent, RunHooks, Runner, set_default_openai_client, set_tracing_disabled
from agents.mcp import MCPServerStreamableHttp
from openai import AsyncOpenAI

from idemproxy_client import Run

ORDER = {"order": "46", "email": "barbara@example.com", "amount_cents": 2600}
# The fake provider (tests/support/fake_provider.py) plays the model: it follows this plan line.
PLAN = [{"tool": "send_email", "args": {"to": ORDER["email"], "subject": "Order 46 is on its way"}},
        {"tool": "charge_card", "args": {"order": ORDER["order"], "amount_cents": ORDER["amount_cents"]}},
        {"tool": "send_receipt", "args": {"to": ORDER["email"], "order": ORDER["order"]}}]
INSTRUCTIONS = "You fulfil orders: email the customer, charge the card, send the receipt."


class Progress(RunHooks):
    """Prints each tool's result; SIGKILLs the process after ``crash_after``'s."""

    def __init__(self, crash_after: str | None) -> None:
        self.crash_after = crash_after

    async def on_tool_end(self, context, agent, tool, result) -> None:
        print(f"tool {tool.name}: {result}", flush=True)
        if tool.name == self.crash_after:  # the side effect is done, the SDK has its answer
            print(f"crash: SIGKILL after {tool.name}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crash-after", metavar="TOOL", help="SIGKILL this process after TOOL's result")
    return parser.parse_args()


async def fulfil(run: Run, crash_after: str | None) -> str:
    async with MCPServerStreamableHttp(name="stdio-order-tools", params={"url": run.mcp_url("mcp")},  # idemproxy
                                       cache_tools_list=True) as tools:
        agent = Agent(name="orders", instructions=INSTRUCTIONS, model="gpt-4o-mini", mcp_servers=[tools])
        prompt = f"Fulfil order {ORDER['order']} for {ORDER['email']}.\nPLAN: {json.dumps(PLAN)}"
        result = await Runner.run(agent, prompt, hooks=Progress(crash_after))
    return str(result.final_output)


def main() -> int:
    args = parse_args()
    with Run(hook="mcp_stdio", attach=True) as run:  # idemproxy
        print(f"run {run.run_id} epoch {run.epoch}", flush=True)
        set_default_openai_client(AsyncOpenAI(base_url=run.url("openai", "/v1"),  # idemproxy
                                              api_key=os.environ.get("OPENAI_API_KEY") or "idemproxy-injected"))
        set_tracing_disabled(True)  # tracing through the proxy: see openai_agents_agent.py
        output = asyncio.run(fulfil(run, args.crash_after))
    print(f"done: {output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
