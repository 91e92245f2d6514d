"""LangGraph with a checkpointer through idemproxy: a normal tool-calling graph, three lines changed.

The graph every LangGraph tutorial builds: a model node with tools bound, a ``ToolNode``, and
``tools_condition`` between them, compiled with a durable checkpointer (``SqliteSaver``) and
one thread per run. A restarted process resumes the thread from its last checkpoint. That
alone re-runs the node that was in flight when the process died: here the tools node, right
after it charged the card (langchain-ai/langgraph#7417) — the charge would go out twice.
What makes it safe, marked ``# idemproxy`` below:

1. ``Run`` around the whole, so a restarted process continues the same run (and thread);
2. ``ChatOpenAI`` on the run's base URL (``run.url("openai", "/v1")``): model calls journaled;
3. the tools' HTTP calls through the run (``run.client("tools")``) with explicit keys
   (``run.key(...)``): the tools node that runs again is answered from the journal.

The checkpointer and the journal meet without overlap: model calls the checkpoint already
holds are not made again, and the one node it runs again finds its calls recorded.
ChatOpenAI's retries (``max_retries``, 2 by default) stay on.

    IDEM_RUN_ID=order-44 python examples/frameworks/langgraph_agent.py --crash-after charge_card

``--crash-after TOOL`` SIGKILLs the process right after that tool's side effect; the
supervisor starts this file again (hook ``langgraph`` in examples/frameworks/config.toml).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic import SecretStr

from idemproxy_client import Run

ORDER = {"order": "44", "email": "alan@example.com", "amount_cents": 7300}
# The fake provider (tests/support/fake_provider.py) plays the model: it follows this plan line.
PLAN = [{"tool": "send_email", "args": {"to": ORDER["email"], "subject": "Order 44 is on its way"}},
        {"tool": "charge_card", "args": {"order": ORDER["order"], "amount_cents": ORDER["amount_cents"]}},
        {"tool": "send_receipt", "args": {"to": ORDER["email"], "order": ORDER["order"]}}]
INSTRUCTIONS = "You fulfil orders: email the customer, charge the card, send the receipt."
CHECKPOINTS = os.environ.get("LANGGRAPH_CHECKPOINTS", "examples/frameworks/checkpoints.db")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crash-after", metavar="TOOL", help="SIGKILL this process after TOOL's call")
    return parser.parse_args()


def build_graph(run: Run, crash_after: str | None, checkpointer: SqliteSaver):
    http = run.client("tools", timeout=30)  # idemproxy: the tools' calls go through the run

    def call(name: str, payload: dict, *key_parts) -> dict:
        answer = http.post(f"/{name}", json=payload,
                           headers={"Idempotency-Key": run.key(name, *key_parts)})  # idemproxy
        answer.raise_for_status()
        served = "replayed" if answer.headers.get("idempotent-replayed") == "true" else "live"
        print(f"tool {name}: {served} #{answer.json()['n']}", flush=True)
        if name == crash_after:  # after the side effect, before the checkpoint of this node
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

    tools = [send_email, charge_card, send_receipt]
    llm = ChatOpenAI(model="gpt-4o-mini", base_url=run.url("openai", "/v1"),  # idemproxy
                     # The credential decides the journal's tenant: every attempt sends the same one.
                     api_key=SecretStr(os.environ.get("OPENAI_API_KEY") or "idemproxy-injected"))
    model = llm.bind_tools(tools)

    def agent(state: MessagesState) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


def main() -> int:
    args = parse_args()
    with (Run(hook="langgraph", attach=True) as run,  # idemproxy
          SqliteSaver.from_conn_string(CHECKPOINTS) as checkpointer):
        app = build_graph(run, args.crash_after, checkpointer)
        thread = {"configurable": {"thread_id": run.run_id}}
        pending = app.get_state(thread).next
        print(f"run {run.run_id} epoch {run.epoch}: "
              f"{'resuming before ' + ','.join(pending) if pending else 'new thread'}", flush=True)
        if pending:  # a checkpoint to resume from: LangGraph runs the pending node again
            final = app.invoke(None, thread)
        else:
            prompt = f"Fulfil order {ORDER['order']} for {ORDER['email']}.\nPLAN: {json.dumps(PLAN)}"
            final = app.invoke({"messages": [SystemMessage(INSTRUCTIONS), HumanMessage(prompt)]}, thread)
    print(f"done: {final['messages'][-1].content}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
