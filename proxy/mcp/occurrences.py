"""Which occurrence of an identical ``tools/call`` a request is, in its run's attempt.

The derived key counts identical calls in an attempt (docs/concepts.md): the n-th identical call of a
restarted attempt maps onto the n-th recorded one. But an MCP client whose response stream
breaks re-issues the same call with a new JSON-RPC id (MCP 2026-07-28, SEP-2575), and
parallel tool calls can send the same call twice at once. Neither is a new step: until an
answer to occurrence n has reached the agent, an identical call *is* occurrence n, and joins
it (still in flight) or replays it (recorded meanwhile). Once an answer was delivered, the
next identical call is the next occurrence, counted in the store as any derived key is.

Undelivered occurrences are kept in this process's memory for ``REISSUE_WINDOW_S``: a
re-issue reaches the replica that saw the stream break (sticky routing); on another replica
it counts as the next occurrence.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Awaitable, Callable

REISSUE_WINDOW_S = 600.0  # how long an undelivered answer waits for its call to be re-issued
MAX_OPEN = 10_000  # undelivered occurrences kept per process; the oldest go first

Site = tuple[str, str, str, int | None, str]  # tenant, namespace, run, epoch, fingerprint


class Occurrences:
    def __init__(self) -> None:
        # per call site, the occurrence whose answer has not reached the agent, and since when
        self._open: OrderedDict[Site, tuple[asyncio.Future, float]] = OrderedDict()

    async def take(self, site: Site, count: Callable[[], Awaitable[int]]) -> int:
        """The occurrence of a call at ``site``: the undelivered one, else the next ``count()``."""
        self._forget_old()
        held = self._open.get(site)
        if held is not None:
            return await asyncio.shield(held[0])
        number: asyncio.Future = asyncio.get_running_loop().create_future()
        self._open[site] = (number, time.monotonic())  # before the count: a duplicate waits for it
        try:
            number.set_result(await count())
        except BaseException as exc:
            self._open.pop(site, None)
            number.set_exception(exc)
            number.exception()  # retrieved: a duplicate may never have awaited it
            raise
        return number.result()

    def delivered(self, site: Site, n: int) -> None:
        """An answer to occurrence ``n`` reached the agent: the next identical call is n + 1."""
        held = self._open.get(site)
        if held is not None and held[0].done() and not held[0].exception() and held[0].result() == n:
            del self._open[site]

    def _forget_old(self) -> None:
        horizon = time.monotonic() - REISSUE_WINDOW_S
        while self._open:
            site, (number, since) = next(iter(self._open.items()))
            if since >= horizon and len(self._open) <= MAX_OPEN:
                return
            if number.done():
                del self._open[site]
            else:
                self._open.move_to_end(site)  # still being counted: not ours to drop
                return
