"""A plain agent: N steps, each a model call (official openai SDK) and a tool POST (httpx).

It knows nothing about idemproxy beyond the environment a supervisor hook gives it
(``IDEM_RUN_BASE``, ``IDEM_EPOCH``, ``IDEM_PROXY_URL``, ``IDEM_RUN_ID``): its model and
tool base URLs point below ``$IDEM_RUN_BASE``, so the proxy journals every call and a
restarted attempt replays what the dead one already did.

On its first attempt (epoch 0) it kills itself with SIGKILL right after step
``AGENT_CRASH_AT`` (default 200): no cleanup, no goodbye, like an OOM kill.

It prints one JSON line per milestone (start, crash, replayed, live, done) with
``time.time()``, so a test can measure the crash-to-restart and replay times.
"""

import json
import os
import signal
import sys
import time


def say(event: str, **fields) -> None:
    print(json.dumps({"event": event, "t": time.time(), "epoch": EPOCH, **fields}), flush=True)


EPOCH = int(os.environ["IDEM_EPOCH"])
say("start", pid=os.getpid(), attempt=os.environ.get("IDEM_ATTEMPT"))

# What a one-line wrapper would do: OPENAI_BASE_URL=$IDEM_RUN_BASE/openai/v1 python agent.py
os.environ["OPENAI_BASE_URL"] = os.environ["IDEM_RUN_BASE"] + "/openai/v1"

import httpx  # noqa: E402 - after the start line, so the import time shows in the figures
from openai import OpenAI  # noqa: E402

STEPS = int(os.environ.get("AGENT_STEPS", "240"))
CRASH_AT = int(os.environ.get("AGENT_CRASH_AT", "200"))


def main() -> int:
    client = OpenAI()  # base URL and API key from the environment
    tools = httpx.Client(base_url=os.environ["IDEM_RUN_BASE"] + "/tools", timeout=30)
    replayed = {"chat": 0, "tool": 0}
    last_result = "none"
    first_request = time.time()
    live_at = None
    for step in range(1, STEPS + 1):
        raw = client.chat.completions.with_raw_response.create(
            model="fake-model",
            messages=[{"role": "system", "content": "You send one email per step."},
                      {"role": "user", "content": f"step {step}; last tool result: {last_result}"}])
        completion = raw.parse()
        chat_replayed = raw.headers.get("idempotent-replayed") == "true"
        sent = tools.post("/send_email", json={"step": step, "text": completion.choices[0].message.content})
        sent.raise_for_status()
        tool_replayed = sent.headers.get("idempotent-replayed") == "true"
        last_result = str(sent.json()["n"])
        replayed["chat"] += chat_replayed
        replayed["tool"] += tool_replayed
        if not chat_replayed and live_at is None:
            live_at = step
            say("live", step=step, replayed=dict(replayed), since_first_request=time.time() - first_request)
        if step == CRASH_AT and EPOCH > 0:
            say("replayed", step=step, replayed=dict(replayed), since_first_request=time.time() - first_request)
        if step == CRASH_AT and EPOCH == 0:
            say("crash", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
    done = httpx.post(f"{os.environ['IDEM_PROXY_URL']}/runs/{os.environ['IDEM_RUN_ID']}/complete", timeout=30)
    done.raise_for_status()
    say("done", steps=STEPS, replayed=replayed, state=done.json()["state"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
