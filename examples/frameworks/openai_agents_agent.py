"""The OpenAI Agents SDK through idemproxy: a normal agent, four lines changed.

An order agent with three function tools that act on the world (send an email, charge a
card, send a receipt). What makes it crash-safe, marked ``# idemproxy`` below:

1. ``Run`` around the whole, so a restarted process continues the same run;
2. the SDK's default client on the run's base URL (``run.url("openai", "/v1")``): every model
   call, Responses or Chat Completions, is journaled under a key the proxy derives;
3. the tools' HTTP calls through the run (``run.client("tools")``) with explicit keys
   (``run.key(...)``): the same key in every attempt, so a replay is the recorded answer;
4. the SDK's traces sent through the proxy too (passthrough, never recorded) — or leave them
   on their default, OpenAI's endpoint, which the journal does not need.

The instructions are dynamic, with the time in them, as the SDK's docs show: every attempt's
differ, so the recipe's configuration leaves them out of the fingerprint (``ignore_fields``).
The SDK's own retries stay at their defaults (the OpenAI client retries 408, 409, 429 and 5xx,
and the proxy records none of those), and so does tracing.

    IDEM_RUN_ID=order-42 python examples/frameworks/openai_agents_agent.py --crash-after charge_card

``--crash-after TOOL`` SIGKILLs the process right after that tool's side effect, before the
SDK hears of it; the supervisor starts this file again (hook ``openai_agents`` in
examples/frameworks/config.toml) and the new attempt replays up to there, then goes live.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from datetime import datetime, timezone

from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_api,
                    set_default_openai_client, set_trace_processors)
from agents.tracing.processors import BackendSpanExporter, BatchTraceProcessor
from openai import AsyncOpenAI

from idemproxy_client import Run

ORDER = {"order": "42", "email": "ada@example.com", "amount_cents": 4200}
# The fake provider (tests/support/fake_provider.py) plays the model: it follows this plan line.
PLAN = [{"tool": "send_email", "args": {"to": ORDER["email"], "subject": "Order 42 is on its way"}},
        {"tool": "charge_card", "args": {"order": ORDER["order"], "amount_cents": ORDER["amount_cents"]}},
        {"tool": "send_receipt", "args": {"to": ORDER["email"], "order": ORDER["order"]}}]
INSTRUCTIONS = "You fulfil orders: email the customer, charge the card, send the receipt."


def instructions(context, agent: Agent) -> str:
    """Dynamic instructions with a timestamp: a new fingerprint every second, unless the
    configuration ignores the field (examples/frameworks/config.toml, ``ignore_fields``)."""
    return f"{INSTRUCTIONS} It is {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC."


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=["responses", "chat_completions"],
                        default=os.environ.get("AGENT_OPENAI_API", "responses"),
                        help="the SDK's model API (default: responses, or $AGENT_OPENAI_API)")
    parser.add_argument("--crash-after", metavar="TOOL", help="SIGKILL this process after TOOL's call")
    return parser.parse_args()


def build_agent(run: Run, crash_after: str | None) -> Agent:
    tools = run.client("tools", timeout=30)  # idemproxy: the tools' calls go through the run

    def call(tool: str, payload: dict, *key_parts) -> dict:
        answer = tools.post(f"/{tool}", json=payload,
                            headers={"Idempotency-Key": run.key(tool, *key_parts)})  # idemproxy
        answer.raise_for_status()
        served = "replayed" if answer.headers.get("idempotent-replayed") == "true" else "live"
        print(f"tool {tool}: {served} #{answer.json()['n']}", flush=True)
        if tool == crash_after:  # after the side effect, before the SDK hears of it
            print(f"crash: SIGKILL after {tool}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return answer.json()

    @function_tool
    def send_email(to: str, subject: str) -> str:
        """Email a customer."""
        return f"email {call('send_email', {'to': to, 'subject': subject}, to, subject)['n']} sent"

    @function_tool
    def charge_card(order: str, amount_cents: int) -> str:
        """Charge the card on file for an order."""
        return f"charge {call('charge_card', {'order': order, 'amount_cents': amount_cents}, order)['n']} made"

    @function_tool
    def send_receipt(to: str, order: str) -> str:
        """Send the receipt of an order."""
        return f"receipt {call('send_receipt', {'to': to, 'order': order}, order)['n']} sent"

    return Agent(name="orders", instructions=instructions, model="gpt-4o-mini",
                 tools=[send_email, charge_card, send_receipt],
                 # A stateless (store=False) agent keeps its reasoning and asks for logprobs:
                 # two `include` values, which the SDK sends in set order (docs/recipes.md).
                 model_settings=ModelSettings(store=False, top_logprobs=2,
                                              response_include=["reasoning.encrypted_content"]))


def main() -> int:
    args = parse_args()
    with Run(hook="openai_agents", attach=True) as run:  # idemproxy
        print(f"run {run.run_id} epoch {run.epoch}: {args.api}", flush=True)
        base_url = run.url("openai", "/v1")  # idemproxy
        # The credential decides the journal's tenant: every attempt sends the same one.
        set_default_openai_client(AsyncOpenAI(base_url=base_url,
                                              api_key=os.environ.get("OPENAI_API_KEY") or "idemproxy-injected"))
        set_default_openai_api(args.api)
        set_trace_processors([BatchTraceProcessor(BackendSpanExporter(endpoint=f"{base_url}/traces/ingest"))])
        prompt = f"Fulfil order {ORDER['order']} for {ORDER['email']}.\nPLAN: {json.dumps(PLAN)}"
        result = asyncio.run(Runner.run(build_agent(run, args.crash_after), prompt))
    print(f"done: {result.final_output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
