"""The agent of ``bench/resume.py``: N steps, each a model call and a tool POST, on the client library.

Each step is what an agent does: a chat completion (the official ``openai`` SDK, from
``run.openai()``) whose prompt carries the last tool result, then a tool call (httpx, from
``run.client("tools")``), both without keys: the proxy derives them. An attempt that
has replayed nothing by step ``AGENT_CRASH_AT`` (the first one) SIGKILLs itself right
after that step: no cleanup, no goodbye, like an OOM kill. A later attempt replays those
steps and goes live after them; the run is completed when the block ends.

Started by the supervisor's command hook, it continues the run named by ``IDEM_*``.
Started by the benchmark itself (the held-connection path), it registers
``AGENT_RUN_ID`` with ``attach=True`` (the client option of issue 14).

One JSON line per milestone on stdout (start, kill, replayed, live, done), with
``time.time()``, for the benchmark to read from the log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

PROCESS_STARTED = time.time()

from idemproxy_client import Run  # noqa: E402 - after the clock starts: imports are part of a restart

STEPS = int(os.environ.get("AGENT_STEPS", "240"))
CRASH_AT = int(os.environ.get("AGENT_CRASH_AT", "200"))


PROXY_TIME = re.compile(r"idemproxy;dur=([0-9.]+)")


def say(event: str, **fields) -> None:
    print(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}), flush=True)


def proxy_ms(headers) -> float:
    """The proxy's own time for an answer, from its ``Server-Timing``."""
    found = PROXY_TIME.search(headers.get("server-timing", ""))
    return float(found.group(1)) if found else 0.0


def main() -> int:
    say("process", since_process_start=time.time() - PROCESS_STARTED, started=PROCESS_STARTED)
    options = {"attach": True} if os.environ.get("AGENT_ATTACH") == "1" else {}
    with Run(os.environ.get("AGENT_RUN_ID"), timeout_s=float(os.environ.get("AGENT_TIMEOUT_S", "60")),
             hook=os.environ.get("AGENT_HOOK", "agent") or None, **options) as run:
        llm = run.openai()
        tools = run.client("tools", timeout=30)
        say("start", epoch=run.epoch, since_process_start=time.time() - PROCESS_STARTED)
        replayed = {"chat": 0, "tool": 0}
        last_result, live_at, first_request, in_proxy = "none", None, time.time(), 0.0
        for step in range(1, STEPS + 1):
            raw = llm.chat.completions.with_raw_response.create(
                model="fake-model",
                messages=[{"role": "system", "content": "You send one email per step."},
                          {"role": "user", "content": f"step {step}; last tool result: {last_result}"}])
            completion = raw.parse()
            chat_replayed = raw.headers.get("idempotent-replayed") == "true"
            sent = tools.post("/send_email", json={"step": step, "text": completion.choices[0].message.content})
            sent.raise_for_status()
            last_result = str(sent.json()["n"])
            replayed["chat"] += chat_replayed
            replayed["tool"] += sent.headers.get("idempotent-replayed") == "true"
            in_proxy += proxy_ms(raw.headers) + proxy_ms(sent.headers)
            if not chat_replayed and live_at is None:
                live_at = step
                say("live", step=step, replayed=dict(replayed))
            if step == CRASH_AT:
                say("replayed" if replayed["chat"] else "kill", step=step, replayed=dict(replayed),
                    since_first_request=time.time() - first_request, in_proxy_s=in_proxy / 1000)
                if not replayed["chat"]:  # the first attempt: die here
                    os.kill(os.getpid(), signal.SIGKILL)
    say("done", epoch=run.epoch, replayed=replayed, live_at=live_at)
    return 0


if __name__ == "__main__":
    sys.exit(main())
