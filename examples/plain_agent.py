"""An ordinary agent that has never heard of idemproxy.

It uses the OpenAI SDK, configured the usual way by ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY``, and posts each step's result to its tool server at ``TOOLS_URL``
with httpx. No idempotency keys, no run ids: pointed at a run-scoped proxy URL, the
proxy derives a key for every call from the request and how many identical requests
came before it in this attempt, so a restarted attempt's n-th call meets the crashed
one's n-th record. examples/only_env.sh does the pointing:

    IDEM_RUN_ID=plain-1 sh examples/only_env.sh python examples/plain_agent.py --crash-at 3

``AGENT_STEPS`` (default 6) sets the length of the task; ``--crash-at K`` makes the
process SIGKILL itself after step K, like an OOM kill.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import httpx
from openai import OpenAI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crash-at", type=int, metavar="K", help="SIGKILL this process after step K")
    args = parser.parse_args()
    steps = int(os.environ.get("AGENT_STEPS", "6"))
    tools_url = os.environ.get("TOOLS_URL", "http://127.0.0.1:9100/tools")

    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    with httpx.Client(base_url=tools_url, timeout=30) as tools:
        last_result = "nothing yet"
        for step in range(1, steps + 1):
            completion = client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": f"Step {step} of {steps}. "
                                                      f"Last tool result: {last_result}."}])
            plan = completion.choices[0].message.content or ""
            result = tools.post("/log_step", json={"step": step, "plan": plan})
            result.raise_for_status()
            last_result = f"entry {result.json()['n']}"
            print(f"step {step}/{steps}: {plan}", flush=True)
            if step == args.crash_at:
                print(f"crash: SIGKILL after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    print(f"done: {steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
