"""Real traffic for the console's tests: a run that crashed and resumed, a quarantined tool
call, a run the supervisor buried. Everything goes through the proxy's sockets, the admin
API and the supervisor's own tick, as it would in production."""

from __future__ import annotations

import asyncio
import sys
import time

from idemproxy.proxy.appkeys import RUNS
from idemproxy.supervisor import Supervisor

ADMIN = {"Authorization": "Bearer test-admin-token"}
RUN, DEAD_RUN = "billing-agent", "nightly-report"
QUARANTINED_KEY = "email-invoice-42"


def hook_sections(tmp_path) -> dict:
    """A command hook that writes one line to its attempt log, as an agent would."""
    return {"hooks__agent": {"command": [sys.executable, "-c", "print('agent attempt started')"],
                             "log_dir": str(tmp_path / "attempt-logs"),
                             # its runs may arm it; it exits at once, so its exit is not a crash
                             "allow_tenants": ["default"], "watch_exit": False}}


def _chat(i: int) -> dict:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"step {i}: plan the invoice run"}]}


async def _ok(response) -> None:
    assert response.status < 300, (response.status, await response.text())
    await response.read()


async def crashed_and_resumed(http, proxy) -> None:
    """Epoch 0 records four calls and goes silent; epoch 1 replays them, goes live for two
    more, and its tool call's outcome is unknown (upstream 503 on a quarantine upstream)."""
    async with http.post(f"{proxy.url}/runs/{RUN}", json={"hook": "agent"}) as resp:
        await _ok(resp)
    for epoch in (0, 1):
        base = f"{proxy.url}/runs/{RUN}/epochs/{epoch}"
        for i in range(3):
            async with http.post(f"{base}/openai/v1/chat/completions", json=_chat(i)) as resp:
                await _ok(resp)
        async with http.post(f"{base}/tools/send", json={"to": "ann", "invoice": 41},
                             headers={"Idempotency-Key": "email-invoice-41"}) as resp:
            await _ok(resp)
        if epoch == 0:  # the agent dies here; an operator restarts it (its hook writes a log)
            async with http.post(f"{proxy.url}/admin/runs/{RUN}/restart", headers=ADMIN) as resp:
                await _ok(resp)
            await proxy.proxy.flush_replay_counts()
    for i in range(3, 5):
        async with http.post(f"{base}/openai/v1/chat/completions", json={**_chat(i), "stream": True}) as resp:
            await _ok(resp)
    async with http.post(f"{base}/tools/send", json={"to": "bob", "invoice": 42},
                         headers={"Idempotency-Key": QUARANTINED_KEY, "X-Fake-Status": "503"}) as resp:
        assert resp.status == 503
    await proxy.proxy.flush_replay_counts()
    for _ in range(100):  # the hook's process is reaped in the background: wait for its exit
        [run] = await proxy.store.runs.find("default", RUN)
        if any(e["event"] == "hook-exit" for e in run.history):
            break
        await asyncio.sleep(0.05)


async def buried(http, proxy) -> None:
    """A run that allows no restarts goes silent: the supervisor's tick marks it dead."""
    async with http.post(f"{proxy.url}/runs/{DEAD_RUN}",
                         json={"hook": "agent", "timeout_s": 1, "grace_s": 1, "max_restarts": 0}) as resp:
        await _ok(resp)
    supervisor = Supervisor(proxy.app[RUNS], proxy.settings)
    assert (DEAD_RUN, "dead") in await supervisor.tick(now=time.time() + 5)


async def quarantined_kid(proxy) -> str:
    [entry] = await proxy.store.journal.search(key="key:" + QUARANTINED_KEY)
    return entry.kid


MCP_RUN, MCP_TOOL = "mcp-mailer", "send_email"


async def mcp_tool_call(http, proxy) -> None:
    """A run whose one step is an MCP tools/call (to examples/mcp_tool_server.py), journaled
    under a key derived from what it means."""
    body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": MCP_TOOL, "arguments": {"to": "ann@example.com", "subject": "invoice 43"}}}
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2026-07-28",
               "Mcp-Method": "tools/call", "Mcp-Name": MCP_TOOL}
    body["params"]["_meta"] = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                               "io.modelcontextprotocol/clientCapabilities": {}}
    async with http.post(f"{proxy.url}/runs/{MCP_RUN}/epochs/0/mcp/mcp", json=body, headers=headers) as resp:
        await _ok(resp)
