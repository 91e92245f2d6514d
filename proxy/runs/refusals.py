"""The refusals a run's attempts got from the proxy, kept per run (docs/operations.md).

A proxied call of a run that the proxy answers with 409 (a conflict: in flight, epoch ahead,
run ended), 412 (a superseded attempt, fenced), 422 (a key reused with another request) or
502 (the upstream failed, or a quarantined key's outcome is unknown) is counted on its run,
and the last KEEP of them are kept, for the console's timeline, ``idemproxy runs show`` and
the admin API. One small store write per refusal, none for an answered call. What is kept
is the problem's type and status, the attempt, the upstream, the method and the path within
the upstream: never a body, a header, a query string (which may carry a key) or the run
token's path segment.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..problems import PROBLEMS, Problem
from ..store.composed import Store
from ..store.errors import StoreError

log = logging.getLogger("idemproxy.proxy")

KEPT_STATUSES = frozenset({409, 412, 422, 502})
KEEP = 20  # refusals kept per run; every one is counted


class Refusals:
    """Keeps the refusals of runs' calls in the store's audit, for the journal's retention."""

    def __init__(self, store: Store, retention_s: float):
        self._store, self._retention_s = store, retention_s

    async def note(self, call: "RunCall", problem: Problem) -> None:
        if problem.status not in KEPT_STATUSES:
            return
        refusal = {"at": time.time(), "epoch": call.epoch, "status": problem.status, "type": problem.slug,
                   "title": PROBLEMS[problem.slug].title, "upstream": call.upstream, "method": call.method,
                   "path": call.path}
        if isinstance(problem.extra.get("kid"), str):
            refusal["kid"] = problem.extra["kid"]
        try:
            await self._store.audit.refused(call.namespace, call.run, refusal, KEEP, self._retention_s)
        except StoreError as exc:  # the refusal is answered all the same; only its count is lost
            log.warning("refusal of run %s not counted: %s", call.run, exc)
        except Exception:  # noqa: BLE001 - never turns the refusal itself into a 500
            log.exception("refusal of run %s not counted", call.run)


@dataclass(slots=True)  # not frozen: made for every call of a run, and a frozen one costs 5x to make
class RunCall:
    """A proxied call of a run, as its refusal is kept: ``path`` is within the upstream."""
    refusals: Refusals
    namespace: str
    run: str
    epoch: int | None
    upstream: str
    method: str
    path: str

    async def refused(self, problem: Problem) -> None:
        await self.refusals.note(self, problem)
