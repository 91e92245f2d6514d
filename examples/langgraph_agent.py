"""A LangGraph agent whose model and tool calls go through idemproxy.

The graph is two explicit steps in a loop: ``think`` asks the model (``ChatOpenAI`` on the
run's proxy URL) what to do, ``act`` does it with a tool POST that carries an explicit key
from ``run.key``. Started with ``--crash-at K`` the process SIGKILLs itself inside ``act``
of step K, right after the tool call went out. The supervisor starts this script again
(hook ``langgraph_agent`` in examples/config.toml); the graph runs from the start, steps
1..K are answered from the journal, and the tool has still been called once per step.

Why not a LangGraph checkpointer alone? It saves state *between* nodes: a node that
crashed after its side effect but before its checkpoint runs again on resume, and the
email goes out twice. The proxy's journal sits at the call itself, so that retry is
answered from the record.

examples/frameworks/langgraph_agent.py is the tutorial's tool-calling graph (``ToolNode``,
``tools_condition``) with a durable ``SqliteSaver`` in play: resumed from its checkpoint, the
tools node that charged the card runs again and is answered from the journal.

    IDEM_RUN_ID=langgraph-1 python examples/langgraph_agent.py --steps 6 --crash-at 3
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TypedDict

import httpx
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from pydantic import SecretStr

from idemproxy_client import Run

DEFAULT_STEPS = 6
SYSTEM = "You are a careful agent. Answer in one sentence what to do next."


class AgentState(TypedDict):
    step: int          # the step being worked on, from 1
    steps: int         # how many steps the task has
    plan: str          # the model's answer in this step
    last_result: str   # what the tool said last


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help=f"steps of the task (default {DEFAULT_STEPS}; "
                        "kept with the run, so a restarted attempt does the same task)")
    parser.add_argument("--crash-at", type=int, metavar="K", help="SIGKILL this process in step K")
    return parser.parse_args()


def served(headers) -> str:
    """How the proxy answered: from its journal, or by calling the upstream."""
    return "replayed" if headers.get("idempotent-replayed") == "true" else "live"


def build_graph(run: Run, llm: ChatOpenAI, tools: httpx.Client, crash_at: int | None):
    """think -> act -> think ... until the last step, then the end."""
    model_said: dict[int, str] = {}  # step -> replayed/live, for the progress line

    def think(state: AgentState) -> dict:
        answer = llm.invoke([SystemMessage(SYSTEM),
                             HumanMessage(f"Step {state['step']} of {state['steps']}. "
                                          f"Last tool result: {state['last_result']}.")])
        model_said[state["step"]] = served(answer.response_metadata.get("headers", {}))
        return {"plan": str(answer.content)}

    def act(state: AgentState) -> dict:
        step = state["step"]
        sent = tools.post("/record_step", json={"step": step, "plan": state["plan"]},
                          headers={"Idempotency-Key": run.key("record_step", step)})
        sent.raise_for_status()
        print(f"step {step}/{state['steps']}: model {model_said.get(step, '?')}, "
              f"tool {served(sent.headers)}: {state['plan']}", flush=True)
        if step == crash_at:  # after the side effect, before LangGraph hears of it
            print(f"crash: SIGKILL in step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return {"step": step + 1, "last_result": f"entry {sent.json()['n']}"}

    def next_node(state: AgentState) -> str:
        return "think" if state["step"] <= state["steps"] else END

    graph = StateGraph(AgentState)
    graph.add_node("think", think)
    graph.add_node("act", act)
    graph.add_edge(START, "think")
    graph.add_edge("think", "act")
    graph.add_conditional_edges("act", next_node, ["think", END])
    return graph.compile()


def main() -> int:
    args = parse_args()
    metadata = {"steps": args.steps} if args.steps is not None else None
    with Run(hook="langgraph_agent", metadata=metadata) as run:
        steps = int(run.info.metadata.get("steps", DEFAULT_STEPS)) if run.info else DEFAULT_STEPS
        print(f"run {run.run_id} epoch {run.epoch}: {steps} steps", flush=True)
        llm = ChatOpenAI(model="gpt-4o-mini", base_url=run.url("openai", "/v1"),
                         # The credential decides the journal's tenant: every attempt
                         # must send the same one (or none, when the proxy injects it).
                         api_key=SecretStr(os.environ.get("OPENAI_API_KEY") or "idemproxy-injected"),
                         include_response_headers=True)
        with run.client("tools", timeout=30) as tools:
            agent = build_graph(run, llm, tools, args.crash_at)
            final = agent.invoke({"step": 1, "steps": steps, "plan": "", "last_result": "nothing yet"},
                                 {"recursion_limit": 2 * steps + 5})
    print(f"done: {final['step'] - 1} steps, run {run.run_id} is "
          f"{run.info.state if run.info else '?'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
