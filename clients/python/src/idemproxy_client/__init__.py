"""idemproxy-client: make an agent replay-safe behind idemproxy.

    from idemproxy_client import Run

    with Run("order-42", timeout_s=120) as run:
        llm = run.openai()                           # model calls are journaled and replayed
        key = run.key("charge", order_id)            # the same key in every attempt
        run.client("tools").post("/charge", json=..., headers={"Idempotency-Key": key})

A crashed run restarted by the supervisor (or started again by anything else) replays
its recorded calls from the proxy's journal and goes live where it stopped.
"""

from .errors import (IdemProxyError, ProblemError, ProxyUnreachable, RunEnded, RunExists,
                     RunNotFound, Superseded)
from .info import RunInfo
from .keys import step_key
from .launch import Launch
from .run import Run

__version__ = "0.1.0"

__all__ = [
    "IdemProxyError", "Launch", "ProblemError", "ProxyUnreachable", "Run", "RunEnded",
    "RunExists", "RunInfo", "RunNotFound", "Superseded", "step_key",
]
