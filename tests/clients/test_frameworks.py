"""The framework recipes (examples/frameworks/, docs/recipes.md) run as their users run them.

Each test starts the fake provider (model and tools, counting every call), a real
``idemproxy serve --config examples/frameworks/config.toml`` with the supervisor in-process
and a SQLite journal, and the recipe's first attempt with ``--crash-after charge_card``: the
agent has sent an email and charged a card when it SIGKILLs itself. The supervisor starts
the recipe again through its command hook; the counts prove that every model call was paid
once and every side effect happened once, with the frameworks' own retries at their defaults.
Where the framework itself would run a tool again (LangGraph resuming from its checkpoint),
the same recipe without the journal shows the duplicate.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

import services

pytestmark = [pytest.mark.slow, pytest.mark.frameworks]  # processes SIGKILLed and restarted

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "examples" / "frameworks"
CONFIG = RECIPES / "config.toml"
ADMIN = "frameworks-test-admin-token"
SIGKILLED = -9
SIDE_EFFECTS = {"tool:send_email": 1, "tool:charge_card": 1, "tool:send_receipt": 1}
TOOL_LINE = re.compile(r"^tool (\w+): (live|replayed)", re.M)


@dataclass
class Outcome:
    run: dict               # the run as the admin API shows it, history included
    first: str              # the first attempt's output
    restarted: list[str]    # each restarted attempt's log, by epoch

    def served(self, output: str) -> list[tuple[str, str]]:
        return TOOL_LINE.findall(output)

    def explain(self, proxy_log: Path) -> str:
        return "\n".join([json.dumps({k: self.run.get(k) for k in ("state", "epoch", "restarts", "history")}),
                          "--- first attempt", self.first[-3000:],
                          *[f"--- restarted\n{text[-3000:]}" for text in self.restarted],
                          "--- proxy", proxy_log.read_text(errors="replace")[-2000:]])


async def _admin(http: aiohttp.ClientSession, url: str, run_id: str) -> dict | None:
    async with http.get(f"{url}/admin/runs/{run_id}", headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
        return await resp.json() if resp.status == 200 else None


def _hook_pids(run: dict) -> tuple[set[int], set[int]]:
    started = {e["pid"] for e in run.get("history", []) if e.get("event") == "hook-started"}
    exited = {e["pid"] for e in run.get("history", []) if e.get("event") == "hook-exit"}
    return started, exited


async def run_recipe(provider, tmp_path: Path, recipe: str, hook: str, *, run_id: str,
                     args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                     first_env: dict[str, str] | None = None, sets: dict[str, str] | None = None,
                     python: str = sys.executable, timeout: float = 90.0) -> tuple[Outcome, Path]:
    """Serve the recipes' config, start ``recipe`` with ``--crash-after charge_card`` (on
    ``python``, which the hooks' ``python`` is too), and wait until the run has ended and every
    attempt the supervisor started has exited."""
    port = services.free_port()
    url = f"http://127.0.0.1:{port}"
    logs = tmp_path / "logs"
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEM_", "IDEMPROXY_"))}
    base_env.update({"PATH": os.path.dirname(python) + os.pathsep + os.environ.get("PATH", ""),
                     "OPENAI_API_KEY": "sk-recipe-test", "PYTHONUNBUFFERED": "1", **(env or {})})
    overrides = {"upstreams.openai.url": provider.url, "upstreams.tools.url": f"{provider.url}/tools",
                 f"hooks.{hook}.log_dir": str(logs), "admin.token": ADMIN,
                 **(sets or {})}
    argv = [sys.executable, "-m", "idemproxy.proxy.cli", "serve", "--config", str(CONFIG), "--port", str(port),
            "--store", f"sqlite:///{tmp_path / 'journal.db'}"]
    for option, value in overrides.items():
        argv += ["--set", f"{option}={value}"]
    proxy_log = tmp_path / "proxy.log"
    with open(proxy_log, "wb") as out:
        proxy = await asyncio.create_subprocess_exec(*argv, cwd=REPO, env=base_env, stdout=out,
                                                     stderr=asyncio.subprocess.STDOUT)
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 20
            while not services.reachable(f"{url}/healthz", 0.2):
                assert proxy.returncode is None and time.monotonic() < deadline, proxy_log.read_text()[-3000:]
                await asyncio.sleep(0.05)
            first_log = tmp_path / "first.log"
            with open(first_log, "wb") as out:
                first = await asyncio.create_subprocess_exec(
                    python, str(RECIPES / recipe), *args, "--crash-after", "charge_card", cwd=REPO,
                    env={**base_env, **(first_env or {}), "IDEM_RUN_ID": run_id, "IDEM_PROXY_URL": url},
                    stdout=out, stderr=asyncio.subprocess.STDOUT)
            code = await asyncio.wait_for(first.wait(), 60)
            assert code == SIGKILLED, first_log.read_text()[-3000:]
            deadline, run = time.monotonic() + timeout, None
            while time.monotonic() < deadline:
                run = await _admin(http, url, run_id)
                if run and run["state"] in ("completed", "failed", "dead"):
                    started, exited = _hook_pids(run)
                    if started <= exited:
                        break
                await asyncio.sleep(0.2)
            assert run is not None, proxy_log.read_text()[-3000:]
            restarted = [p.read_text(errors="replace") for p in sorted(logs.glob(f"*.{run_id}.*.log"))]
            return Outcome(run, first_log.read_text(errors="replace"), restarted), proxy_log
    finally:
        if proxy.returncode is None:
            proxy.terminate()
            try:
                await asyncio.wait_for(proxy.wait(), 15)
            except asyncio.TimeoutError:
                proxy.kill()
                await proxy.wait()


def check_resumed(outcome: Outcome, proxy_log: Path, tool_results: int = 3) -> str:
    """Crashed once after the email and the charge, restarted once, completed: the
    restarted attempt's output."""
    why = outcome.explain(proxy_log)
    assert outcome.run["state"] == "completed", why
    assert outcome.run["epoch"] == 1 and outcome.run["restarts"] == 1, why
    assert outcome.served(outcome.first) == [("send_email", "live"), ("charge_card", "live")], why
    assert "crash: SIGKILL after charge_card" in outcome.first
    (again,) = outcome.restarted
    assert f"done: done: {tool_results} tool calls answered" in again, why
    return again


# -- OpenAI Agents SDK ----------------------------------------------------------------------

# On Chat Completions the SDK's instructions are the first message: the rule for its timestamp there
CHAT_INSTRUCTIONS = '[{ match = "POST /v1/chat/completions", fields = ["messages.0.content"] }]'


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_openai_agents_sdk_resumes_paying_and_charging_once(api, provider, tmp_path):
    """Both model APIs of the SDK, each process with its own PYTHONHASHSEED: the Responses
    `include` list comes in another order after the restart, and ``ignore_order`` (in the
    recipe's config) still finds the journal; the timestamped instructions are left out of
    the fingerprint by ``ignore_fields``."""
    outcome, proxy_log = await run_recipe(
        provider, tmp_path, "openai_agents_agent.py", "openai_agents", run_id=f"agents-{api}",
        env={"AGENT_OPENAI_API": api, "PYTHONHASHSEED": "1"}, first_env={"PYTHONHASHSEED": "0"},
        sets={"upstreams.openai.ignore_fields": CHAT_INSTRUCTIONS} if api == "chat_completions" else None)
    again = check_resumed(outcome, proxy_log)
    why = outcome.explain(proxy_log)
    assert outcome.served(again) == [("send_email", "replayed"), ("charge_card", "replayed"),
                                     ("send_receipt", "live")], why
    model = "responses" if api == "responses" else "chat"
    # four model calls in all: two live before the crash, replayed after it, then two live
    assert {k: provider.calls[k] for k in (model, *SIDE_EFFECTS)} == {model: 4, **SIDE_EFFECTS}, why
    assert provider.calls["traces"] >= 1  # the SDK's tracing stayed on, through the proxy
    if api == "responses":
        includes = [json.loads(s["body"])["include"] for s in provider.seen if s["name"] == "responses"]
        assert len({tuple(i) for i in includes[:2]}) == 1 and len({tuple(i) for i in includes[2:]}) == 1
        assert includes[0] != includes[2] and sorted(includes[0]) == sorted(includes[2])  # the hazard, met


@pytest.mark.parametrize("rule", ["ignore_order", "ignore_fields"])
async def test_openai_agents_sdk_without_either_rule_pays_again(rule, provider, tmp_path):
    """The controls: the same run without one of the rules. The restarted attempt's first
    model calls miss the journal and are paid again (the tools' explicit keys still hold)."""
    outcome, proxy_log = await run_recipe(
        provider, tmp_path, "openai_agents_agent.py", "openai_agents", run_id=f"agents-no-{rule}",
        env={"PYTHONHASHSEED": "1"}, first_env={"PYTHONHASHSEED": "0"},
        sets={f"upstreams.openai.{rule}": "[]"})
    check_resumed(outcome, proxy_log)
    assert provider.calls["responses"] == 6, outcome.explain(proxy_log)
    assert {k: provider.calls[k] for k in SIDE_EFFECTS} == SIDE_EFFECTS


# -- Pydantic AI ------------------------------------------------------------------------------

async def test_pydantic_ai_resumes_paying_and_charging_once(provider, tmp_path):
    """A tool's ModelRetry makes one more model call, journaled and replayed like the rest."""
    outcome, proxy_log = await run_recipe(provider, tmp_path, "pydantic_ai_agent.py", "pydantic_ai",
                                          run_id="pydantic-ai")
    again = check_resumed(outcome, proxy_log, tool_results=4)
    why = outcome.explain(proxy_log)
    assert outcome.first.count("tool charge_card: ModelRetry") == 1
    assert again.count("tool charge_card: ModelRetry") == 1  # the replayed model asked the same
    assert outcome.served(again) == [("send_email", "replayed"), ("charge_card", "replayed"),
                                     ("send_receipt", "live")], why
    # five model calls: three live before the crash (one of them after ModelRetry), two after
    assert {k: provider.calls[k] for k in ("chat", *SIDE_EFFECTS)} == {"chat": 5, **SIDE_EFFECTS}, why


# -- LangGraph with a checkpointer ------------------------------------------------------------

@pytest.mark.parametrize("journaled", [True, False], ids=["journaled", "tools-unjournaled"])
async def test_langgraph_checkpoint_resume_charges_once(journaled, provider, tmp_path):
    """The restarted process resumes the thread from its SQLite checkpoint, which runs the
    tools node again (langchain-ai/langgraph#7417): the journal answers its charge. The
    control passes the tools through unjournaled: the card is charged twice."""
    sets = {} if journaled else {"upstreams.tools.rules": '[{ match = "POST *", policy = "passthrough" }]'}
    outcome, proxy_log = await run_recipe(
        provider, tmp_path, "langgraph_agent.py", "langgraph", run_id=f"langgraph-{journaled}",
        env={"LANGGRAPH_CHECKPOINTS": str(tmp_path / "checkpoints.db")}, sets=sets)
    again = check_resumed(outcome, proxy_log)
    why = outcome.explain(proxy_log)
    assert "resuming before tools" in again, why
    # The checkpoint holds the email and both model calls before the crash: neither is made again.
    assert outcome.served(again) == [("charge_card", "replayed" if journaled else "live"),
                                     ("send_receipt", "live")], why
    charges = 1 if journaled else 2
    assert {k: provider.calls[k] for k in ("chat", *SIDE_EFFECTS)} == {
        "chat": 4, **SIDE_EFFECTS, "tool:charge_card": charges}, why


async def test_openai_agents_sdk_websocket_transport_is_refused_clearly(make_proxy, sqlite_url, provider):
    """The SDK's opt-in WebSocket transport for the Responses API cannot be journaled: the
    proxy refuses the upgrade with problem+json (501 websocket-refused) rather than letting
    model calls pass unrecorded, and nothing reaches the upstream."""
    from agents import Agent, Runner, set_default_openai_client, set_default_openai_responses_transport
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI
    from websockets.exceptions import InvalidStatus

    proxy = await make_proxy(sqlite_url)
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=f"{proxy.url}/runs/ws-1/openai/v1", api_key="sk-ws"))
    set_default_openai_responses_transport("websocket")
    try:
        with pytest.raises(InvalidStatus) as refused:
            await Runner.run(Agent(name="orders", instructions="Be brief.", model="gpt-4o-mini"), "hi")
    finally:
        set_default_openai_responses_transport("http")
        set_tracing_disabled(False)
    answer = refused.value.response
    assert answer.status_code == 501
    assert answer.headers["Content-Type"].startswith("application/problem+json")
    problem = json.loads(answer.body)
    assert problem["type"].endswith("/websocket-refused") and "HTTP transport" in problem["detail"]
    assert provider.calls["responses"] == 0 and not provider.seen


# -- Microsoft Agent Framework ------------------------------------------------------------------

@pytest.mark.parametrize("journaled", [True, False], ids=["journaled", "tools-unjournaled"])
async def test_agent_framework_checkpoint_resume_sends_once(journaled, provider, tmp_path):
    """The restarted process resumes the workflow from its latest file checkpoint, taken before
    the ``fulfil`` step: the framework runs that step's whole agent turn again
    (microsoft/agent-framework#3938). Journaled, its model calls and tool calls are answered
    from the journal; the control, tools unjournaled, emails and charges twice."""
    sets = {} if journaled else {"upstreams.tools.rules": '[{ match = "POST *", policy = "passthrough" }]'}
    outcome, proxy_log = await run_recipe(
        provider, tmp_path, "agent_framework_agent.py", "agent_framework", run_id=f"maf-{journaled}",
        env={"AGENT_FRAMEWORK_CHECKPOINTS": str(tmp_path / "checkpoints")}, sets=sets)
    again = check_resumed(outcome, proxy_log)
    why = outcome.explain(proxy_log)
    assert "resuming from checkpoint" in again, why
    served = "replayed" if journaled else "live"
    assert outcome.served(again) == [("send_email", served), ("charge_card", served),
                                     ("send_receipt", "live")], why
    twice = 1 if journaled else 2
    # Journaled, the repeated turn's two model calls are replayed: 4 in all. Unjournaled, the
    # email sent again answers with another id, so the second model call is another request
    # and is paid again too: 5.
    assert {k: provider.calls[k] for k in ("chat", *SIDE_EFFECTS)} == {
        "chat": 4 if journaled else 5, **SIDE_EFFECTS, "tool:send_email": twice, "tool:charge_card": twice}, why


# -- a stdio MCP server behind mcp-proxy ---------------------------------------------------------

def mcp_proxy_bin() -> str:
    """The bridge, installed by scripts/test in a venv of its own: mcp-proxy pins mcp<2, the
    test extra needs mcp>=2.3 (docs/recipes.md, "stdio MCP servers")."""
    path = os.environ.get("MCP_PROXY_BIN") or str(REPO / ".venv-mcp-proxy" / "bin" / "mcp-proxy")
    assert os.access(path, os.X_OK), f"{path} missing: scripts/test installs mcp-proxy there"
    return path


async def test_stdio_mcp_tools_through_mcp_proxy_run_once(provider, tmp_path):
    """An Agents SDK agent whose tools are a stdio MCP server behind the mcp-proxy bridge,
    routed through a ``kind = "mcp"`` upstream: killed after the charge, restarted, and each
    tool executed once (the server's own outbox file counts), each model call paid once."""
    outbox = tmp_path / "outbox.jsonl"
    port = services.free_port()
    bridge_log = tmp_path / "mcp-proxy.log"
    with open(bridge_log, "wb") as out:
        bridge = await asyncio.create_subprocess_exec(
            mcp_proxy_bin(), "--port", str(port), "--", sys.executable, str(RECIPES / "stdio_tools.py"),
            "--outbox", str(outbox), cwd=REPO, stdout=out, stderr=asyncio.subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not services.reachable(f"http://127.0.0.1:{port}/status", 0.2):
            assert bridge.returncode is None and time.monotonic() < deadline, bridge_log.read_text()[-2000:]
            await asyncio.sleep(0.1)
        outcome, proxy_log = await run_recipe(
            provider, tmp_path, "mcp_stdio_agent.py", "mcp_stdio", run_id="mcp-stdio",
            sets={"upstreams.mcp.url": f"http://127.0.0.1:{port}"})
    finally:
        bridge.terminate()
        await bridge.wait()
    why = outcome.explain(proxy_log) + "\n--- mcp-proxy\n" + bridge_log.read_text(errors="replace")[-2000:]
    assert outcome.run["state"] == "completed" and outcome.run["restarts"] == 1, why
    assert "crash: SIGKILL after charge_card" in outcome.first, why
    (again,) = outcome.restarted
    assert "done: done: 3 tool calls answered" in again, why
    executed = [json.loads(line)["tool"] for line in outbox.read_text().splitlines()]
    assert executed == ["send_email", "charge_card", "send_receipt"], why  # each once, in order
    # The restarted attempt was told what the crashed one was: "email 1 sent", "charge 2 made".
    results = re.findall(r"^tool (\w+): (.*)$", again, re.M)
    assert results[:2] == re.findall(r"^tool (\w+): (.*)$", outcome.first, re.M), why
    assert "email 1 sent" in results[0][1] and "charge 2 made" in results[1][1] and "receipt 3" in results[2][1]
    assert provider.calls["responses"] == 4, why


# -- Strands Agents ----------------------------------------------------------------------------------

def own_venv(name: str) -> str:
    """The python of a framework installed by scripts/test in a venv of its own, because it
    pins what the test extra outgrew (docs/recipes.md says which)."""
    path = REPO / f".venv-{name}" / "bin" / "python"
    assert os.access(path, os.X_OK), f"{path} missing: scripts/test installs {name} there"
    return str(path)


async def test_strands_resumes_paying_and_charging_once(provider, tmp_path):
    """Strands streams every model call: the restarted attempt's are replayed as the recorded
    streams, and its tools' explicit keys answer the email and the charge."""
    outcome, proxy_log = await run_recipe(provider, tmp_path, "strands_agent.py", "strands", run_id="strands",
                                          python=own_venv("strands"))
    again = check_resumed(outcome, proxy_log)
    why = outcome.explain(proxy_log)
    assert outcome.served(again) == [("send_email", "replayed"), ("charge_card", "replayed"),
                                     ("send_receipt", "live")], why
    assert all(json.loads(s["body"]).get("stream") for s in provider.seen if s["name"] == "chat")
    assert {k: provider.calls[k] for k in ("chat", *SIDE_EFFECTS)} == {"chat": 4, **SIDE_EFFECTS}, why


# -- CrewAI --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("journaled", [True, False], ids=["journaled", "tools-unjournaled"])
async def test_crewai_task_retry_and_restart_charge_once(journaled, provider, tmp_path):
    """The task's guardrail turns the first answer down and CrewAI runs the task again, every
    tool with it (crewAIInc/crewAI#5802); the process is also killed after the first charge and
    restarted. Journaled: one email, one charge, one receipt. The control, tools unjournaled:
    three emails, three charges, two receipts."""
    sets = {} if journaled else {"upstreams.tools.rules": '[{ match = "POST *", policy = "passthrough" }]'}
    outcome, proxy_log = await run_recipe(provider, tmp_path, "crewai_agent.py", "crewai",
                                          run_id=f"crewai-{journaled}", python=own_venv("crewai"), sets=sets)
    again = check_resumed(outcome, proxy_log)
    why = outcome.explain(proxy_log)
    assert again.count("guardrail: review") == 2, why  # the task ran twice in the restarted attempt
    first_run = "replayed" if journaled else "live"
    retried = "replayed" if journaled else "live"
    assert outcome.served(again) == [("send_email", first_run), ("charge_card", first_run), ("send_receipt", "live"),
                                     ("send_email", retried), ("charge_card", retried),
                                     ("send_receipt", retried)], why
    if journaled:
        # 4 model calls of the first run of the task (2 before the crash, replayed after it), and
        # 4 of its retry, a new prompt with the guardrail's feedback: each paid once
        assert {k: provider.calls[k] for k in ("chat", *SIDE_EFFECTS)} == {"chat": 8, **SIDE_EFFECTS}, why
    else:
        assert {k: provider.calls[k] for k in SIDE_EFFECTS} == {
            "tool:send_email": 3, "tool:charge_card": 3, "tool:send_receipt": 2}, why
