"""The JavaScript framework recipes (examples/frameworks/js, docs/recipes.md) run as their users run them.

Like the Python recipes (tests/clients/test_frameworks.py, whose harness this reuses): the fake
provider, a real ``idemproxy serve --config examples/frameworks/config.toml``, and the recipe's
first attempt on ``node`` with ``--crash-after charge_card``. The supervisor starts the recipe
again through its command hook, which runs ``node``; the counts prove every model call was
paid once and every side effect happened once, with the SDKs' own retries at their defaults.

The recipes' packages are the devDependencies of examples/frameworks/js/package.json, installed
there by scripts/test (``npm ci`` from the committed lockfile); @idemproxy/client is linked from
clients/typescript, built by its own ``npm test`` before.
"""

from __future__ import annotations

import re
import shutil

import pytest

from test_frameworks import RECIPES, SIDE_EFFECTS, check_resumed, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.frameworks]  # node processes SIGKILLed and restarted

PROJECT = RECIPES / "js"
ANSWERED = re.compile(r"^tool (\w+): \w+ #(\d+)$", re.M)  # which tool, and its answer's number


def node() -> str:
    """``node``, with the recipes' packages installed and the client built."""
    path = shutil.which("node")
    assert path, "node is not installed: scripts/test installs it"
    for needed in ("@openai/agents", "@langchain/langgraph", "@idemproxy/client/dist/index.js"):
        assert (PROJECT / "node_modules" / needed).exists(), (
            f"{needed} missing: scripts/test runs `npm ci` in {PROJECT} after building clients/typescript")
    return path


async def resumed_at_the_receipt(provider, tmp_path, recipe: str, hook: str, model_api: str):
    """Run ``recipe`` through its crash and restart; check that the restarted attempt was answered
    the email and the charge from the journal and went live at the receipt, with four model
    calls on ``model_api`` in all (two live before the crash, replayed after it, then two live).
    Returns the outcome, the restarted attempt's output, and what explains a failure."""
    outcome, proxy_log = await run_recipe(provider, tmp_path, recipe, hook, run_id=hook.replace("_", "-"),
                                          python=node())
    again = check_resumed(outcome, proxy_log)
    why = outcome.explain(proxy_log)
    assert outcome.served(again) == [("send_email", "replayed"), ("charge_card", "replayed"),
                                     ("send_receipt", "live")], why
    assert {k: provider.calls[k] for k in (model_api, *SIDE_EFFECTS)} == {model_api: 4, **SIDE_EFFECTS}, why
    return outcome, again, why


async def test_openai_agents_js_resumes_paying_and_charging_once(provider, tmp_path):
    """OpenAI Agents JS on the Responses API, its client set by ``setDefaultOpenAIClient``."""
    outcome, again, why = await resumed_at_the_receipt(provider, tmp_path, "js/openai_agents_agent.mjs",
                                                       "js_openai_agents", "responses")
    assert provider.calls["chat"] == 0
    assert provider.calls["traces"] >= 1, why  # the SDK's tracing stayed on, through the proxy
    # The restarted attempt was told what the crashed one was: the same tool answers.
    assert ANSWERED.findall(again)[:2] == ANSWERED.findall(outcome.first), why


async def test_langgraph_js_resumes_paying_and_charging_once(provider, tmp_path):
    """LangGraph.js with ``ChatOpenAI({ configuration })`` on Chat Completions, no checkpoint
    across processes: the restarted graph runs from the start, every call the crashed attempt
    made is answered from the journal, and it goes live at the receipt."""
    outcome, again, why = await resumed_at_the_receipt(provider, tmp_path, "js/langgraph_agent.mjs",
                                                       "js_langgraph", "chat")
    assert provider.calls["responses"] == 0
    assert ANSWERED.findall(again)[:2] == ANSWERED.findall(outcome.first), why
