"""An agent on the official OpenAI SDK, made replay-safe with ``idemproxy_client.Run``.

Each step is a model call (journaled by the proxy under a key it derives itself) and a
tool POST (journaled under an explicit key from ``run.key``). Started with
``--crash-at K`` it kills itself with SIGKILL after step K, like an OOM kill: no cleanup,
no goodbye. The supervisor notices the silence and starts this script again (hook
``openai_agent`` in examples/config.toml); the new attempt replays steps 1..K from the
journal, nothing reaches the provider or the tool twice, and it goes live at step K+1.

    IDEM_RUN_ID=openai-1 python examples/openai_agent.py --steps 6 --crash-at 3

Each step prints whether its calls were ``replayed`` from the journal or ``live``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from idemproxy_client import Run

DEFAULT_STEPS = 6
SYSTEM = "You are a careful agent. Answer in one sentence what to do next."


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help=f"steps of the task (default {DEFAULT_STEPS}; "
                        "kept with the run, so a restarted attempt does the same task)")
    parser.add_argument("--crash-at", type=int, metavar="K", help="SIGKILL this process after step K")
    return parser.parse_args()


def served(headers) -> str:
    """How the proxy answered: from its journal, or by calling the upstream."""
    return "replayed" if headers.get("idempotent-replayed") == "true" else "live"


def crash(step: int) -> None:
    print(f"crash: SIGKILL after step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    args = parse_args()
    # The task's inputs live with the run (its metadata): the attempt the supervisor
    # starts gets no arguments and reads them back from the proxy.
    metadata = {"steps": args.steps} if args.steps is not None else None
    with Run(hook="openai_agent", metadata=metadata) as run:
        steps = int(run.info.metadata.get("steps", DEFAULT_STEPS)) if run.info else DEFAULT_STEPS
        print(f"run {run.run_id} epoch {run.epoch}: {steps} steps", flush=True)
        with run.openai() as llm, run.client("tools", timeout=30) as tools:
            last_result = "nothing yet"
            for step in range(1, steps + 1):
                raw = llm.chat.completions.with_raw_response.create(
                    model="gpt-4o-mini",
                    messages=[{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": f"Step {step} of {steps}. "
                                                          f"Last tool result: {last_result}."}])
                plan = raw.parse().choices[0].message.content or ""
                # The key exists before the call and is the same in every attempt: a
                # restarted attempt's POST meets the crashed one's journal entry.
                sent = tools.post("/record_step", json={"step": step, "plan": plan},
                                  headers={"Idempotency-Key": run.key("record_step", step)})
                sent.raise_for_status()
                last_result = f"entry {sent.json()['n']}"
                print(f"step {step}/{steps}: model {served(raw.headers)}, "
                      f"tool {served(sent.headers)}: {plan}", flush=True)
                if step == args.crash_at:
                    crash(step)
    # Leaving the block marked the run completed: the supervisor will not start it again.
    print(f"done: {steps} steps, run {run.run_id} is {run.info.state if run.info else '?'}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
