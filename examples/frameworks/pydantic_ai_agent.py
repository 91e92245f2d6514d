"""Pydantic AI through idemproxy: a normal agent, three lines changed.

An order agent with three tools that act on the world (send an email, charge a card, send a
receipt). What makes it crash-safe, marked ``# idemproxy`` below:

1. ``Run`` around the whole, so a restarted process continues the same run;
2. the model's provider on the run's base URL (``OpenAIProvider(base_url=run.url("openai", "/v1"))``):
   every model call is journaled under a key the proxy derives;
3. the tools' HTTP calls through the run (``run.client("tools")``) with explicit keys
   (``run.key(...)``): the same key in every attempt, so a replay is the recorded answer.

Pydantic AI's retries stay on: ``charge_card`` refuses an amount that is not positive with
``ModelRetry``, which sends the model the error and asks again — a new conversation, so a
new model call, journaled like any other (and replayed after a crash like any other). The
OpenAI client under it retries 408, 409, 429 and 5xx, none of which the proxy records.

    IDEM_RUN_ID=order-43 python examples/frameworks/pydantic_ai_agent.py --crash-after charge_card

``--crash-after TOOL`` SIGKILLs the process right after that tool's side effect; the
supervisor starts this file again (hook ``pydantic_ai`` in examples/frameworks/config.toml).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from pydantic_ai import Agent, ModelRetry
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from idemproxy_client import Run

ORDER = {"order": "43", "email": "grace@example.com", "amount_cents": 1999}
# The fake provider (tests/support/fake_provider.py) plays the model: it follows this plan line. Its
# first charge has no amount, the tool answers ModelRetry, and the model tries again.
PLAN = [{"tool": "send_email", "args": {"to": ORDER["email"], "subject": "Order 43 is on its way"}},
        {"tool": "charge_card", "args": {"order": ORDER["order"], "amount_cents": 0}},
        {"tool": "charge_card", "args": {"order": ORDER["order"], "amount_cents": ORDER["amount_cents"]}},
        {"tool": "send_receipt", "args": {"to": ORDER["email"], "order": ORDER["order"]}}]
INSTRUCTIONS = "You fulfil orders: email the customer, charge the card, send the receipt."


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crash-after", metavar="TOOL", help="SIGKILL this process after TOOL's call")
    return parser.parse_args()


def build_agent(run: Run, crash_after: str | None) -> Agent:
    model = OpenAIChatModel("gpt-4o-mini", provider=OpenAIProvider(
        base_url=run.url("openai", "/v1"),  # idemproxy
        # The credential decides the journal's tenant: every attempt sends the same one.
        api_key=os.environ.get("OPENAI_API_KEY") or "idemproxy-injected"))
    agent = Agent(model, instructions=INSTRUCTIONS, retries=2)
    tools = run.client("tools", timeout=30)  # idemproxy: the tools' calls go through the run

    def call(tool: str, payload: dict, *key_parts) -> dict:
        answer = tools.post(f"/{tool}", json=payload,
                            headers={"Idempotency-Key": run.key(tool, *key_parts)})  # idemproxy
        answer.raise_for_status()
        served = "replayed" if answer.headers.get("idempotent-replayed") == "true" else "live"
        print(f"tool {tool}: {served} #{answer.json()['n']}", flush=True)
        if tool == crash_after:  # after the side effect, before Pydantic AI hears of it
            print(f"crash: SIGKILL after {tool}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return answer.json()

    @agent.tool_plain
    def send_email(to: str, subject: str) -> str:
        """Email a customer."""
        return f"email {call('send_email', {'to': to, 'subject': subject}, to, subject)['n']} sent"

    @agent.tool_plain
    def charge_card(order: str, amount_cents: int) -> str:
        """Charge the card on file for an order."""
        if amount_cents <= 0:
            print("tool charge_card: ModelRetry", flush=True)
            raise ModelRetry("amount_cents must be the order's total, a positive number of cents")
        return f"charge {call('charge_card', {'order': order, 'amount_cents': amount_cents}, order)['n']} made"

    @agent.tool_plain
    def send_receipt(to: str, order: str) -> str:
        """Send the receipt of an order."""
        return f"receipt {call('send_receipt', {'to': to, 'order': order}, order)['n']} sent"

    return agent


def main() -> int:
    args = parse_args()
    with Run(hook="pydantic_ai", attach=True) as run:  # idemproxy
        print(f"run {run.run_id} epoch {run.epoch}", flush=True)
        prompt = f"Fulfil order {ORDER['order']} for {ORDER['email']}.\nPLAN: {json.dumps(PLAN)}"
        result = build_agent(run, args.crash_after).run_sync(prompt)
    print(f"done: {result.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
