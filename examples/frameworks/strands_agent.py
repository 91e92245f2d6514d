"""Strands Agents through idemproxy: a normal agent, three lines changed.

An order agent with three ``@tool`` functions that act on the world (send an email, charge a
card, send a receipt). What makes it crash-safe, marked ``# idemproxy`` below:

1. ``Run`` around the whole, so a restarted process continues the same run;
2. the ``OpenAIModel``'s client on the run's base URL (``client_args={"base_url": run.url("openai", "/v1")}``):
   every model call — streamed, as Strands streams by default — is journaled under a key the proxy
   derives, and a replay is the recorded stream;
3. the tools' HTTP calls through the run (``run.client("tools")``) with explicit keys
   (``run.key(...)``): the same key in every attempt and process, which is the stable tool-call
   key strands-agents/harness-sdk#2884 asks for.

Strands' own retries (``ModelRetryStrategy``: throttled model calls, with backoff) stay on;
the proxy records none of the answers that cause them.

    IDEM_RUN_ID=order-47 python examples/frameworks/strands_agent.py --crash-after charge_card

``--crash-after TOOL`` SIGKILLs the process right after that tool's side effect; the
supervisor starts this file again (hook ``strands`` in examples/frameworks/config.toml).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from strands import Agent, tool
from strands.models.openai import OpenAIModel

from idemproxy_client import Run

ORDER = {"order": "47", "email": "frances@example.com", "amount_cents": 880}
# The fake provider (tests/support/fake_provider.py) plays the model: it follows this plan line.
PLAN = [{"tool": "send_email", "args": {"to": ORDER["email"], "subject": "Order 47 is on its way"}},
        {"tool": "charge_card", "args": {"order": ORDER["order"], "amount_cents": ORDER["amount_cents"]}},
        {"tool": "send_receipt", "args": {"to": ORDER["email"], "order": ORDER["order"]}}]
INSTRUCTIONS = "You fulfil orders: email the customer, charge the card, send the receipt."


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crash-after", metavar="TOOL", help="SIGKILL this process after TOOL's call")
    return parser.parse_args()


def build_agent(run: Run, crash_after: str | None) -> Agent:
    http = run.client("tools", timeout=30)  # idemproxy: the tools' calls go through the run

    def call(name: str, payload: dict, *key_parts) -> dict:
        answer = http.post(f"/{name}", json=payload,
                           headers={"Idempotency-Key": run.key(name, *key_parts)})  # idemproxy
        answer.raise_for_status()
        served = "replayed" if answer.headers.get("idempotent-replayed") == "true" else "live"
        print(f"tool {name}: {served} #{answer.json()['n']}", flush=True)
        if name == crash_after:  # after the side effect, before Strands hears of it
            print(f"crash: SIGKILL after {name}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return answer.json()

    @tool
    def send_email(to: str, subject: str) -> str:
        """Email a customer."""
        return f"email {call('send_email', {'to': to, 'subject': subject}, to, subject)['n']} sent"

    @tool
    def charge_card(order: str, amount_cents: int) -> str:
        """Charge the card on file for an order."""
        return f"charge {call('charge_card', {'order': order, 'amount_cents': amount_cents}, order)['n']} made"

    @tool
    def send_receipt(to: str, order: str) -> str:
        """Send the receipt of an order."""
        return f"receipt {call('send_receipt', {'to': to, 'order': order}, order)['n']} sent"

    model = OpenAIModel(model_id="gpt-4o-mini", client_args={
        "base_url": run.url("openai", "/v1"),  # idemproxy
        # The credential decides the journal's tenant: every attempt sends the same one.
        "api_key": os.environ.get("OPENAI_API_KEY") or "idemproxy-injected"})
    return Agent(model=model, system_prompt=INSTRUCTIONS, tools=[send_email, charge_card, send_receipt],
                 callback_handler=None)


def main() -> int:
    args = parse_args()
    with Run(hook="strands", attach=True) as run:  # idemproxy
        print(f"run {run.run_id} epoch {run.epoch}", flush=True)
        prompt = f"Fulfil order {ORDER['order']} for {ORDER['email']}.\nPLAN: {json.dumps(PLAN)}"
        result = build_agent(run, args.crash_after)(prompt)
    print(f"done: {str(result).strip()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
