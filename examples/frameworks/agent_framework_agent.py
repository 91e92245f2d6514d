"""Microsoft Agent Framework through idemproxy: a checkpointed workflow, three lines changed.

A two-step workflow, ``intake -> fulfil``, with file checkpoints: ``fulfil`` runs an ``Agent``
whose tools act on the world (send an email, charge a card, send a receipt). A restarted
process resumes from the latest checkpoint, which the framework takes between supersteps: the
``fulfil`` step that was in flight runs again from its start, its agent turn and every tool
call in it (microsoft/agent-framework#3938: a checkpoint retry duplicated every side effect).
What makes it safe, marked ``# idemproxy`` below:

1. ``Run`` around the whole, so a restarted process continues the same run;
2. the chat client on the run's base URL (``base_url=run.url("openai", "/v1")``): the repeated
   turn's model calls are the same requests, answered from the journal (derived keys);
3. the tools' HTTP calls through the run (``run.client("tools")``) with explicit keys
   (``run.key(...)``): the repeated tool calls are answered from the journal too.

    IDEM_RUN_ID=order-45 python examples/frameworks/agent_framework_agent.py --crash-after charge_card

``--crash-after TOOL`` SIGKILLs the process right after that tool's side effect; the
supervisor starts this file again (hook ``agent_framework`` in examples/frameworks/config.toml).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from agent_framework import (Agent, Executor, FileCheckpointStorage, WorkflowBuilder, WorkflowContext, handler,
                             tool)
from agent_framework.openai import OpenAIChatCompletionClient
from typing_extensions import Never

from idemproxy_client import Run

ORDER = {"order": "45", "email": "edsger@example.com", "amount_cents": 5100}
# The fake provider (tests/support/fake_provider.py) plays the model: it follows this plan line.
PLAN = [{"tool": "send_email", "args": {"to": ORDER["email"], "subject": "Order 45 is on its way"}},
        {"tool": "charge_card", "args": {"order": ORDER["order"], "amount_cents": ORDER["amount_cents"]}},
        {"tool": "send_receipt", "args": {"to": ORDER["email"], "order": ORDER["order"]}}]
INSTRUCTIONS = "You fulfil orders: email the customer, charge the card, send the receipt."
CHECKPOINTS = os.environ.get("AGENT_FRAMEWORK_CHECKPOINTS", "examples/frameworks/checkpoints")


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
        if name == crash_after:  # after the side effect, before the next checkpoint
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

    client = OpenAIChatCompletionClient(model="gpt-4o-mini", base_url=run.url("openai", "/v1"),  # idemproxy
                                        # The credential decides the journal's tenant: the same in every attempt.
                                        api_key=os.environ.get("OPENAI_API_KEY") or "idemproxy-injected")
    return Agent(client=client, name="orders", instructions=INSTRUCTIONS,
                 tools=[send_email, charge_card, send_receipt])


class Intake(Executor):
    @handler
    async def take(self, order: str, ctx: WorkflowContext[str]) -> None:
        await ctx.send_message(order)


class Fulfil(Executor):
    def __init__(self, agent: Agent) -> None:
        super().__init__(id="fulfil")
        self.agent = agent

    @handler
    async def fulfil(self, order: str, ctx: WorkflowContext[Never, str]) -> None:
        response = await self.agent.run(order)
        await ctx.yield_output(response.text)


async def fulfil_order(run: Run, crash_after: str | None) -> str:
    storage = FileCheckpointStorage(CHECKPOINTS)
    intake = Intake(id="intake")
    workflow = WorkflowBuilder(name=f"orders-{run.run_id}", start_executor=intake, checkpoint_storage=storage
                               ).add_edge(intake, Fulfil(build_agent(run, crash_after))).build()
    latest = await storage.get_latest(workflow_name=workflow.name)
    print(f"run {run.run_id} epoch {run.epoch}: "
          f"{'resuming from checkpoint ' + latest.checkpoint_id if latest else 'new workflow'}", flush=True)
    if latest:  # the framework's resume: the step in flight runs again from its start
        result = await workflow.run(checkpoint_id=latest.checkpoint_id)
    else:
        result = await workflow.run(f"Fulfil order {ORDER['order']} for {ORDER['email']}.\nPLAN: {json.dumps(PLAN)}")
    return " ".join(str(output) for output in result.get_outputs())


def main() -> int:
    args = parse_args()
    with Run(hook="agent_framework", attach=True) as run:  # idemproxy
        output = asyncio.run(fulfil_order(run, args.crash_after))
    print(f"done: {output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
