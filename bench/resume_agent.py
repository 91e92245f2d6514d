"""The agent of ``bench/resume.py``: N steps, each a model call and a tool POST, on the client library.

Each step is what an agent does: a chat completion (the official ``openai`` SDK, from
``run.openai()``) whose prompt carries the last tool result, then a tool call (httpx, from
``run.client("tools")``), both without keys: the proxy derives them. An attempt that
has replayed nothing by step ``AGENT_CRASH_AT`` (the first one) SIGKILLs itself right
after that step: no cleanup, no goodbye, like an OOM kill. A later attempt replays those
steps and goes live after them; the run is completed when the block ends.

Started by the supervisor's command hook, it continues the run named by ``IDEM_*``.
Started by the benchmark itself (the held-connection path), it registers
``AGENT_RUN_ID`` with ``attach=True`` (the client's held connection); with
``AGENT_ELSEWHERE=1`` its held connection names it as a process on another host, so the
proxy waits out its grace instead of seeing the process exit.
With ``AGENT_DIRECT_URL`` it does ``AGENT_CRASH_AT`` steps straight to that upstream, no
proxy: what the same calls cost the agent alone.

``AGENT_SDK=httpx`` makes the model call a plain httpx POST instead of the openai SDK's: the
same request and answer without the SDK's own work per call (request types transformed,
answer parsed into models), which on this machine is most of what a replay costs the agent.
``AGENT_SDK=stdlib`` makes both calls with ``http.client`` on one kept-alive connection each,
at the run's URLs and with the run's headers (``run.url``, ``run.headers``): the least a
Python agent spends per call, so that a replay's time is mostly the proxy's own.

One JSON line per milestone on stdout (process, start, kill, replayed, live, done,
direct), with ``time.time()``, for the benchmark to read from the log.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import sys
import time
import urllib.parse
from typing import Callable, Mapping

PROCESS_STARTED = time.time()

import httpx  # noqa: E402 - after the clock starts: imports are part of a restart
from idemproxy_client import Run  # noqa: E402

SDK = os.environ.get("AGENT_SDK", "openai")  # or "httpx", "stdlib"
if os.environ.get("AGENT_ELSEWHERE") == "1":  # as an agent on another host: a boot id not the proxy's
    import idemproxy_client.attach
    idemproxy_client.attach.process_token = lambda: "another-host 4026531836 1 1"
if SDK == "openai":  # an agent that does not use the SDK does not pay for its import
    from openai import OpenAI

IMPORTED = time.time(), time.process_time()  # what the agent's imports took (wall, CPU)

STEPS = int(os.environ.get("AGENT_STEPS", "240"))
CRASH_AT = int(os.environ.get("AGENT_CRASH_AT", "200"))
PROXY_TIME = re.compile(r"idemproxy;dur=([0-9.]+)")
# A model the price database knows, as a real agent's is: the proxy prices what each replay
# saved (idemproxy_cost_saved_usd_total) as it would in production. The fake upstream echoes it.
MODEL = os.environ.get("AGENT_MODEL", "gpt-4o-mini")
CREDENTIAL = {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'sk-bench')}"}  # what the SDK sends

Chat = Callable[[list], tuple[str, Mapping[str, str]]]  # messages -> the answer's text and headers
Tool = Callable[[dict], tuple[dict, Mapping[str, str]]]  # arguments -> the tool's answer and headers


def sdk_chat(llm: "OpenAI") -> Chat:
    def chat(messages: list) -> tuple[str, httpx.Headers]:
        raw = llm.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        return raw.parse().choices[0].message.content, raw.headers
    return chat


def httpx_chat(llm: httpx.Client) -> Chat:
    def chat(messages: list) -> tuple[str, httpx.Headers]:
        answer = llm.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        answer.raise_for_status()
        return answer.json()["choices"][0]["message"]["content"], answer.headers
    return chat


def httpx_tool(tools: httpx.Client) -> Tool:
    def tool(arguments: dict) -> tuple[dict, httpx.Headers]:
        sent = tools.post("/send_email", json=arguments)
        sent.raise_for_status()
        return sent.json(), sent.headers
    return tool


def stdlib_post(url: str, headers: Mapping[str, str]) -> Callable[[dict], tuple[dict, Mapping[str, str]]]:
    """POST JSON to ``url`` on one kept-alive ``http.client`` connection."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {**headers, "Content-Type": "application/json"}

    def post(payload: dict) -> tuple[dict, Mapping[str, str]]:
        conn.request("POST", parts.path, json.dumps(payload).encode(), headers)
        answer = conn.getresponse()
        body = answer.read()
        if answer.status >= 400:
            raise RuntimeError(f"{parts.path} answered {answer.status}: {body[:200]!r}")
        return json.loads(body), answer.headers
    return post


def stdlib_chat(url: str, headers: Mapping[str, str]) -> Chat:
    post = stdlib_post(url + "/v1/chat/completions", {**headers, **CREDENTIAL})

    def chat(messages: list) -> tuple[str, Mapping[str, str]]:
        answer, answer_headers = post({"model": MODEL, "messages": messages})
        return answer["choices"][0]["message"]["content"], answer_headers
    return chat


def say(event: str, **fields) -> None:
    print(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}), flush=True)


class Agent:
    """The steps, and what came of them: replays, and the proxy's own time (its Server-Timing)."""

    def __init__(self, chat: Chat, tool: Tool):
        self.chat, self.tool = chat, tool
        self.last_result = "none"
        self.replayed = {"chat": 0, "tool": 0}
        self.in_proxy_s = 0.0

    def step(self, step: int) -> bool:
        """One step; whether its model call was a replay."""
        text, chat_headers = self.chat(
            [{"role": "system", "content": "You send one email per step."},
             {"role": "user", "content": f"step {step}; last tool result: {self.last_result}"}])
        sent, tool_headers = self.tool({"step": step, "text": text})
        self.last_result = str(sent["n"])
        chat_replayed = chat_headers.get("idempotent-replayed") == "true"
        self.replayed["chat"] += chat_replayed
        self.replayed["tool"] += tool_headers.get("idempotent-replayed") == "true"
        self.in_proxy_s += (_proxy_ms(chat_headers) + _proxy_ms(tool_headers)) / 1000
        return chat_replayed


def _proxy_ms(headers) -> float:
    found = PROXY_TIME.search(headers.get("server-timing", ""))
    return float(found.group(1)) if found else 0.0


def attempt() -> None:
    """This attempt of the run: replay what is recorded, go live, die once at CRASH_AT."""
    options = {"attach": True} if os.environ.get("AGENT_ATTACH") == "1" else {}
    with Run(os.environ.get("AGENT_RUN_ID"), timeout_s=float(os.environ.get("AGENT_TIMEOUT_S", "60")),
             hook=os.environ.get("AGENT_HOOK", "agent") or None, **options) as run:
        if SDK == "stdlib":
            agent = Agent(stdlib_chat(run.url("openai"), run.headers()),
                          stdlib_post(run.url("tools", "/send_email"), run.headers()))
        else:
            llm = (sdk_chat(run.openai()) if SDK == "openai" else
                   httpx_chat(run.client("openai", timeout=30, headers=CREDENTIAL)))
            agent = Agent(llm, httpx_tool(run.client("tools", timeout=30)))
        say("start", epoch=run.epoch, since_process_start=time.time() - PROCESS_STARTED,
            cpu_s=time.process_time())
        first_request, first_cpu, live_at = time.time(), time.process_time(), None
        for step in range(1, STEPS + 1):
            if not agent.step(step) and live_at is None:
                live_at = step
                say("live", step=step, replayed=dict(agent.replayed))
            if step == CRASH_AT:
                say("replayed" if agent.replayed["chat"] else "kill", step=step, replayed=dict(agent.replayed),
                    since_first_request=time.time() - first_request, in_proxy_s=agent.in_proxy_s,
                    agent_cpu_s=time.process_time() - first_cpu)
                if not agent.replayed["chat"]:  # the first attempt: die here
                    os.kill(os.getpid(), signal.SIGKILL)
    say("done", epoch=run.epoch, replayed=agent.replayed, live_at=live_at)


def direct(upstream: str) -> None:
    if SDK == "stdlib":
        agent = Agent(stdlib_chat(upstream, {}), stdlib_post(upstream + "/tools/send_email", {}))
    else:
        llm = (sdk_chat(OpenAI(base_url=upstream + "/v1", api_key="sk-bench")) if SDK == "openai" else
               httpx_chat(httpx.Client(base_url=upstream, headers=CREDENTIAL, timeout=30)))
        agent = Agent(llm, httpx_tool(httpx.Client(base_url=upstream + "/tools", timeout=30)))
    began, cpu = time.time(), time.process_time()
    for step in range(1, CRASH_AT + 1):
        agent.step(step)
    say("direct", steps=CRASH_AT, seconds=time.time() - began, cpu_s=time.process_time() - cpu)


def main() -> int:
    say("process", since_process_start=time.time() - PROCESS_STARTED, started=PROCESS_STARTED,
        imports_s=IMPORTED[0] - PROCESS_STARTED, imports_cpu_s=IMPORTED[1])
    if os.environ.get("AGENT_DIRECT_URL"):
        direct(os.environ["AGENT_DIRECT_URL"])
    else:
        attempt()
    return 0


if __name__ == "__main__":
    sys.exit(main())
