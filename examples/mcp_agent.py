"""An agent that calls its tools through MCP (official MCP Python SDK), made replay-safe by idemproxy.

Each step asks the model what to write (``run.openai()``) and sends it with the MCP tool
``send_email`` of examples/mcp_tool_server.py, which has no deduplication of its own. The MCP
client points at ``run.mcp_url("mcp")``: the proxy journals each ``tools/call`` under a key
derived from what it means (tool, arguments, occurrence in the attempt), never from the
JSON-RPC id or the session. Started with ``--crash-at K`` the process SIGKILLs itself after
step K. The supervisor starts it again (hook ``mcp_agent`` in examples/config.toml); the new
attempt opens a new MCP session (or none, with ``--revision 2026-07-28``), its first K steps
are answered from the journal under its own JSON-RPC ids, and every email goes out once.

    IDEM_RUN_ID=mcp-1 python examples/mcp_agent.py --steps 6 --crash-at 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from idemproxy_client import AsyncRun

DEFAULT_STEPS = 6
REVISIONS = ("legacy", "2026-07-28")  # 2025-11-25 with sessions, or stateless


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help=f"steps of the task (default {DEFAULT_STEPS}; kept with the run)")
    parser.add_argument("--revision", choices=REVISIONS, help="MCP revision (default legacy; kept with the run)")
    parser.add_argument("--crash-at", type=int, metavar="K", help="SIGKILL this process after step K")
    return parser.parse_args()


def served(headers) -> str:
    """How the proxy answered: from its journal, or by calling the upstream."""
    return "replayed" if headers.get("idempotent-replayed") == "true" else "live"


async def main() -> int:
    args = parse_args()
    metadata = {k: v for k, v in {"steps": args.steps, "revision": args.revision}.items() if v is not None}
    async with AsyncRun(hook="mcp_agent", metadata=metadata or None) as run:
        task = run.info.metadata if run.info else {}
        steps, revision = int(task.get("steps", DEFAULT_STEPS)), task.get("revision", "legacy")
        print(f"run {run.run_id} epoch {run.epoch}: {steps} steps over MCP {revision}", flush=True)
        tool_answers = []  # the proxy's answer headers to each tools/call, in order

        async def seen(response: httpx2.Response) -> None:
            if response.request.method == "POST" and b'"tools/call"' in response.request.content:
                tool_answers.append(response.headers)
        async with run.openai() as llm, \
                httpx2.AsyncClient(event_hooks={"response": [seen]}, timeout=httpx2.Timeout(30, read=300)) as http, \
                Client(streamable_http_client(run.mcp_url("mcp"), http_client=http), mode=revision) as tools:
            for step in range(1, steps + 1):
                raw = await llm.chat.completions.with_raw_response.create(
                    model="gpt-4o-mini",
                    messages=[{"role": "user", "content": f"Write the subject of status email {step}."}])
                subject = raw.parse().choices[0].message.content or ""
                sent = await tools.call_tool("send_email", {"to": f"person{step}@example.com", "subject": subject})
                tool = served(tool_answers[-1])
                print(f"step {step}/{steps}: model {served(raw.headers)}, tool {tool}: {sent.content[0].text}",
                      flush=True)
                if step == args.crash_at:
                    print(f"crash: SIGKILL after step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
    print(f"done: {steps} steps, run {run.run_id} is {run.info.state if run.info else '?'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
