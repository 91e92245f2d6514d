"""An async agent that drafts emails with a model and sends them through idemproxy.

For each recipient it asks the model for a draft (``run.openai()``, an ``AsyncOpenAI``
under ``AsyncRun``) and sends it with the email tool (examples/email_tool_server.py,
upstream ``email``), which has no deduplication of its own. Every send carries the
explicit key ``run.key("email", to)``: the same in every attempt, known before the call.
Started with ``--crash-at K`` the process SIGKILLs itself right after the K-th email went
out. The supervisor starts this script again (hook ``email_agent`` in
examples/config.toml); the first K sends are answered from the journal, the rest go out,
and the outbox holds each email once.

    IDEM_RUN_ID=email-1 python examples/email_agent.py --to ada@example.com --to alan@example.com \\
        --crash-at 1

A key protects a send only if the request under it is the same in every attempt (else
the proxy answers 422 ``key-reused``): here the draft comes from a journaled model call,
so a replayed draft is byte for byte the first one. Do not put a clock in the body.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from idemproxy_client import AsyncRun

DEFAULT_RECIPIENTS = ["ada@example.com", "alan@example.com", "grace@example.com",
                      "edsger@example.com", "barbara@example.com"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--to", action="append", metavar="ADDRESS",
                        help="a recipient; may repeat (default: five; kept with the run)")
    parser.add_argument("--crash-at", type=int, metavar="K", help="SIGKILL after the K-th email")
    return parser.parse_args()


def served(headers) -> str:
    """How the proxy answered: from its journal, or by calling the upstream."""
    return "replayed" if headers.get("idempotent-replayed") == "true" else "live"


async def main() -> int:
    args = parse_args()
    metadata = {"recipients": args.to} if args.to else None
    async with AsyncRun(hook="email_agent", metadata=metadata) as run:
        recipients = list(run.info.metadata.get("recipients", DEFAULT_RECIPIENTS)
                          if run.info else DEFAULT_RECIPIENTS)
        total = len(recipients)
        print(f"run {run.run_id} epoch {run.epoch}: {total} emails", flush=True)
        async with run.openai() as llm, run.aiohttp_session("email") as email:
            for n, to in enumerate(recipients, 1):
                raw = await llm.chat.completions.with_raw_response.create(
                    model="gpt-4o-mini",
                    messages=[{"role": "user", "content": f"Write a two-line status email to {to}."}])
                draft = raw.parse().choices[0].message.content or ""
                async with email.post("send", json={"to": to, "subject": "Status", "body": draft},
                                      headers={"Idempotency-Key": run.key("email", to)}) as sent:
                    sent.raise_for_status()
                    message = await sent.json()
                print(f"step {n}/{total}: model {served(raw.headers)}, tool {served(sent.headers)}: "
                      f"{message['id']} to {to}", flush=True)
                if n == args.crash_at:
                    print(f"crash: SIGKILL after email {n}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
    print(f"done: {total} emails, run {run.run_id} is {run.info.state if run.info else '?'}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
