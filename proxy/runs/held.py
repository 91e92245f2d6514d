"""The held connections of this process, and the one task that notices when they drop.

aiohttp tells a handler nothing when its client goes away while it streams an answer
(``handler_cancellation`` is off: a recorded call must outlive its caller), and a
request without a body gives it nothing to read that would fail. So one task looks at
the socket of every held connection every ``DROP_POLL_S``, a pass over all of them at
once: a socket the peer's kernel closed (the agent's process died) shows as a closing
transport. (Where handler cancellation is on, as in aiohttp's test server, the handler
is cancelled instead; what follows the drop runs apart from it either way.) A proxy that shuts down ends every hold with ``CLOSING`` instead, which
marks nothing: its clients reconnect to another replica.
"""

from __future__ import annotations

import asyncio
from enum import StrEnum
from typing import Any, Coroutine

from aiohttp import web

from ..errors import client_gone

DROP_POLL_S = 0.05


class Ending(StrEnum):
    """Why a hold ended before its timeout."""
    DROPPED = "dropped"  # the client's socket closed
    CLOSING = "closing"  # this proxy is shutting down


class Attachments:
    """Held connections (``POST /runs/{id}/attach``) of this process, watched together."""

    def __init__(self) -> None:
        self._held: dict[asyncio.Future, web.BaseRequest] = {}
        self._watcher: asyncio.Task | None = None
        self._closing = False
        self._after: set[asyncio.Task] = set()  # what follows a drop: the grace, then a verdict

    def __len__(self) -> int:
        return len(self._held)

    async def wait(self, request: web.BaseRequest, timeout: float) -> Ending | None:
        """Until ``request``'s socket closes or the proxy shuts down; None after ``timeout``."""
        if self._closing:
            return Ending.CLOSING
        ended: asyncio.Future = asyncio.get_running_loop().create_future()
        self._held[ended] = request
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch(), name="idemproxy-attachments")
        try:
            done, _ = await asyncio.wait({ended}, timeout=timeout)
            return ended.result() if done else None
        finally:
            del self._held[ended]
            ended.cancel()

    def after_drop(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` (the grace, then a verdict) apart from the handler, which aiohttp may
        cancel once its client is gone."""
        task = asyncio.get_running_loop().create_task(work)
        self._after.add(task)
        task.add_done_callback(self._after.discard)

    async def close_all(self) -> None:
        """The proxy is shutting down: end every hold, and refuse new ones, with CLOSING; let
        the drops before it have their verdict while the store is still open."""
        self._closing = True
        for ended in self._held:
            if not ended.done():
                ended.set_result(Ending.CLOSING)
        await asyncio.gather(*self._after, return_exceptions=True)

    async def _watch(self) -> None:
        while self._held:
            await asyncio.sleep(DROP_POLL_S)
            for ended, request in list(self._held.items()):
                if client_gone(request) and not ended.done():
                    ended.set_result(Ending.DROPPED)
