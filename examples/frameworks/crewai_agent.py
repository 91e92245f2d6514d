"""CrewAI through idemproxy: a crew whose task is retried, three lines changed.

One agent, one task with a guardrail, three tools that act on the world (send an email,
charge a card, send a receipt). The guardrail turns the first answer down, as a guardrail
does, and CrewAI runs the task again with its feedback: the agent starts over and calls every
tool again (crewAIInc/crewAI#5802: no idempotency guard on the tools a retried task re-runs —
duplicate payments, emails). What makes it safe, marked ``# idemproxy`` below:

1. ``Run`` around the whole, so a restarted process continues the same run;
2. the ``LLM`` on the run's base URL (``base_url=run.url("openai", "/v1")``): model calls journaled;
3. the tools' HTTP calls through the run (``run.client("tools")``) with explicit keys
   (``run.key(...)``): the retried task's tool calls, and a restarted process's, are answered
   from the journal.

The retried task's model calls are new calls (its prompt carries the guardrail's feedback):
they go upstream, once each, and are journaled like the rest.

    IDEM_RUN_ID=order-48 python examples/frameworks/crewai_agent.py --crash-after charge_card

``--crash-after TOOL`` SIGKILLs the process right after that tool's side effect; the
supervisor starts this file again (hook ``crewai`` in examples/frameworks/config.toml).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")  # no calls home from the examples
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

from crewai import LLM, Agent, Crew, Task  # noqa: E402  (after the telemetry switches)
from crewai.tools import tool  # noqa: E402

from idemproxy_client import Run  # noqa: E402

ORDER = {"order": "48", "email": "ken@example.com", "amount_cents": 6400}
# The fake provider (tests/support/fake_provider.py) plays the model: it follows this plan line.
PLAN = [{"tool": "send_email", "args": {"to": ORDER["email"], "subject": "Order 48 is on its way"}},
        {"tool": "charge_card", "args": {"order": ORDER["order"], "amount_cents": ORDER["amount_cents"]}},
        {"tool": "send_receipt", "args": {"to": ORDER["email"], "order": ORDER["order"]}}]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crash-after", metavar="TOOL", help="SIGKILL this process after TOOL's call")
    return parser.parse_args()


def build_crew(run: Run, crash_after: str | None) -> Crew:
    http = run.client("tools", timeout=30)  # idemproxy: the tools' calls go through the run

    def call(name: str, payload: dict, *key_parts) -> dict:
        answer = http.post(f"/{name}", json=payload,
                           headers={"Idempotency-Key": run.key(name, *key_parts)})  # idemproxy
        answer.raise_for_status()
        served = "replayed" if answer.headers.get("idempotent-replayed") == "true" else "live"
        print(f"tool {name}: {served} #{answer.json()['n']}", flush=True)
        if name == crash_after:  # after the side effect, before CrewAI hears of it
            print(f"crash: SIGKILL after {name}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return answer.json()

    @tool("send_email")
    def send_email(to: str, subject: str) -> str:
        """Email a customer."""
        return f"email {call('send_email', {'to': to, 'subject': subject}, to, subject)['n']} sent"

    @tool("charge_card")
    def charge_card(order: str, amount_cents: int) -> str:
        """Charge the card on file for an order."""
        return f"charge {call('charge_card', {'order': order, 'amount_cents': amount_cents}, order)['n']} made"

    @tool("send_receipt")
    def send_receipt(to: str, order: str) -> str:
        """Send the receipt of an order."""
        return f"receipt {call('send_receipt', {'to': to, 'order': order}, order)['n']} sent"

    reviews = []

    def reviewed(output):  # CrewAI reads an annotation here: none, or exactly Tuple[bool, Any]
        """The guardrail: the first answer is sent back for a retry, the second is taken."""
        reviews.append(output.raw)
        print(f"guardrail: review {len(reviews)}", flush=True)
        if len(reviews) == 1:
            return False, "Confirm the order number in your answer."
        return True, output.raw

    llm = LLM(model="gpt-4o-mini", base_url=run.url("openai", "/v1"),  # idemproxy
              # The credential decides the journal's tenant: every attempt sends the same one.
              api_key=os.environ.get("OPENAI_API_KEY") or "idemproxy-injected")
    clerk = Agent(role="Order clerk", goal="Fulfil orders exactly once", llm=llm,
                  backstory="You email the customer, charge the card and send the receipt.",
                  tools=[send_email, charge_card, send_receipt], allow_delegation=False)
    task = Task(description=f"Fulfil order {ORDER['order']} for {ORDER['email']}.\nPLAN: {json.dumps(PLAN)}",
                expected_output="What was done for the order.", agent=clerk,
                guardrail=reviewed, guardrail_max_retries=2)
    return Crew(agents=[clerk], tasks=[task])


def main() -> int:
    args = parse_args()
    with Run(hook="crewai", attach=True) as run:  # idemproxy
        print(f"run {run.run_id} epoch {run.epoch}", flush=True)
        result = build_crew(run, args.crash_after).kickoff()
    print(f"done: {result.raw}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
