"""idemproxy-client: make an agent replay-safe behind idemproxy.

    from idemproxy_client import Run

    with Run("order-42", timeout_s=120) as run:
        llm = run.openai()                           # model calls are journaled and replayed
        key = run.key("charge", order_id)            # the same key in every attempt
        run.client("tools").post("/charge", json=..., headers={"Idempotency-Key": key})

asyncio code uses ``AsyncRun`` the same way, with async clients and awaited methods:

    from idemproxy_client import AsyncRun

    async with AsyncRun("order-42", timeout_s=120) as run:
        async with run.openai() as llm:              # an openai.AsyncOpenAI
            reply = await llm.chat.completions.create(...)

``attach=True`` holds a connection to the proxy for the attempt, so that a supervisor
restarts the run the moment this process dies (within the proxy's ``attach_grace_s``),
not after ``timeout_s`` of silence.

In a standby (a process the supervisor started ahead, ``[hooks.NAME] standby = N``),
``Run()`` waits until the supervisor names its run; ``wait_for_assignment()`` does the
same for code that reads ``IDEM_*`` itself.

A crashed run restarted by the supervisor (or started again by anything else) replays
its recorded calls from the proxy's journal and goes live where it stopped.
``run.info.state`` is a ``RunState`` (running, restarting, completed, failed, dead).
"""

from .async_run import AsyncRun
from .attach import AsyncAttachment, Attachment
from .errors import (IdemProxyError, ProblemError, ProxyUnreachable, RunEnded, RunExists,
                     RunNotFound, Superseded)
from .info import RunInfo, RunState
from .keys import step_key
from .launch import Launch
from .run import Run
from .standby import StandbyDismissed, wait_for_assignment

__version__ = "0.2.0"

__all__ = [
    "AsyncAttachment", "AsyncRun", "Attachment", "IdemProxyError", "Launch", "ProblemError", "ProxyUnreachable", "Run",
    "RunEnded", "RunExists", "RunInfo", "RunNotFound", "RunState", "StandbyDismissed", "Superseded",
    "step_key", "wait_for_assignment",
]
